"""The decode GEMMs' sm_90 build (no GPU needed): the weight tile is the dot's left operand, so each
dot compiles to wgmma reading the weights from shared memory, not to mma.sync fed through ldmatrix
(whose waits ncu showed stalling the MoE GEMMs; moe_triton's docstring).

The kernels are compiled for sm_90 in a process outside the interpreter, with the shipped tiles and
the 16-divisibility the launcher specialises the pointers, sizes and strides on.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels import sm90_build  # noqa: E402

_BUILD = """
import json, sys
from freetoken.kernels import linear_triton, moe_exit_triton as mx, moe_route_triton as mr, moe_triton, norm_triton, rope_triton
from tests.kernels import sm90_build

def ptx(kernel, pointers, ints, constants, options, unspecialised=("T", "M")):
    signature = dict(pointers) | {name: "i32" for name in ints} | {name: "constexpr" for name in constants}
    divisible = tuple(n for n in signature if signature[n] != "constexpr" and n not in unspecialised)
    return sm90_build.ptx(kernel, signature, constants, options, divisible)

m, lt = moe_triton, linear_triton
i32 = {"sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32"}
# The router logits' row stride is 16-aligned (moe_gate_triton), so specialised.
built = {
    "gate_up": ptx(m._gate_up_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16"} | i32
                   | {"logits_ptr": "*bf16", "experts_ptr": "*i32", "weights_ptr": "*bf16", "ready_ptr": "*i32", "slot_ptr": "*i32"},
                   ("T", "H", "I", "C", "stride_xm", "stride_we", "stride_wn", "stride_hm", "stride_l", "E"),
                   dict(ROW_K=9, BLOCK_M=mr.BLOCK_M, BLOCK_N=m.GATE_UP_BLOCK_N, BLOCK_K=m.GATE_UP_BLOCK_K, DOT_F32=False,
                        ROUTE_HERE=True, TOP_K=8, TOP_K_POW2=8, BLOCK_E=256, ROW_READY=True, REP=m.GATE_UP_WARPS, SLOTTED=False, PDL=True),
                   {"num_warps": m.GATE_UP_WARPS, "num_stages": m.GATE_UP_STAGES}, unspecialised=("T", "E")),
}
# The combines (in down, on their own, in the next add + norm) fuse no product into a sum (fma).
for combine_in_down in (False, True):
    built["down" if not combine_in_down else "down_combine"] = ptx(
        m._down_kernel, {"h_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"} | i32
        | {"experts_ptr": "*i32", "weights_ptr": "*bf16", "shared_ptr": "*bf16", "gate_ptr": "*bf16", "y_ptr": "*bf16", "counter_ptr": "*i32", "logits_ptr": "*bf16", "ready_ptr": "*i32", "slot_ptr": "*i32"},
        ("T", "H", "I", "C", "stride_hm", "stride_we", "stride_wn", "stride_om", "N", "first", "stride_sm", "stride_gm", "stride_ym", "stride_l", "E", "up_tiles"),
        dict(BLOCK_M=mr.BLOCK_M, BLOCK_N=m.DOWN_BLOCK_N, BLOCK_K=m.DOWN_BLOCK_K, DOT_F32=False, COMBINE=combine_in_down, TOP_K=8, TOP_K_POW2=8,
             ROW_K=9, BLOCK_TOK=m.BLOCK_TOK, SHARED=True, ROUTE_HERE=True, BLOCK_E=256, ROW_READY=True, PERIOD=64,
             WEIGHTED_BY_ID=not combine_in_down, REP=m.DOWN_WARPS, SLOTTED=False, PDL=True),  # the decode step's ("down"): its combine deferred to the exit
        {"num_warps": m.DOWN_WARPS, "num_stages": m.DOWN_STAGES}, unspecialised=("T", "N", "first", "E", "up_tiles"))
built["combine"] = ptx(m._combine_kernel, {"out_ptr": "*bf16", "experts_ptr": "*i32", "weights_ptr": "*bf16", "shared_ptr": "*bf16", "gate_ptr": "*bf16", "y_ptr": "*bf16"},
                       ("N", "H", "first", "C", "stride_om", "stride_sm", "stride_gm", "stride_ym"),
                       dict(TOP_K=8, TOP_K_POW2=8, ROW_K=9, BLOCK_TOK=m.BLOCK_TOK, BLOCK_H=m.BLOCK_H, SHARED=True, PDL=True), {"num_warps": 4}, unspecialised=("N",))
for weighted_by_id in (False, True):
    built[f"exit_weighted_by_id_{weighted_by_id}"] = ptx(
        mx._combine_add_norm_kernel,
        {"rows_ptr": "*bf16", "experts_ptr": "*i32", "weights_ptr": "*bf16", "gate_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "sum_ptr": "*bf16", "y_ptr": "*bf16", "pf_ptr": "*i8", "eps": "fp32"},
        ("H", "stride_rows", "stride_g", "stride_r", "stride_s", "stride_y", "pf_lines", "num_tokens"),
        dict(TOP_K=8, TOP_K_POW2=8, ROW_K=9, BLOCK_H=2048, WEIGHTED_BY_ID=weighted_by_id, PREFETCH=False, PDL=True),
        {"num_warps": norm_triton.ADD_NORM_WARPS}, unspecialised=("num_tokens", "eps"))
# q/k norm + RoPE: each rotation product rounded to bf16 before the sum, as rope_ref; Qwen3.5's, and
# qwen4_exp's attention (YaRN-scaled cos/sin, 1 + 0.1 ln 4) and indexer (no key stored) with mRoPE.
for name, variant in (("norm_rope", dict(MROPE=False, S_H=0, S_W=0, COS_SCALE=1.0, STORE_K=True)),
                      ("norm_rope_yarn", dict(MROPE=True, S_H=11, S_W=10, COS_SCALE=1.1386294361119891, STORE_K=True)),
                      ("norm_rope_no_key", dict(MROPE=True, S_H=11, S_W=10, COS_SCALE=1.1386294361119891, STORE_K=False))):
    built[name] = ptx(rope_triton._norm_rope_kernel,
                      {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr", "q_out_ptr", "k_cache_ptr", "v_cache_ptr")}
                      | {"pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "slot_ptr": "*i64", "pf_ptr": "*i8", "eps": "fp32"},
                      ("Hq", "D", "q_row", "q_head", "k_row", "k_head", "v_row", "v_head", "qo_row", "qo_head", "cache_slot", "cache_head", "pf_lines", "num_rows", "pos_stride"),
                      dict(ROT=64, D_PAD=256, PREFETCH=False, PDL=True) | variant, {"num_warps": rope_triton.NUM_WARPS},
                      unspecialised=("num_rows", "eps", "pos_stride"))
cfg = lt.config_for(2048, 4096, __import__("torch").bfloat16)  # the 35B-A3B output projection: split K
built["linear"] = ptx(lt._linear_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32"},
                      ("M", "N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_ym"),
                      dict(BLOCK_M=lt.BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split, DEFER=False, DOT_F32=False, PDL=True),
                      {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
cfg = lt.config_for(12352, 2048, __import__("torch").bfloat16)  # the 35B-A3B GDN input projection, its convolution in the launch
built["linear_conv"] = ptx(lt._linear_conv_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "win_ptr": "*bf16", "conv_w_ptr": "*bf16", "slots_ptr": "*i32"},
                           ("M", "N", "K", "C", "stride_xm", "stride_wn", "stride_ym", "win_slot", "win_t", "conv_wc"),
                           dict(BLOCK_M=lt.BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_F32=False, PDL=True),
                           {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}, unspecialised=("M", "conv_wc"))
order = {name: [built[name].find(op) for op in ops] for name, ops in
         (("gate_up", ("griddepcontrol.wait", "wgmma.mma_async", ".gpu.release.add")),
          ("down", ("griddepcontrol.launch_dependents", ".gpu.acquire", "wgmma.mma_async", "griddepcontrol.wait")))}
p = built["gate_up"]
routing = p[p.find("griddepcontrol.launch_dependents"):p.find("cp.async")]  # from the wait to the first weight load
json.dump({"dots": {name: [p.count("wgmma.mma_async"), p.count("mma.sync")] for name, p in built.items()}, "order": order,
           "bf16_fma": {name: p.count("fma.rn.bf16") for name, p in built.items()},
           "routing_barriers": routing.count("bar.sync"), "routing_redux": routing.count("redux.sync")}, sys.stdout)
"""


@pytest.fixture(scope="module")
def counts():
    return json.loads(sm90_build.run(_BUILD))


@pytest.mark.parametrize("kernel", ["gate_up", "down", "linear", "linear_conv"])
def test_decode_gemm_dots_are_wgmma_in_the_sm90_build(counts, kernel):
    wgmma, mma_sync = counts["dots"][kernel]
    assert wgmma > 0 and mma_sync == 0, f"{kernel}: {wgmma} wgmma, {mma_sync} mma.sync"


def test_down_waits_for_its_row_not_the_gate_up_grid_in_the_sm90_build(counts):
    """moe_triton.DOWN_WAITS_FOR_ROW: gate_up raises its row's counter (release) after its dots; down
    lets the next kernel launch, spins on the counter (acquire) before its dots, and waits for the
    gate_up grid only after them, so the launch after down still finds gate_up finished."""
    for kernel, positions in counts["order"].items():
        assert -1 not in positions and positions == sorted(positions), f"{kernel}: {positions}"


def test_the_gemms_routing_stays_inside_each_warp_in_the_sm90_build(counts):
    """moe_triton.ROUTE_PER_WARP: with a copy of the token's logits per warp, the routing's eleven
    reductions (softmax max and sum, eight picks, the weights' sum) are warp reductions (redux.sync for
    each pick's int64 key); the one barrier left takes the slot's pick out of the copies."""
    assert counts["routing_barriers"] <= 1, counts["routing_barriers"]
    assert counts["routing_redux"] >= 16, counts["routing_redux"]


@pytest.mark.parametrize("kernel", ["down", "down_combine", "combine", "exit_weighted_by_id_False", "exit_weighted_by_id_True", "norm_rope",
                                    "norm_rope_yarn", "norm_rope_no_key"])
def test_products_rounded_before_a_sum_stay_unfused_in_the_sm90_build(counts, kernel):
    """The MoE combines round each weighted row to x.dtype before adding it, and the RoPE each rotation
    product, as torch does. With FP fusion on the compiler narrows a bf16 product and the following bf16
    sum to bf16 ops and contracts them into fma.rn.bf16x2 (one rounding, not two); then the combine of
    the rows down weighted (`WEIGHTED_BY_ID`) and the combines that weight them themselves differ.
    compat_triton.mul_rn keeps such products alone."""
    assert counts["bf16_fma"][kernel] == 0, f"{kernel}: {counts['bf16_fma'][kernel]} fma.rn.bf16"


_QSA_BUILD = """
import json, sys
import triton
from freetoken.kernels import qsa_attention_triton as qa, qsa_ref as qr, qsa_select_triton as qs
from tests.kernels import sm90_build

ptx = sm90_build.ptx_of

# QSA (qwen4_exp's real shapes: 4 indexer heads of 128, rotary 64, blocks of 4, budget 2048; 12 query heads per KV head of 256)
built = {}
built["qsa_score"] = ptx(qs._score_kernel, {"q_ptr": "*bf16", "raw_ptr": "*bf16", "w_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "key_ptr": "*i32",
                                            "group_ptr": "*i32", "row_seq_ptr": "*i32", "ctx_len_ptr": "*i32", "table_ptr": "*i32"},
                         ("H", "D", "page_size", "top_blocks", "max_blocks", "row0", "q_row", "q_head", "raw_slot", "rope_seq", "rope_block", "table_row"),
                         ("eps", "sqrt_d"),
                         dict(RATIO=4, ROT=64, R=4, H_PAD=4, D_PAD=128, BLOCK_B=qs.BLOCK_B, DOT_F32=False, PDL=True), {"num_warps": qs.NUM_WARPS},
                         unspecialised=("H", "row0", "rope_seq", "top_blocks", "max_blocks"))
built["qsa_select"] = ptx(qs._select_kernel, {"key_ptr": "*i32", "ids_ptr": "*i32", "count_ptr": "*i32", "ctx_len_ptr": "*i32"},
                          ("top_blocks", "max_blocks", "row0", "ids_row"), (),
                          dict(RATIO=4, TOP_PAD=512, CHUNK=qs.SELECT_CHUNK, PDL=True), {"num_warps": qs.NUM_WARPS}, unspecialised=("row0",))
ints = ("ids_ptr", "count_ptr", "row_seq_ptr", "ctx_len_ptr", "table_ptr")
built["qsa_partition"] = ptx(qa._partition_kernel, {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr")} | {n: "*fp32" for n in ("m_ptr", "l_ptr", "acc_ptr")}
                             | {n: "*i32" for n in ints},
                             ("G", "D", "page_size", "num_parts", "row0", "q_row", "q_head", "kv_slot", "kv_head", "ids_row", "table_row"), ("scale",),
                             dict(RATIO=4, G_PAD=16, D_PAD=256, PARTITION=qr.PARTITION, DOT_F32=False, PDL=True), {"num_warps": qa.NUM_WARPS},
                             unspecialised=("G", "num_parts", "row0"))
built["qsa_merge"] = ptx(qa._merge_kernel, {n: "*fp32" for n in ("m_ptr", "l_ptr", "acc_ptr")} | {"gate_ptr": "*bf16", "o_ptr": "*bf16", "count_ptr": "*i32", "ctx_len_ptr": "*i32"},
                         ("D", "num_parts", "row0", "gate_row", "gate_head", "o_row", "o_head"), (),
                         dict(RATIO=4, PARTITION=qr.PARTITION, PARTS_PAD=triton.next_power_of_2(triton.cdiv(2048 + 3, qr.PARTITION)),
                              MERGE_PARTS=qr.MERGE_PARTS, D_PAD=256, HAS_GATE=True, PDL=True), {"num_warps": qa.MERGE_WARPS}, unspecialised=("num_parts", "row0"))
json.dump({name: {"ptx_chars": len(p), "bf16_fma": p.count("fma.rn.bf16"), "div_rn": p.count("div.rn.f32"),
                  "tensor_core_dots": p.count("mma.sync") + p.count("wgmma.mma_async"), "f32_fma": p.count("fma.rn.f32")} for name, p in built.items()}, sys.stdout)
"""


@pytest.fixture(scope="module")
def qsa_ptx():
    return json.loads(sm90_build.run(_QSA_BUILD))


def test_qsa_kernels_build_for_sm90(qsa_ptx):
    """The QSA score, select, partition and merge kernels compile for the H200; the pooled keys' rotation
    products stay rounded alone (no fma.rn.bf16) and their mean and the score scale are IEEE divisions;
    the partition's two bf16 dots run on tensor cores; the merge (with the output gate) divides by the
    IEEE division."""
    assert set(qsa_ptx) == {"qsa_score", "qsa_select", "qsa_partition", "qsa_merge"} and all(p["ptx_chars"] > 0 for p in qsa_ptx.values())
    assert qsa_ptx["qsa_score"]["bf16_fma"] == 0 and qsa_ptx["qsa_score"]["div_rn"] > 0
    assert qsa_ptx["qsa_partition"]["tensor_core_dots"] > 0, qsa_ptx["qsa_partition"]
    assert qsa_ptx["qsa_merge"]["div_rn"] > 0


_QWEN4_BUILD = """
import json, sys
from freetoken.kernels import dilated_conv_triton as dc, hc_triton as hc, norm_triton, ple_gate_triton as pg, ple_ngram_triton as pn
from tests.kernels import sm90_build

ptx = sm90_build.ptx_of

# qwen4_exp's real shapes: 4 streams of 2560, PLE conv of 4 taps at dilation 3 over 10240 channels
built = {}
built["grouped_norm"] = ptx(norm_triton._rms_norm_kernel, {n: "*bf16" for n in ("x_ptr", "z_ptr", "w_ptr", "y_ptr")},
                            ("D", "stride_x", "stride_z", "stride_y", "z_heads", "z_head_stride", "w_groups"), ("eps",),
                            dict(MODE=0, ACT=0, BLOCK_D=4096, PDL=True), {"num_warps": 8}, unspecialised=("z_heads", "z_head_stride", "w_groups"))
built["ple_gate"] = ptx(pg._gated_value_kernel, {n: "*bf16" for n in ("k_ptr", "q_ptr", "v_ptr", "w_ptr", "gv_ptr", "gvn_ptr")},
                        ("H", "stride_k", "stride_q", "stride_v", "stride_gv", "stride_gvn"), ("inv_sqrt_h", "eps"),
                        dict(BLOCK_H=4096, PDL=True), {"num_warps": pg.NUM_WARPS})
built["ple_conv"] = ptx(dc._dilated_conv_kernel, {n: "*bf16" for n in ("win_ptr", "x_ptr", "w_ptr", "y_ptr")}
                        | {n: "*i32" for n in ("starts_ptr", "counts_ptr", "slots_ptr", "cached_ptr")},
                        ("C", "write_state", "win_slot", "win_t", "x_row", "w_c", "y_row"), (),
                        dict(KW=4, DILATION=3, BLOCK_W=16, BLOCK_C=dc.BLOCK_C, PDL=True), {"num_warps": dc.NUM_WARPS}, unspecialised=("write_state", "w_c"))
built["ple_ngram"] = ptx(pn._ngram_tokens_kernel, {n: "*i64" for n in ("win_ptr", "ids_ptr", "out_ptr")}
                         | {n: "*i32" for n in ("starts_ptr", "counts_ptr", "slots_ptr", "cached_ptr")},
                         ("eos", "write_state", "win_slot", "out_row"), (),
                         dict(NGRAM=3, BLOCK_T=pn.BLOCK_T, BLOCK_W=2, PDL=True), {"num_warps": pn.NUM_WARPS}, unspecialised=("eos", "write_state"))
# the hyper-connections' gates (rank 320 + 4 injection columns), mean over the streams, injection (+ the next norm)
built["hc_gates"] = ptx(hc._gates_kernel, {n: "*bf16" for n in ("a_ptr", "g_ptr", "w_ptr")}, ("R", "K", "stride_a", "stride_g", "stride_w"), ("streams",),
                        dict(BLOCK=512, PDL=True), {"num_warps": hc.NUM_WARPS}, unspecialised=("K", "stride_a", "stride_w"))
built["hc_mix_mean"] = ptx(hc._mix_mean_kernel, {n: "*bf16" for n in ("up_ptr", "xn_ptr", "u_ptr")}, ("H", "stride_up", "stride_xn", "stride_u"), (),
                           dict(S=4, BLOCK_H=hc.MIX_BLOCK_H, PDL=True), {"num_warps": hc.NUM_WARPS})
for norm in (False, True):
    built[f"hc_inject_norm_{norm}"] = ptx(hc._inject_kernel, {n: "*bf16" for n in ("x_ptr", "y_ptr", "w_ptr", "norm_w_ptr", "out_ptr", "xn_ptr")},
                                          ("H", "stride_x", "stride_y", "stride_w", "stride_out", "stride_xn"), ("eps",),
                                          dict(NORM=norm, BLOCK_H=4096, PDL=True), {"num_warps": hc.NUM_WARPS}, unspecialised=("stride_w",))
json.dump({name: {"ptx_chars": len(p), "bf16_fma": p.count("fma.rn.bf16"), "mul_rn": p.count("mul.rn.f32"), "div_rn": p.count("div.rn.f32")}
           for name, p in built.items()}, sys.stdout)
"""


def test_qwen4_exp_kernels_build_for_sm90():
    """The grouped per-stream norm, the PLE n-gram columns, gated value and dilated convolution, and the
    hyper-connections' gates, mean and injection compile for the H200 at the real shapes; none contracts
    a bf16 product into a bf16 sum (no fma.rn.bf16): the mean's and the injection's products stay
    rounded alone (mul.rn.f32, compat_triton.mul_rn), and the hyper-connections divide by IEEE division."""
    built = json.loads(sm90_build.run(_QWEN4_BUILD))
    assert set(built) == {"grouped_norm", "ple_gate", "ple_conv", "ple_ngram", "hc_gates", "hc_mix_mean", "hc_inject_norm_False", "hc_inject_norm_True"}
    assert all(p["ptx_chars"] > 0 for p in built.values())
    assert all(p["bf16_fma"] == 0 for p in built.values()), built
    assert all(built[name]["mul_rn"] > 0 for name in ("hc_mix_mean", "hc_inject_norm_False", "hc_inject_norm_True")), built
    assert all(built[name]["div_rn"] > 0 for name in ("hc_gates", "hc_mix_mean")), built
