"""Triton MoE (grouped expert GEMM) vs an fp64 dense oracle, the torch reference and SparseMoE's torch path.

Checks: values for several token counts on both row layouts (direct up to DIRECT_MAX_ROWS routed rows,
aligned above: tokens sharing experts, one expert with rows over several row blocks); each row's
bits alone (direct) == inside a smaller batch (direct) and a bigger one (aligned), and both layouts
forced on one batch give every row the same bits (on CPU only rows first in their aligned blocks:
the interpreter's tl.dot, NumPy's sgemm, rounds a tile's later rows differently); an expert-parallel slice
(other ranks' experts contribute exactly zero, the slices add up to the whole); the combine with the
gated shared expert fused in == the fp32 partial finished by torch; the shared expert stacked as
expert E == the fp64 oracle, the torch reference and the dense shared MLP's Triton kernels, row by
row invariant; SparseMoE's Triton path (unmerged, merged with the shared expert stacked, merged with
a wider shared expert kept dense) == its torch path, row by row invariant, launching only the Triton
kernels of the block (four when stacked, align above DIRECT_MAX_ROWS routed rows, the combine's own
launch above COMBINE_IN_DOWN_MAX_TOKENS tokens; the down launch's combine has the bits of that one) and no torch op
that computes, and merging keeps the
parameters' names, shapes and the torch path's result; on CUDA, the op and the whole block captured
in a CUDA graph replay new inputs exactly as eager (no host sync in the path), and the block's
kernel count seen by the profiler (four at one token).
On CPU the kernels run under TRITON_INTERPRET=1 at tiny shapes (H=64, E=8, top_k=2, I=32).
Routing and align alone: test_moe_route_triton.py.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES, INTERPRET  # noqa: E402

import freetoken.kernels  # noqa: E402
from freetoken.kernels import moe_ref, moe_route_triton, moe_triton  # noqa: E402
from freetoken.layers.merge import merge_projections  # noqa: E402
from freetoken.layers.moe import SparseMoE  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def shape(device):  # H, E, top_k, I
    return (64, 8, 2, 32) if device == "cpu" else (2048, 256, 8, 512)


def weights_for(device, dtype, seed=0, num_experts=None):
    h, e, _, i = shape(device)
    e = num_experts or e
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype).to(device)
    down = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype).to(device)
    return gate_up, down


def routing(n, device, dtype, seed, shared=None):
    """x [n, H], experts [n, top_k] (distinct per token; all on shared[:top_k] if given), weights [n, top_k]."""
    h, e, k, _ = shape(device)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen).to(dtype)
    if shared is None:
        experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    else:
        experts = torch.tensor(shared[:k]).repeat(n, 1)
    w = torch.rand(n, k, generator=gen) + 0.1
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    return x.to(device), experts.to(device), w.to(device)


def dense_oracle(x, experts, weights, gate_up, down, first=0):
    """fp64, token by token and slot by slot, from the architecture equations (no shared code)."""
    x, gate_up, down = x.double(), gate_up.double(), down.double()
    inter = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for n in range(x.shape[0]):
        for s in range(experts.shape[1]):
            e = int(experts[n, s]) - first
            if 0 <= e < gate_up.shape[0]:
                h = gate_up[e] @ x[n]
                out[n] += float(weights[n, s]) * (down[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


CASES = [  # (tokens, shared experts or None)
    (1, None),  # direct layout (up to DIRECT_MAX_ROWS routed rows, with or without the shared expert)
    (3, None),  # direct
    (40, None),  # aligned: many tokens share each expert
    (40, (1, 3, 5, 9, 17, 33, 64, 100)),  # aligned, every token on the same top_k experts: three row blocks each
]


def first_in_block(blocks):
    """Flat rows that sit first in their row block (the direct layout: every row)."""
    ids = blocks.sorted_ids.view(-1, moe_route_triton.BLOCK_M)[:, 0]
    return set(ids[(blocks.block_expert < blocks.count) & (ids < blocks.rows)].tolist())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_matches_oracle_and_reference(device, dtype):
    gate_up, down = weights_for(device, dtype)
    for seed, (n, shared) in enumerate(CASES):
        x, experts, w = routing(n, device, dtype, seed, shared)
        got = moe_triton.moe_experts(x, experts, w, gate_up, down)
        assert got.dtype == torch.float32 and got.shape == x.shape
        ref = moe_ref.moe_experts(x.cpu(), experts.cpu(), w.cpu(), gate_up.cpu(), down.cpu())
        torch.testing.assert_close(got.cpu(), ref, rtol=TOL[dtype], atol=TOL[dtype], msg=f"{n} tokens vs reference")
        if dtype == torch.float32:
            exact = dense_oracle(x.cpu(), experts.cpu(), w.cpu(), gate_up.cpu(), down.cpu())
            torch.testing.assert_close(got.cpu().double(), exact, rtol=1e-5, atol=1e-5, msg=f"{n} tokens vs fp64")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_rows_are_invariant_to_batch(device, dtype):
    """A row alone (direct) == in a smaller batch (direct) == in a bigger one (aligned); on CPU the
    last only where the row is first in each of its aligned blocks."""
    gate_up, down = weights_for(device, dtype)
    x, experts, w = routing(40, device, dtype, seed=7)
    assert not moe_route_triton.is_direct(experts.numel()) and moe_route_triton.is_direct(3 * experts.shape[1])
    full = moe_triton.moe_experts(x, experts, w, gate_up, down)
    small = moe_triton.moe_experts(x[:3], experts[:3], w[:3], gate_up, down)
    for i in range(3):
        alone = moe_triton.moe_experts(x[i : i + 1], experts[i : i + 1], w[i : i + 1], gate_up, down)
        assert torch.equal(alone, small[i : i + 1]), f"row {i} alone differs from the small batch"
        first = moe_triton.moe_experts(*(torch.cat([t[i : i + 1], t]) for t in (x, experts, w)), gate_up, down)
        assert torch.equal(alone, first[:1]), f"row {i} first in a big batch differs"
        if device == "cuda":
            assert torch.equal(alone, full[i : i + 1]), f"row {i} in the big batch differs"
    # Other neighbours, other positions in the row block, and a crowd on the same experts.
    for i in [3] if device == "cpu" else range(0, 40, 3):
        x2, e2, w2 = routing(40, device, dtype, seed=8 + i, shared=tuple(experts[i].tolist()))
        mixed = moe_triton.moe_experts(torch.cat([x2, x[i : i + 1]]), torch.cat([e2, experts[i : i + 1]]), torch.cat([w2, w[i : i + 1]]), gate_up, down)
        torch.testing.assert_close(mixed[40], full[i], rtol=TOL[dtype], atol=TOL[dtype])
        if device == "cuda":
            assert torch.equal(mixed[40], full[i])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stacked", [False, True])
def test_moe_layouts_agree_bitwise(device, dtype, stacked):
    """One batch through the direct and the aligned layout (both forced): every row's bits equal on CUDA;
    on CPU equal where the row is first in its aligned blocks, and within rounding elsewhere."""
    n = 8
    if stacked:
        gate_up, down = stacked_for(device, dtype)
        x, experts, w = routing(n, device, dtype, seed=5)
        experts = with_shared(experts, gate_up.shape[0] - 1)
        g = torch.randn(n, 1, generator=torch.Generator().manual_seed(5)).to(dtype).to(device)
        run = lambda blocks: moe_triton.moe_experts_with_shared(x, experts, w, gate_up, down, g, blocks)  # noqa: E731
    else:
        gate_up, down = weights_for(device, dtype)
        x, experts, w = routing(n, device, dtype, seed=5)
        run = lambda blocks: moe_triton.moe_experts(x, experts, w, gate_up, down, blocks=blocks)  # noqa: E731
    experts = experts.to(torch.int32).contiguous()
    count = gate_up.shape[0]
    direct, aligned = moe_route_triton.direct_blocks(experts, 0, count), moe_route_triton.align(experts, 0, count)
    assert direct.block_expert.shape[0] == experts.numel() and first_in_block(direct) == set(range(experts.numel()))
    got_direct, got_aligned = run(direct), run(aligned)
    firsts = first_in_block(aligned)
    row_k = experts.shape[1]
    same = [t for t in range(n) if device == "cuda" or all(t * row_k + c in firsts for c in range(row_k))]
    if device == "cpu":
        assert 0 in same and len(same) < n, "the CPU case has rows first in their blocks and rows behind others"
    for t in same:
        assert torch.equal(got_direct[t], got_aligned[t]), f"row {t} differs between the layouts"
    torch.testing.assert_close(got_direct, got_aligned, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_moe_expert_parallel_slices(device):
    gate_up, down = weights_for(device, torch.float32)
    num_experts, half = gate_up.shape[0], gate_up.shape[0] // 2
    x, experts, w = routing(6, device, torch.float32, seed=3)
    experts[0] = torch.arange(experts.shape[1])  # token 0 only on rank 0's experts
    full = moe_triton.moe_experts(x, experts, w, gate_up, down)
    parts = []
    for first in (0, half):
        part = moe_triton.moe_experts(x, experts, w, gate_up[first : first + half], down[first : first + half], first)
        ref = moe_ref.moe_experts(x.cpu(), experts.cpu(), w.cpu(), gate_up[first : first + half].cpu(), down[first : first + half].cpu(), first)
        torch.testing.assert_close(part.cpu(), ref, rtol=1e-5, atol=1e-5)
        exact = dense_oracle(x.cpu(), experts.cpu(), w.cpu(), gate_up[first : first + half].cpu(), down[first : first + half].cpu(), first)
        torch.testing.assert_close(part.cpu().double(), exact, rtol=1e-5, atol=1e-5)
        parts.append(part)
    assert torch.equal(parts[1][0], torch.zeros_like(parts[1][0])), "an expert another rank holds contributed"
    assert num_experts > half
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_with_shared_expert_fused(device, dtype):
    """The fused combine == the fp32 partial, then torch's acc.to(dtype) + sigmoid(g) * shared."""
    gate_up, down = weights_for(device, dtype)
    x, experts, w = routing(40, device, dtype, seed=2)
    gen = torch.Generator().manual_seed(4)
    shared = (torch.randn(x.shape, generator=gen) / 2).to(dtype).to(device)
    logits = torch.randn(40, 3, generator=gen).to(dtype).to(device)  # the gate is a strided column
    got = moe_triton.moe_experts(x, experts, w, gate_up, down, 0, shared, logits[:, 1:2])
    assert got.dtype == dtype and got.shape == x.shape
    acc = moe_triton.moe_experts(x, experts, w, gate_up, down)
    want = acc.to(dtype) + torch.sigmoid(logits[:, 1:2]) * shared
    tol = 1e-6 if dtype == torch.float32 else TOL[dtype]  # sigmoid's last fp32 bits; bf16 roundings (truncations when interpreted)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    ref = moe_ref.moe_experts(x.cpu(), experts.cpu(), w.cpu(), gate_up.cpu(), down.cpu(), 0, shared.cpu(), logits[:, 1:2].cpu())
    torch.testing.assert_close(got.cpu(), ref, rtol=TOL[dtype], atol=TOL[dtype])
    for i in (0, 39):
        alone = moe_triton.moe_experts(x[i : i + 1], experts[i : i + 1], w[i : i + 1], gate_up, down, 0, shared[i : i + 1], logits[i : i + 1, 1:2])
        first = moe_triton.moe_experts(*(torch.cat([t[i : i + 1], t]) for t in (x, experts, w)), gate_up, down, 0, torch.cat([shared[i : i + 1], shared]), torch.cat([logits[i : i + 1], logits])[:, 1:2])
        assert torch.equal(alone, first[:1]), f"row {i} first in a batch differs"
        if device == "cuda":  # NumPy's sgemm (the interpreter's tl.dot) rounds a tile's later rows differently
            assert torch.equal(alone, got[i : i + 1]), f"row {i} alone differs"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_combine_in_down_equals_combine_launch(device, dtype, tokens, monkeypatch):
    """The down launch's combine (its last program per feature tile; up to COMBINE_IN_DOWN_MAX_TOKENS
    tokens) and the combine's own launch give the same bits: partial, with a shared expert, stacked."""
    gate_up, down = weights_for(device, dtype)
    x, experts, w = routing(tokens, device, dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    shared = (torch.randn(x.shape, generator=gen) / 2).to(dtype).to(device)
    gate = torch.randn(tokens, 1, generator=gen).to(dtype).to(device)
    stacked_up, stacked_down = stacked_for(device, dtype)
    num_experts = gate_up.shape[0]
    calls = {
        "partial": lambda: moe_triton.moe_experts(x, experts, w, gate_up, down),
        "shared": lambda: moe_triton.moe_experts(x, experts, w, gate_up, down, 0, shared, gate),
        "stacked": lambda: moe_triton.moe_experts_with_shared(x, with_shared(experts, num_experts), w, stacked_up, stacked_down, gate),
    }
    assert tokens <= moe_triton.COMBINE_IN_DOWN_MAX_TOKENS
    in_down = {name: call() for name, call in calls.items()}
    monkeypatch.setattr(moe_triton, "COMBINE_IN_DOWN_MAX_TOKENS", 0)
    for name, call in calls.items():
        assert torch.equal(in_down[name], call()), f"{name}: the combine in the down launch differs from its own launch"


def stacked_for(device, dtype):
    """gate_up [E + 1, 2I, H], down [E + 1, H, I]: the routed experts, then a shared expert."""
    gate_up, down = weights_for(device, dtype)
    shared_gate_up, shared_down = weights_for(device, dtype, seed=1, num_experts=1)
    return torch.cat([gate_up, shared_gate_up]), torch.cat([down, shared_down])


def with_shared(experts, num_experts):
    return torch.cat([experts, torch.full_like(experts[:, :1], num_experts)], dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_shared_expert_stacked(device, dtype):
    """The shared expert as expert E == the fp64 oracle (fp32), the torch reference, and the routed
    experts plus the dense shared MLP on the Triton kernels (linear, silu_mul, linear); rows invariant."""
    from freetoken.kernels import linear_triton, norm_triton

    gate_up, down = stacked_for(device, dtype)
    num_experts = gate_up.shape[0] - 1
    gen = torch.Generator().manual_seed(6)
    for seed, (n, shared) in enumerate(CASES):
        x, experts, w = routing(n, device, dtype, seed, shared)
        experts = with_shared(experts, num_experts)
        logits = torch.randn(n, 3, generator=gen).to(dtype).to(device)  # the gate is a strided column
        got = moe_triton.moe_experts_with_shared(x, experts, w, gate_up, down, logits[:, 1:2])
        assert got.dtype == dtype and got.shape == x.shape
        dense = linear_triton.linear(norm_triton.silu_mul(linear_triton.linear(x, gate_up[-1])), down[-1])
        want = moe_triton.moe_experts(x, experts[:, :-1], w, gate_up[:-1], down[:-1], 0, dense, logits[:, 1:2])
        torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype], msg=f"{n} tokens vs the dense shared MLP")
        ref = moe_ref.moe_experts_with_shared(x.cpu(), experts.cpu(), w.cpu(), gate_up.cpu(), down.cpu(), logits[:, 1:2].cpu())
        torch.testing.assert_close(got.cpu(), ref, rtol=TOL[dtype], atol=TOL[dtype], msg=f"{n} tokens vs reference")
        if dtype == torch.float32:
            xc, ec, gu, dn = x.cpu(), experts.cpu(), gate_up.cpu(), down.cpu()
            routed = dense_oracle(xc, ec[:, :-1], w.cpu(), gu, dn)
            shared_out = dense_oracle(xc, ec[:, -1:], torch.ones(n, 1), gu, dn)
            exact = routed + torch.sigmoid(logits[:, 1:2].cpu().double()) * shared_out
            torch.testing.assert_close(got.cpu().double(), exact, rtol=1e-5, atol=1e-5, msg=f"{n} tokens vs fp64")
    x, experts, w = routing(40, device, dtype, seed=7)
    experts = with_shared(experts, num_experts)
    assert not moe_route_triton.is_direct(experts.numel()) and moe_route_triton.is_direct(3 * experts.shape[1])
    g = torch.randn(40, 1, generator=gen).to(dtype).to(device)
    full = moe_triton.moe_experts_with_shared(x, experts, w, gate_up, down, g)  # aligned
    small = moe_triton.moe_experts_with_shared(x[:3], experts[:3], w[:3], gate_up, down, g[:3])  # direct
    for i in (0, 2):
        alone = moe_triton.moe_experts_with_shared(x[i : i + 1], experts[i : i + 1], w[i : i + 1], gate_up, down, g[i : i + 1])
        assert torch.equal(alone, small[i : i + 1]), f"row {i} in a direct batch differs"  # every row first in its block
        first = moe_triton.moe_experts_with_shared(*(torch.cat([t[i : i + 1], t]) for t in (x, experts, w)), gate_up, down, torch.cat([g[i : i + 1], g]))
        assert torch.equal(alone, first[:1]), f"row {i} first in an aligned batch differs"
        if device == "cuda":  # NumPy's sgemm (the interpreter's tl.dot) rounds a tile's later rows differently
            assert torch.equal(alone, full[i : i + 1]), f"row {i} in an aligned batch differs"


def moe_block(seed=11, shared_size=None):
    """A SparseMoE block at the test shape with random weights, on the CPU, fp32; the shared expert as
    wide as a routed one unless shared_size is given."""
    h, e, k, i = shape("cpu")
    block = SparseMoE(h, e, k, i, shared_intermediate_size=shared_size or i)
    gen = torch.Generator().manual_seed(seed)
    for p in block.parameters():
        p.data = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
    return block


def merged(block):
    """The engine's merge: the block's [router | shared gate] and its shared expert's [gate | up]."""
    block.merge_projections()
    return merge_projections(block)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("merge", ["none", "stacked", "wide-shared"])
def test_sparse_moe_triton_path_matches_torch_path(device, merge, monkeypatch):
    """fp32 only: in bf16 the two paths' router logits may round apart and pick other experts on a near tie."""
    block = moe_block(shared_size=2 * shape("cpu")[3] if merge == "wide-shared" else None)
    x = torch.randn(40, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(12))  # aligned; its first 3 direct
    monkeypatch.setattr(freetoken.kernels, "MODE", "torch")
    want = block(x)
    block, x = block.to(device), x.to(device)
    if merge != "none":
        before = {name: t.clone() for name, t in block.state_dict().items()}
        merged(block)
        after = block.state_dict()
        assert set(after) == set(before) and all(torch.equal(after[name], t) for name, t in before.items())
        assert block.gates_weight.shape == (9, x.shape[1]) and block.gate.weight.data_ptr() == block.gates_weight.data_ptr()
        assert (block.stacked is not None) == (merge == "stacked")
        if block.stacked is not None:
            gate_up, down = block.stacked
            assert gate_up.shape[0] == down.shape[0] == block.experts.count + 1
            assert block.experts.gate_up_proj.data_ptr() == gate_up.data_ptr() and block.experts.down_proj.data_ptr() == down.data_ptr()
            assert block.shared_expert.gate_proj.weight.data_ptr() == gate_up[-1].data_ptr() and block.shared_expert.down_proj.weight.data_ptr() == down[-1].data_ptr()
        torch.testing.assert_close(block(x).cpu(), want, rtol=1e-6, atol=1e-6, msg="the torch path after merging")
    monkeypatch.setattr(freetoken.kernels, "MODE", "triton")
    got = block(x)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    small = block(x[:3])
    torch.testing.assert_close(small.cpu(), want[:3], rtol=1e-5, atol=1e-5)
    for i in (0, 2):
        alone = block(x[i : i + 1])
        assert torch.equal(alone, block(torch.cat([x[i : i + 1], x]))[:1]), f"row {i} first in a batch differs"
        if device == "cuda":  # NumPy's sgemm (the interpreter's tl.dot) rounds a tile's later rows differently
            assert torch.equal(alone, got[i : i + 1]) and torch.equal(alone, small[i : i + 1]), f"row {i} alone differs"


class _TorchOps(TorchDispatchMode):
    """Records the torch ops run while active, except inside a Triton launch."""

    def __init__(self):
        super().__init__()
        self.ops, self.inside = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


def launches(fn, monkeypatch):
    """(names of the Triton kernels launched, torch ops run outside them) by fn(), under the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    run, kernels, mode = InterpretedFunction.run, [], _TorchOps()

    def counted(kernel, *args, **kwargs):
        kernels.append(kernel.fn.__name__)
        mode.inside = True
        try:
            return run(kernel, *args, **kwargs)
        finally:
            mode.inside = False

    with monkeypatch.context() as patch, mode:
        patch.setattr(InterpretedFunction, "run", counted)
        fn()
    return kernels, mode.ops


@pytest.mark.skipif(not INTERPRET, reason="counts launches under TRITON_INTERPRET=1")
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("tokens", [5, 40, 70])
def test_sparse_moe_launches(stacked, tokens, monkeypatch):
    """Merged, one forward on the Triton path is the merged gate linear, route (which writes the direct
    row blocks up to DIRECT_MAX_ROWS routed rows), align (above that only), gate_up, down, and combine
    above COMBINE_IN_DOWN_MAX_TOKENS tokens only; a shared expert wider than a routed one adds its own
    kernels. Torch only allocates and takes views."""
    monkeypatch.setattr(freetoken.kernels, "MODE", "triton")
    block = merged(moe_block(shared_size=None if stacked else 2 * shape("cpu")[3]))
    x = torch.randn(tokens, block.gate.weight.shape[1])
    shared, _ = launches(lambda: block.shared_expert(x), monkeypatch)
    kernels, ops = launches(lambda: block(x), monkeypatch)
    direct = moe_route_triton.is_direct(tokens * (block.top_k + stacked))
    assert direct == (tokens == 5)
    combine = tokens > moe_triton.COMBINE_IN_DOWN_MAX_TOKENS
    assert combine == (tokens == 70)
    moe = ["_route_kernel", *([] if direct else ["_align_kernel"]), "_gate_up_kernel", "_down_kernel", *(["_combine_kernel"] if combine else [])]
    assert sorted(kernels) == sorted(["_linear_kernel", *moe, *([] if stacked else shared)]), kernels
    computing = [op for op in ops if not op.is_view and op.overloadpacket is not torch.ops.aten.empty]
    assert not computing, f"torch ops on the Triton path: {computing}"


def cuda_block(dtype=torch.bfloat16):
    h, e, k, i = shape("cuda")
    block = SparseMoE(h, e, k, i, shared_intermediate_size=i)
    for p in block.parameters():
        p.data = torch.randn(p.shape) / p.shape[-1] ** 0.5
    return merged(block.to("cuda", dtype))


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA and TRITON_INTERPRET=0")
def test_moe_replays_in_a_cuda_graph():
    gate_up, down = weights_for("cuda", torch.bfloat16)
    x, experts, w = routing(8, "cuda", torch.bfloat16, seed=1)
    moe_triton.moe_experts(x, experts, w, gate_up, down)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_triton.moe_experts(x, experts, w, gate_up, down)
    for seed in (2, 3):
        x2, e2, w2 = routing(8, "cuda", torch.bfloat16, seed=seed, shared=(5, 9, 17, 33, 64, 100, 200, 255) if seed == 3 else None)
        x.copy_(x2), experts.copy_(e2), w.copy_(w2)
        graph.replay()
        assert torch.equal(out, moe_triton.moe_experts(x2, e2, w2, gate_up, down))


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("merge", [False, True])
def test_sparse_moe_forward_has_no_host_sync(merge, monkeypatch):
    h, e, k, i = shape("cuda")
    block = SparseMoE(h, e, k, i, shared_intermediate_size=i)
    for p in block.parameters():
        p.data = torch.randn(p.shape) / p.shape[-1] ** 0.5
    x = torch.randn(4, h)
    monkeypatch.setattr(freetoken.kernels, "MODE", "torch")
    want = block(x)
    monkeypatch.setattr(freetoken.kernels, "MODE", "auto")
    block, x = block.to("cuda"), x.to("cuda")
    if merge:
        merged(block)
    block(x)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host sync now raises
    try:
        got = block(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA and TRITON_INTERPRET=0")
def test_sparse_moe_replays_in_a_cuda_graph():
    block = cuda_block()
    x = torch.randn(8, shape("cuda")[0], device="cuda", dtype=torch.bfloat16)
    block(x)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x)
    for _ in range(2):
        x2 = torch.randn_like(x)
        x.copy_(x2)
        graph.replay()
        assert torch.equal(out, block(x2))


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA and TRITON_INTERPRET=0")
def test_sparse_moe_kernel_count():
    """Merged (the shared expert stacked as expert E), one forward of one token is four kernels: merged
    gate linear, route (writing the direct row blocks), gate_up, down (combining); of 8 tokens (72 routed
    rows) five, align too; of 80 tokens six, the combine's own launch too."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    block = cuda_block()
    xs = [torch.randn(n, shape("cuda")[0], device="cuda", dtype=torch.bfloat16) for n in (1, 8, 80)]
    for x in xs:
        block(x)  # compile and allocate first
    torch.cuda.synchronize()

    def kernels_of(fn):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]

    assert block.stacked is not None
    for x, count in zip(xs, (4, 5, 6)):
        names = kernels_of(lambda: block(x))
        assert len(names) == count, names
