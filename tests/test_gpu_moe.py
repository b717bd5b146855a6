"""CUDA-only checks of the grouped expert kernel (parallel/experts.py): torch._grouped_mm in bf16 on the
GPU against the float64 per-expert loop on the host (same bf16 inputs), outputs and every gradient, with
idle experts, uneven counts (not multiples of 8) and no rows at all; the dispatch choosing it for bf16 on
sm90/sm100; the single-rank dispatch with it against the float64 reference, and its forward without a
host synchronisation. Skipped on machines without CUDA; the CPU side is tests/test_grouped_experts.py.
Bounds: estimates (bf16 rounding of the gate/up output, the activation and the results; the CPU runs of
the same cases measure <= 1e-2), not yet measured on a GPU."""

from __future__ import annotations

import pytest
import torch

from parallel.experts import choose_kernel, dispatch_alltoall, expert_mlp, expert_mlp_grouped, route

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BF16_TOL = 3e-2  # max |grouped - exact| / max |exact| per tensor
HIDDEN, INTER = 256, 128
COUNTS = [3, 0, 37, 1, 0, 64, 5, 0, 130, 2]


def _grouped_fast_path() -> bool:
    """torch runs its CUTLASS grouped kernel (bf16) on sm90 and sm100 only."""
    return torch.cuda.get_device_capability()[0] in (9, 10)


def _inputs(counts, seed=0):
    """bf16 values (exactly representable, so the host reference starts from the same numbers)."""
    gen = torch.Generator().manual_seed(seed)
    rows, experts = sum(counts), len(counts)
    x = torch.randn(rows, HIDDEN, generator=gen)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) * 0.05
    w2 = torch.randn(experts, HIDDEN, INTER, generator=gen) * 0.05
    cot = torch.randn(rows, HIDDEN, generator=gen)
    return [t.bfloat16() for t in (x, w13, w2, cot)]


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() if b.numel() else 0.0


def _exact(counts, x, w13, w2, cot):
    leaves = [t.double().requires_grad_(True) for t in (x, w13, w2)]
    out = expert_mlp(leaves[0], list(counts), leaves[1], leaves[2])
    (out * cot.double()).sum().backward()
    return [out] + [t.grad for t in leaves]


def _on_gpu(fn, counts, x, w13, w2, cot):
    leaves = [t.cuda().requires_grad_(True) for t in (x, w13, w2)]
    out = fn(leaves[0], counts, leaves[1], leaves[2])
    (out * cot.cuda()).sum().backward()
    torch.cuda.synchronize()
    return [out] + [t.grad for t in leaves]


def test_dispatch_picks_grouped_for_bf16_on_cuda():
    x, w13, w2, _ = [t.cuda() for t in _inputs([2, 3])]
    assert choose_kernel(x, w13, w2) == ("grouped" if _grouped_fast_path() else "loop")
    assert choose_kernel(x.float(), w13.float(), w2.float()) == "loop"  # fp32: torch's per-group fallback
    assert choose_kernel(x, w13, w2, "loop") == "loop"
    assert choose_kernel(x.cpu(), w13.cpu(), w2.cpu()) == "loop"


@pytest.mark.parametrize("counts", [COUNTS, [0] * 9 + [17], [8, 8, 8, 8]])
def test_grouped_bf16_matches_float64_loop(counts):
    x, w13, w2, cot = _inputs(counts)
    exact = _exact(counts, x, w13, w2, cot)
    grouped = _on_gpu(lambda a, c, b, d: expert_mlp_grouped(a, torch.tensor(c, device="cuda"), b, d),
                      counts, x, w13, w2, cot)
    loop = _on_gpu(lambda a, c, b, d: expert_mlp(a, list(c), b, d), counts, x, w13, w2, cot)
    for name, g, lp, ex in zip(("output", "x_grad", "w13_grad", "w2_grad"), grouped, loop, exact):
        assert g.dtype == torch.bfloat16 and g.shape == ex.shape, name
        assert torch.isfinite(g).all(), name
        assert _rel(g, ex) <= BF16_TOL, f"{name}: grouped vs float64 loop {_rel(g, ex):.3g}"
        assert _rel(lp, ex) <= BF16_TOL, f"{name}: (control) bf16 loop vs float64 loop {_rel(lp, ex):.3g}"
    for e, n in enumerate(counts):  # an idle expert's gradient is exactly zero (empty group in the 2D x 2D form)
        if n == 0:
            assert not grouped[2][e].any() and not grouped[3][e].any(), e


def test_grouped_with_no_rows_on_gpu():
    counts = [0, 0, 0]
    x, w13, w2, cot = _inputs(counts)
    out, gx, g13, g2 = _on_gpu(lambda a, c, b, d: expert_mlp_grouped(a, torch.tensor(c, device="cuda"), b, d),
                               counts, x, w13, w2, cot)
    assert out.shape == (0, HIDDEN) and gx.shape == (0, HIDDEN)
    assert g13.shape == w13.shape and not g13.any() and not g2.any()


def test_single_rank_dispatch_with_grouped_kernel():
    """The whole dispatch (route, sort, experts, weighted combine) in bf16 on the GPU with the default
    kernel (grouped on sm90/sm100) against float64 on the host; its forward makes no host synchronisation."""
    gen = torch.Generator().manual_seed(2)
    num_experts, tokens, top_k = 16, 300, 4
    x0 = torch.randn(tokens, HIDDEN, generator=gen).bfloat16()
    # Router logits with no ties: a permutation of 12 distinct steps of 1/8 per token (exact in bf16).
    # randn logits rounded to bf16 tie at the top-4 boundary (2 tokens of 300 with seed 2), and
    # torch.topk may break a tie differently on CUDA than on the host: the first GPU run (H200,
    # 2026-11-28) failed here at 0.043 on the output while the per-expert grouped tests passed; the
    # host bf16 run of the old inputs measured <= 8.4e-3. Without ties any correct routing agrees.
    steps = torch.stack([torch.randperm(12, generator=gen) for _ in range(tokens)]).float() / 8
    logits0 = torch.cat([steps, torch.full((tokens, num_experts - 12), -50.0)], dim=1).bfloat16()  # 12..15 idle
    w130 = (torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) * 0.05).bfloat16()
    w20 = (torch.randn(num_experts, HIDDEN, INTER, generator=gen) * 0.05).bfloat16()
    cot = torch.randn(tokens, HIDDEN, generator=gen).bfloat16()

    def run(device, dtype, check_sync=False):
        leaves = [t.to(device, dtype).requires_grad_(True) for t in (x0, logits0, w130, w20)]
        x, logits, w13, w2 = leaves
        if check_sync:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            weights, experts, _ = route(logits, top_k, norm_topk_prob=True)
            out = dispatch_alltoall(x, experts, weights, w13, w2, num_experts)
        finally:
            if check_sync:
                torch.cuda.set_sync_debug_mode("default")
        (out * cot.to(device, dtype)).sum().backward()
        return [out] + [t.grad for t in leaves]

    exact = run("cpu", torch.float64)
    got = run("cuda", torch.bfloat16, check_sync=_grouped_fast_path())
    for name, g, ex in zip(("output", "x", "logits", "w13", "w2"), got, exact):
        assert _rel(g, ex) <= BF16_TOL, f"{name}: {_rel(g, ex):.3g}"
    assert not got[3][12:].any() and not got[4][12:].any()
