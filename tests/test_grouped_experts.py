"""The grouped expert kernel (``parallel/experts.expert_mlp_grouped``: torch._grouped_mm forward and
backward) against the per-expert loop reference and a float64 loop, on CPU: outputs and every gradient
with idle experts, no rows at all, uneven and random counts, fp32 and bf16; the kernel choice; the
dispatcher with either kernel; and a tiny Qwen3-MoE with the grouped kernel forced against transformers.
The CUDA side (bf16 on the GPU's grouped kernel) is tests/test_gpu_moe.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel.experts import (
    choose_kernel,
    dispatch_allgather,
    dispatch_alltoall,
    expert_mlp,
    expert_mlp_grouped,
    grouped_supported,
    route,
)

HIDDEN, INTER = 16, 8
# fp32: grouped and loop differ only in the GEMMs' summation order (on CPU torch runs the same mm per
# group: measured identical); relative to the largest value of each tensor.
FP32_TOL = 1e-6
# bf16 against the float64 loop: inputs exact in bf16, both kernels round the gate/up output, the
# activation and the result to bf16; measured 2.4e-3 .. 9.9e-3 on these cases (the CPU grouped kernel
# equals the bf16 loop bit for bit), bound ~3x.
BF16_TOL = 3e-2


def _inputs(counts, dtype, seed=0, hidden=HIDDEN, inter=INTER):
    gen = torch.Generator().manual_seed(seed)
    rows, experts = sum(counts), len(counts)
    x = torch.randn(rows, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    cot = torch.randn(rows, hidden, generator=gen)
    return [t.to(dtype) for t in (x, w13, w2, cot)]


def _run(kernel, counts, x, w13, w2, cot, dtype=None):
    """Output and gradients (x, w13, w2) of one kernel, inputs cast to ``dtype`` first."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in (x, w13, w2)]
    if kernel == "grouped":
        out = expert_mlp_grouped(leaves[0], torch.tensor(counts), leaves[1], leaves[2])
    else:
        out = expert_mlp(leaves[0], list(counts), leaves[1], leaves[2])
    (out * cot.to(out.dtype)).sum().backward()
    return [out] + [t.grad for t in leaves]


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() if b.numel() else 0.0


def _compare(counts, dtype, tol, seed=0):
    x, w13, w2, cot = _inputs(counts, dtype, seed)
    exact = _run("loop", counts, x, w13, w2, cot.double(), dtype=torch.float64)
    loop = _run("loop", counts, x, w13, w2, cot)
    grouped = _run("grouped", counts, x, w13, w2, cot)
    names = ("output", "x_grad", "w13_grad", "w2_grad")
    for name, g, lp, ex in zip(names, grouped, loop, exact):
        assert g.dtype == dtype and g.shape == ex.shape, name
        assert _rel(g, ex) <= tol, f"{name}: grouped vs float64 loop {_rel(g, ex):.3g} (counts {counts})"
        assert _rel(g, lp) <= tol, f"{name}: grouped vs loop {_rel(g, lp):.3g} (counts {counts})"
    for e, n in enumerate(counts):  # idle experts: exactly zero gradients, present like the others
        if n == 0:
            assert not grouped[2][e].any() and not grouped[3][e].any()
    return grouped


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
@pytest.mark.parametrize("counts", [[3, 0, 7, 1, 0], [1, 1, 1, 1], [0, 0, 9, 0], [13], [2, 5, 0, 0, 0, 0, 1, 17]])
def test_grouped_matches_loop_reference(counts, dtype, tol):
    _compare(counts, dtype, tol)


@pytest.mark.parametrize("kernel", ["grouped", "loop"])
def test_no_rows_gives_zero_gradients_for_every_weight(kernel):
    """A rank whose experts get no token: empty output, and still a (zero) gradient for every weight and
    the input, so gradient reductions and the dispatch's backward run the same on every rank."""
    x, w13, w2, cot = _inputs([0, 0, 0], torch.float32)
    out, gx, g13, g2 = _run(kernel, [0, 0, 0], x, w13, w2, cot)
    assert out.shape == (0, HIDDEN) and gx.shape == (0, HIDDEN)
    assert g13.shape == w13.shape and g2.shape == w2.shape and not g13.any() and not g2.any()


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(0, 9), min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_grouped_matches_loop_on_random_counts(counts, seed):
    _compare(counts, torch.float32, FP32_TOL, seed)


def test_a_wrong_group_boundary_is_caught():
    """Control: the comparison sees a kernel that puts one row in the wrong expert."""
    counts = [3, 4, 2]
    x, w13, w2, cot = _inputs(counts, torch.float32)
    good = _run("loop", counts, x, w13, w2, cot)
    shifted = _run("grouped", [4, 3, 2], x, w13, w2, cot)
    assert _rel(shifted[0], good[0]) > 1e-2 and _rel(shifted[2], good[2]) > 1e-2


def test_kernel_choice_and_refusals():
    x, w13, w2, _ = _inputs([2, 3], torch.float32)
    assert choose_kernel(x, w13, w2) == "loop"  # CPU default: the reference (grouped is no faster here)
    assert choose_kernel(x.bfloat16(), w13.bfloat16(), w2.bfloat16()) == "loop"
    assert choose_kernel(x, w13, w2, "grouped") == "grouped" and choose_kernel(x, w13, w2, "loop") == "loop"
    with pytest.raises(ValueError, match="unknown experts kernel 'fused'"):
        choose_kernel(x, w13, w2, "fused")
    # bf16 with hidden 12 (24-byte rows): not a multiple of 16 bytes, so torch._grouped_mm would refuse it
    xb, w13b, w2b, _ = _inputs([2, 3], torch.bfloat16, hidden=12)
    assert not grouped_supported(xb, w13b, w2b) and grouped_supported(xb.float(), w13b.float(), w2b.float())
    with pytest.raises(ValueError, match="'grouped' needs torch._grouped_mm operands"):
        choose_kernel(xb, w13b, w2b, "grouped")
    assert choose_kernel(xb, w13b, w2b) == "loop"
    assert not grouped_supported(x, w13, w2.double())  # mixed dtypes


@pytest.mark.parametrize("dispatcher", [dispatch_alltoall, dispatch_allgather])
def test_dispatchers_with_either_kernel_agree(dispatcher):
    """One process (EP group of one): the whole MoE dispatch (sort, experts, weighted combine) with the
    grouped kernel equals it with the loop, output and gradients of tokens, router logits and experts;
    a skewed router leaves most experts idle."""
    gen = torch.Generator().manual_seed(3)
    num_experts, tokens, top_k = 8, 11, 3
    x0 = torch.randn(tokens, HIDDEN, generator=gen)
    logits0 = torch.randn(tokens, num_experts, generator=gen)
    logits0[:, 3:] -= 50.0  # only experts 0..2 get tokens
    w130 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) * 0.3
    w20 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) * 0.3
    cot = torch.randn(tokens, HIDDEN, generator=gen)
    results = {}
    for kernel in ("loop", "grouped"):
        leaves = [t.clone().requires_grad_(True) for t in (x0, logits0, w130, w20)]
        x, logits, w13, w2 = leaves
        weights, experts, _ = route(logits, top_k, norm_topk_prob=True)
        out = dispatcher(x, experts, weights, w13, w2, num_experts, kernel=kernel)
        (out * cot).sum().backward()
        results[kernel] = [out] + [t.grad for t in leaves]
    for name, g, lp in zip(("output", "x", "logits", "w13", "w2"), results["grouped"], results["loop"]):
        assert _rel(g, lp) <= FP32_TOL, name
    assert not results["grouped"][3][3:].any() and results["grouped"][3][:3].abs().sum() > 0


def test_qwen3_moe_with_grouped_kernel_matches_transformers(tmp_path, monkeypatch):
    """The whole model with the grouped kernel forced in every sparse layer, against transformers' own
    Qwen3MoeForCausalLM (its default experts implementation) in fp32: logits, loss with the load-balancing
    loss, and the gradients of the experts, the router and the embedding."""
    from transformers import AutoModelForCausalLM

    import parallel.experts
    from models.common.blocks.moe import ParallelMoE
    from models.qwen3_moe import build_parallel_model
    from tests.cases import qwen3_configs, write_hf_model

    path = write_hf_model(tmp_path, "qwen3moe_norm", qwen3_configs()["qwen3moe_norm"], seed=5)
    ours = build_parallel_model(str(path))
    blocks = [m for m in ours.modules() if isinstance(m, ParallelMoE)]
    assert blocks
    for blk in blocks:
        blk.experts_kernel = "grouped"
    calls = [0]
    real = parallel.experts._grouped_mm

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(parallel.experts, "_grouped_mm", counted)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ref.config.vocab_size, (2, 10), generator=gen)
    out = ours(ids, labels=ids, output_router_logits=True, return_logits=True, gather_logits=True)
    want = ref(input_ids=ids, labels=ids, output_router_logits=True)
    assert _rel(out.logits, want.logits) <= 1e-5
    assert abs(out.loss.item() - want.loss.item()) <= 1e-5 * abs(want.loss.item())
    out.loss.backward()
    want.loss.backward()
    ref_params = dict(ref.named_parameters())
    ours_params = dict(ours.named_parameters())
    checked = 0
    for name, p in ours_params.items():
        if name.endswith("experts.w13_weight"):
            hf = ref_params[name.replace("w13_weight", "gate_up_proj")].grad
        elif name.endswith("experts.w2_weight"):
            hf = ref_params[name.replace("w2_weight", "down_proj")].grad
        elif name.endswith("mlp.gate.weight") or name.endswith("embed_tokens.weight"):
            hf = ref_params[name].grad
        else:
            continue
        assert p.grad is not None and _rel(p.grad[: hf.shape[0]], hf) <= 1e-4, name  # [:V]: padded vocabulary
        checked += 1
    assert checked == 1 + 3 * len(blocks)  # embedding + router and both expert tensors of each sparse layer
    # forward: 2 grouped GEMMs per sparse layer, backward: 4 (so the grouped kernel really ran)
    assert calls == [6 * len(blocks)]
