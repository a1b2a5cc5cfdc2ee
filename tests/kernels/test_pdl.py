"""Programmatic dependent launch: off where it cannot apply, and no kernel touches memory before its wait.

A kernel launched with PDL that read or wrote memory before `griddepcontrol.wait` could race with the
previous kernel, so every Triton kernel calls `pdl.sync(PDL)` before any load or store, except the
loads listed in EARLY_READS: of data the launch just before never writes (weights, host copies,
buffers written two or more launches back; pdl.py).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import freetoken.kernels as kernels_pkg
from freetoken.kernels import pdl
from tests.kernels import sm90_build


def _kernels():
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        if info.name.endswith("_triton"):
            module = importlib.import_module(f"freetoken.kernels.{info.name}")
            for name, value in vars(module).items():
                if name.endswith("_kernel") and inspect.isfunction(getattr(value, "fn", None)):  # a @triton.jit kernel (compiled or interpreted)
                    yield f"{info.name}.{name}", value


KERNELS = dict(_kernels())


def test_kernels_are_found():
    assert {"linear_triton._linear_kernel", "attention_triton._partition_kernel", "moe_triton._gate_up_kernel"} <= KERNELS.keys()


EARLY_READS = {  # kernel -> the loads it may issue before its wait
    "moe_gate_triton._add_norm_route_kernel": ["tl.load(gates_ptr", "tl.load(norm_w_ptr"],  # weights
    # written two launches back (or the logits, routed there, and the shared gate's)
    "moe_triton._down_kernel": ["tl.load(gate_ptr", "tl.load(block_expert_ptr", "tl.load(sorted_ids_ptr"],
    "moe_exit_triton._combine_add_norm_kernel": ["tl.load(w_ptr"],  # a weight (its branches: the test below)
    "attention_triton._partition_kernel": ["tl.load(group_ptr", "tl.load(group_ptr", "tl.load(ctx_len_ptr", "tl.load(ctx_len_ptr", "tl.load(row_seq_ptr", "tl.load(table_ptr"],  # host copies
    "attention_triton._merge_kernel": ["tl.load(ctx_len_ptr"],
    # the rows' slots (host copies), the windows (this layer's, a step back), the conv weights
    "linear_triton._linear_conv_kernel": ["tl.load(slots_ptr", "tl.load(win + win_t", "tl.load(win + 2 * win_t", "tl.load(win,", "tl.load(cw,",
                                          "tl.load(cw + 1", "tl.load(cw + 2", "tl.load(cw + 3"],
    "conv_triton._conv_kernel": ["tl.load(starts_ptr", "tl.load(counts_ptr", "tl.load(slots_ptr"],
    # the batch's rows and slots, the state tile (this layer's earlier launches), weights
    "gdn_triton._gdn_fused_kernel": ["tl.load(starts_ptr", "tl.load(counts_ptr", "tl.load(slots_ptr", "tl.load(s_ptrs", "tl.load(a_log_ptr", "tl.load(dt_bias_ptr"],
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_touches_memory_only_after_the_grid_dependency_wait(name):
    source = inspect.getsource(KERNELS[name].fn)
    assert "PDL: tl.constexpr" in source
    assert "    pdl.sync(PDL)\n" in source, f"{name} must call pdl.sync(PDL)"
    # A launch may instead wait on its producers' counters (pdl.wait_count): whichever wait comes first.
    before = source[: min(i for i in (source.find("    pdl.sync(PDL)\n"), source.find("pdl.wait_count(")) if i >= 0)]
    for read in EARLY_READS.get(name, []):
        assert read in before, f"{name}: {read} is listed but not found before the wait"
        before = before.replace(read, "", 1)
    for access in ("tl.load", "tl.store", "tl.atomic", "tl.histogram"):
        assert access not in before, f"{name}: {access} before pdl.sync(PDL)"


@pytest.mark.parametrize("name", sorted(name for name in KERNELS if "pdl.wait_count(" in inspect.getsource(KERNELS[name].fn)))
def test_a_launch_that_waits_on_counters_releases_first_and_waits_for_the_grid_last(name):
    """Before spinning on a counter it lets the next kernel launch, and it ends with the grid wait, so
    the next kernel's wait still covers every launch before it (pdl.py)."""
    source = inspect.getsource(KERNELS[name].fn)
    spin = source.find("pdl.wait_count(")
    assert -1 < source.find("pdl.release(PDL)") < spin < source.rfind("pdl.finish(PDL)")
    assert source.rstrip().endswith("pdl.finish(PDL)")


def test_the_moe_exit_reads_the_routing_before_its_wait_only_where_the_entry_wrote_it():
    """Routed by the entry (three launches back) the exit loads the routing and the shared gate before
    its wait. Routed in the GEMMs the stored routing is gate_up's, two launches back, and the down
    launch between lets the exit launch before gate_up ends (down waits on its rows' counters, not on
    gate_up's grid): that branch loads nothing but the weighted rows, after its wait."""
    source = inspect.getsource(KERNELS["moe_exit_triton._combine_add_norm_kernel"].fn)
    weighted = source[source.index("    if WEIGHTED_BY_ID:"):source.index("    else:  # the entry's routing")]
    entrys = source[source.index("    else:  # the entry's routing"):source.index("    x = (acc")]
    assert weighted.index("pdl.sync(PDL)") < weighted.index("tl.load(") and "experts_ptr" not in weighted and "weights_ptr" not in weighted
    before = entrys[: entrys.index("pdl.sync(PDL)")]
    assert sorted(part.split(" ")[0] for part in before.split("tl.load(")[1:]) == ["experts_ptr", "gate_ptr"]


def test_gate_up_stores_the_routing_before_its_row_counter_lets_down_pass():
    """With the routing in the expert GEMMs (moe_triton.GemmRoute), down's last program of a feature
    tile combines every token from the routing that gate_up stores; down passes its wait on the row
    counter that gate_up raises with release semantics, so the routing is stored before that raise."""
    source = inspect.getsource(KERNELS["moe_triton._gate_up_kernel"].fn)
    assert -1 < source.find("_store_routing(") < source.find("tl.debug_barrier()") < source.find("tl.atomic_add(ready_ptr")


_SM90_PTX = """
from freetoken.kernels import moe_gate_triton
from tests.kernels.sm90_build import ptx

pointers = ("x_ptr", "r_ptr", "norm_w_ptr", "s_ptr", "h_ptr", "gates_ptr", "logits_ptr", "count_ptr",
            "experts_ptr", "weights_ptr", "sorted_ids_ptr", "block_expert_ptr")
signature = {name: "*i32" if name in ("count_ptr", "experts_ptr", "sorted_ids_ptr", "block_expert_ptr") else "*bf16" for name in pointers}
signature |= {name: "i32" for name in ("H", "G", "E")} | {"eps": "fp32"}
signature |= {name: "i32" for name in ("stride_x", "stride_xs", "stride_r", "stride_s", "stride_h", "stride_g", "stride_l", "T", "first", "C", "pf_lines", "num_tokens")}
signature |= {"pf_ptr": "*u8"}
constants = {"X_SPLIT": 0, "BLOCK_H": 2048, "GATE_ROWS": moe_gate_triton.GATE_ROWS, "TOP_K": 8, "TOP_K_POW2": 8, "BLOCK_E": 256, "ROW_K": 9, "REP": 1,
             "BLOCK_M": 16, "DIRECT": True, "ROUTE": True, "PREFETCH": False, "PDL": True}
signature |= {name: "constexpr" for name in constants}
print(ptx(moe_gate_triton._add_norm_route_kernel, signature, constants, {"num_warps": 4, "launch_pdl": True}))
"""


def test_moe_entry_loads_its_gate_rows_before_the_wait_in_the_sm90_build():
    """Compile (no GPU needed; a process outside the interpreter) the fused MoE entry for sm_90 with PDL:
    the PTX loads from global memory (the gate rows), then waits, then releases the next kernel."""
    ptx = sm90_build.run(_SM90_PTX)
    order = [ptx.find(op) for op in ("ld.global", "griddepcontrol.wait", "griddepcontrol.launch_dependents")]
    assert -1 not in order and order == sorted(order)


def test_off_without_a_hopper_gpu_or_when_disabled(monkeypatch):
    pdl.enabled.cache_clear()
    monkeypatch.setenv("FREETOKEN_PDL", "0")
    assert pdl.launch_kwargs() == {"PDL": False, "launch_pdl": False}
    pdl.enabled.cache_clear()
    monkeypatch.delenv("FREETOKEN_PDL")
    import torch

    expected = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and not pdl.INTERPRET
    assert pdl.enabled() == expected
    pdl.enabled.cache_clear()
