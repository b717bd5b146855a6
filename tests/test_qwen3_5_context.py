"""Qwen3.5 Gated DeltaNet hybrids under context parallelism and Ulysses (tests/workers_qwen3_5_context.py),
and the CP composition of the kernel (parallel/context_gdn.py) simulated for every rank in one process.

Model: cp2 (ring and all-gather attention), ulysses2, cp2 x ulysses2 (both), tp2 x cp2 (without SP,
ring; with SP, all-gather) and cp4, on one 4-rank gloo group, against transformers run on each sequence
alone (fp32; fp64 as the truth): packed odd lengths with chunks shorter than the conv kernel on every
rank, and a right/left-padded batch — logits, loss, gradients of every HF tensor — then an SGD step on
the packed gradients and the packed loss and gradients again (lr 0.02, see tests/test_qwen3_5_layouts.py).
Kernel: the conv halo and the chunk-state composition of every CP rank of several plans (cp 1-4, empty
and one-token sequences, tail padding) equal the packed kernel run on whole sequences, fp64 to 1e-12,
and the gradients too.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from parallel.context_gdn import apply_states, chunk_maps, chunk_table, conv_with_tails, incoming_states, local_tails
from parallel.gated_delta_rule import causal_conv1d, gated_delta_rule, positions_in_sequence
from parallel.sequence_layout import plan_sequences
from tests.distributed import run_distributed
from tests.workers_qwen3_5 import configs, write_model
from tests.workers_qwen3_5_context import LAYOUTS, suite

BOUNDS = {
    "padded_logits": 5e-5, "packed_logits": 5e-5,
    "padded_logits_ratio": 4.0, "packed_logits_ratio": 4.0,  # x transformers' own fp32 error
    "padded_loss": 1e-5, "packed_loss": 1e-5,
    "padded_grads": 1e-4, "packed_grads": 1e-4,  # relative to each tensor's largest gradient
    "step1_loss": 1e-5, "step1_grads": 1e-4,
}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5_context")
    path = write_model(root, "mixed", configs()["mixed"], seed=0)
    return [r for rank in run_distributed(4, suite, "mixed", path) for r in rank]


def test_qwen3_5_under_cp_and_ulysses_matches_transformers(records):
    layouts = {r[1] for r in records}
    assert len(layouts) == len(LAYOUTS), sorted(layouts)
    bad = [f"{name} {layout} {metric}={value:.3g} (max {BOUNDS[metric]})"
           for name, layout, metric, value in records if metric in BOUNDS and not value <= BOUNDS[metric]]
    assert not bad, "\n".join(bad)
    assert all(v > 1.0 for _, _, m, v in records if m == "packed_loss_value")  # a real loss was compared
    assert sum(m == "padded_grads" for _, _, m, _ in records) == 4 * sum(p for _, p in LAYOUTS)
    assert sum(m == "step1_grads" for _, _, m, _ in records) == 4 * len(LAYOUTS)


def _take(t, index):
    return t[index.clamp(min=0)] * (index >= 0).to(t.dtype).reshape(-1, *[1] * (t.dim() - 1))


@pytest.mark.parametrize("lengths,cp", [((5, 1, 20, 3, 70), 2), ((5, 1, 20, 3, 70, 0, 2), 3), ((130, 9), 4),
                                        ((7, 2), 1)])
def test_cp_composition_equals_whole_sequences(lengths, cp):
    gen = torch.Generator().manual_seed(cp)
    dt = torch.float64
    total, hk, hv, dk, dv, channels, kernel = sum(lengths), 2, 4, 8, 6, 10, 4

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dt).requires_grad_()

    q, k, v, x, w = rnd(total, hk, dk), rnd(total, hk, dk), rnd(total, hv, dv), rnd(total, channels), rnd(channels,
                                                                                                          kernel)
    g = (-torch.rand(total, hv, generator=gen, dtype=dt) * 0.3).requires_grad_()
    beta = torch.rand(total, hv, generator=gen, dtype=dt).requires_grad_()
    leaves = (q, k, v, g, beta, x, w)
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    ref = gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], cu_seqlens=cu, use_qk_l2norm=True)[0]
    ref_conv = causal_conv1d(x[None], w, positions_in_sequence(cu, total))[0]
    weights = torch.randn(total, hv, dv, generator=gen, dtype=dt), torch.randn(total, channels, generator=gen, dtype=dt)
    ref_grads = torch.autograd.grad((ref * weights[0]).sum() + (ref_conv * weights[1]).sum(), leaves)

    plan = plan_sequences(lengths, cp=cp, total=total + 3)  # 3 tail padding tokens
    index = [plan.cp_index(r) for r in range(cp)]
    tables = [chunk_table(plan, r, kernel) for r in range(cp)]
    tails = torch.cat([local_tails(_take(x, index[r]), tables[r]) for r in range(cp)])
    runs = [chunk_maps(*(_take(t, index[r])[None] for t in (q, k, v, g, beta)), tables[r]) for r in range(cp)]
    maps = torch.cat([m for m, _ in runs])
    loss, outs, convs = 0.0, torch.zeros_like(ref), torch.zeros_like(ref_conv)
    for r in range(cp):
        keep = index[r] >= 0
        conv = conv_with_tails(_take(x, index[r]), w, tables[r], tails)[keep]
        out = apply_states(runs[r][1], incoming_states(maps, plan, r), tables[r])[0][keep]
        outs[index[r][keep]], convs[index[r][keep]] = out.detach(), conv.detach()
        loss = loss + (out * weights[0][index[r][keep]]).sum() + (conv * weights[1][index[r][keep]]).sum()
    assert (outs - ref).abs().max() < 1e-12
    assert (convs - ref_conv).abs().max() < 1e-12
    for ours, theirs in zip(torch.autograd.grad(loss, leaves), ref_grads):
        assert (ours - theirs).abs().max() < 1e-10 * max(1.0, theirs.abs().max().item())
