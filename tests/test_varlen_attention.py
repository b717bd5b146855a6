"""The varlen attention path on CPU, where no flash kernel runs: the exact reference kernel stands in
for it, so everything around the kernel call is checked here - the kernel interface's semantics (GQA,
bottom-right causal, unequal and empty sequences, backward from a merged log-sum-exp), the unpadding
of padded batches, the log-sum-exp layouts, and context parallelism with all blocks of a ring step in
one call (in one process and over gloo, ring and all-gather), and the kernel dispatch (the choice per
device capability and call, injected; the override; the dense layout cuDNN gets, run with SDPA's math
backend). References are independent: SDPA per sequence in fp64 (tests/varlen_cases.py). The GPU
kernels themselves are checked in tests/test_gpu.py."""

from __future__ import annotations

import functools

import pytest
import torch

from models.common.blocks.attention import causal_attention, padded_layout
from parallel.context_varlen import step_calls
from parallel.sequence_layout import plan_sequences
from parallel.varlen_kernels import (
    KERNEL_ENV,
    choose_kernel,
    dense_sdpa,
    equal_lengths,
    flash_kernel,
    lse_packed_from_padded,
    lse_padded_from_packed,
    varlen_attention,
    varlen_backward,
    varlen_forward,
)
from tests.distributed import run_distributed
from tests.varlen_cases import (
    cp_kernels_rank,
    cp_steps_in_one_process,
    masked_reference,
    max_rel,
    packed_inputs,
    sequence_reference,
)

TOL = {torch.float64: 1e-12, torch.float32: 2e-6}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("case", ["causal", "bottom_right", "full"])
def test_reference_kernel_matches_sdpa_per_sequence(dtype, hq, hkv, case):
    """Forward (output, log-sum-exp) and backward of the reference kernel against SDPA per sequence:
    equal lengths with empty and 1-token sequences (causal), keys longer than queries (causal
    bottom-right, flash's alignment), and unrelated lengths (full)."""
    lengths = [5, 0, 1, 12, 3]
    k_lengths = {"causal": lengths, "bottom_right": [7, 0, 4, 12, 9], "full": [2, 3, 6, 1, 8]}[case]
    q, k, v, dout, cu_q, cu_k = packed_inputs(lengths, hq, hkv, 8, dtype, k_lengths=k_lengths)
    causal = case != "full"
    ref_in = [x.double().clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = sequence_reference(*ref_in, cu_q, cu_k, causal)
    ref_out.backward(dout.double())
    out, lse = varlen_forward(q, k, v, cu_q, cu_k, 12, 12, causal, 8 ** -0.5, "reference")
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    varlen_attention(*mine, cu_q, cu_k, 12, 12, causal, 8 ** -0.5, "reference").backward(dout)
    assert out.dtype == dtype and lse.shape == (hq, sum(lengths))
    assert max_rel(out, ref_out) <= TOL[dtype]
    assert max_rel(lse, ref_lse) <= TOL[dtype]
    for got, ref in zip(mine, ref_in):
        assert got.grad.shape == ref.shape and max_rel(got.grad, ref.grad) <= TOL[dtype]


def test_backward_from_merged_lse_gives_each_key_part_its_share():
    """Keys split in two varlen calls, outputs merged by the online-softmax rule; the backward of each
    part from the *merged* output and log-sum-exp sums to the whole attention's gradients (what the
    ring relies on)."""
    lengths = [6, 9, 3]
    q, k, v, dout, cu, _ = packed_inputs(lengths, 4, 2, 8, torch.float64, seed=1)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, _ = sequence_reference(*ref_in, cu, cu, causal=False)
    ref.backward(dout)
    first = [2, 4, 1]  # keys of each sequence in part A; the rest in part B
    idx_a = torch.cat([torch.arange(a, a + n) for a, n in zip(cu[:-1].tolist(), first)])
    idx_b = torch.cat([torch.arange(a + n, b) for a, b, n in zip(cu[:-1].tolist(), cu[1:].tolist(), first)])
    cu_a = torch.tensor([0, *first]).cumsum(0).int()
    cu_b = torch.tensor([0, *(n - f for n, f in zip(lengths, first))]).cumsum(0).int()
    parts = [(idx_a, cu_a), (idx_b, cu_b)]
    results = [varlen_forward(q, k[i], v[i], cu, c, 9, 9, False, 8 ** -0.5, "reference") for i, c in parts]
    lse = torch.logaddexp(results[0][1], results[1][1])
    out = sum(o * torch.exp(part_lse - lse).t()[..., None] for o, part_lse in results)
    assert max_rel(out, ref) <= 1e-12
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i, c in parts:
        gq, gk, gv = varlen_backward(dout, q, k[i], v[i], out, lse, cu, c, 9, 9, False, 8 ** -0.5, "reference")
        dq += gq
        dk[i] += gk
        dv[i] += gv
    for got, want in zip((dq, dk, dv), ref_in):
        assert max_rel(got, want.grad) <= 1e-12


def test_lse_layout_conversions_round_trip():
    """Older torch flash builds return the varlen log-sum-exp as ``[b, h, max_q]``; the conversions to
    and from the packed ``[h, T]`` layout put every token where a loop over sequences puts it."""
    lengths = [3, 0, 5, 1]
    cu = torch.tensor([0, *lengths]).cumsum(0).int()
    packed = torch.randn(2, sum(lengths), dtype=torch.float64)
    padded = lse_padded_from_packed(packed, cu, 6)
    assert padded.shape == (4, 2, 6)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        assert torch.equal(padded[i, :, :b - a], packed[:, a:b])
        assert not padded[i, :, b - a:].any()
    assert torch.equal(lse_packed_from_padded(padded, cu, sum(lengths)), packed)


@pytest.mark.parametrize("padding", ["none", "right", "left", "holes_and_empty_row"])
def test_unpadded_varlen_matches_masked_reference(padding):
    """A padded batch through the varlen path (unpad, one call, scatter back), forward and backward,
    against attention over each row's real tokens; padding rows are 0 and get no gradient."""
    s, b = 7, 3
    mask = torch.ones(b, s, dtype=torch.long)
    if padding == "right":
        mask[1, 4:] = 0
        mask[2, 6:] = 0
    elif padding == "left":
        mask[0, :2] = 0
        mask[2, :5] = 0
    elif padding == "holes_and_empty_row":
        mask[0, [1, 4]] = 0
        mask[2] = 0
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(s, b, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    dout = torch.randn(s, b, 32, generator=gen, dtype=torch.float64)
    given = None if padding == "none" else mask
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = masked_reference(*ref_in, given)
    ref.backward(dout)
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    out = causal_attention(*mine, attention_mask=given, kernel="reference")
    out.backward(dout)
    assert max_rel(out, ref) <= 1e-12
    for got, want in zip(mine, ref_in):
        assert max_rel(got.grad, want.grad) <= 1e-12
    pad = ~mask.t().bool()
    assert out[pad].abs().max().item() == 0.0 if bool(pad.any()) else True
    layout = padded_layout(given, s, b, "cpu")
    assert layout.tokens == int(mask.sum()) and layout.max_len == int(mask.sum(1).max())


def test_packed_varlen_matches_per_sequence_reference():
    """Packed tokens (``cu_seqlens`` with an empty sequence) through the varlen path, GQA, forward and
    backward, against SDPA per sequence; bad ``cu_seqlens`` is refused with the numbers."""
    lengths = [4, 0, 11, 1, 6]
    q, k, v, dout, cu, _ = packed_inputs(lengths, 4, 2, 8, torch.float64, seed=2)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, _ = sequence_reference(*ref_in, cu, cu, causal=True)
    ref.backward(dout)
    mine = [x[:, None].clone().requires_grad_() for x in (q, k, v)]
    out = causal_attention(*mine, cu_seqlens=cu.long(), kernel="reference")
    out.backward(dout.reshape(out.shape))
    assert max_rel(out.reshape(ref.shape), ref) <= 1e-12
    for got, want in zip(mine, ref_in):
        assert max_rel(got.grad[:, 0], want.grad) <= 1e-12
    with pytest.raises(ValueError, match="token count 22"):
        causal_attention(*(x.detach() for x in mine), cu_seqlens=torch.tensor([0, 5, 21]), kernel="reference")


@pytest.mark.parametrize("lengths,cp", [([37], 2), ([13, 1, 0, 22, 5], 2), ([3, 2], 4), ([9, 30, 1, 17], 4)])
def test_every_ring_step_is_one_call_seeing_exactly_its_segments(lengths, cp):
    """Each (query rank, key rank) step of a plan is at most one varlen call, and the (query, key)
    pairs it makes visible - cu_seqlens, gathered rows and bottom-right causal - are exactly those of
    the plan's segments (top-left causal for a chunk against itself)."""
    plan = plan_sequences(lengths, cp=cp, multiple=3)
    n = plan.local_len
    for r in range(cp):
        for src in range(cp):
            want = torch.zeros(n, n, dtype=torch.int64)
            for s in plan.segments(r, src):
                blk = torch.ones(s.q_len, s.k_len, dtype=torch.int64)
                want[s.q_start:s.q_start + s.q_len, s.k_start:s.k_start + s.k_len] += blk.tril() if s.causal else blk
            calls = step_calls(plan, r, src, "cpu")
            assert len(calls) <= 1
            got = torch.zeros(n, n, dtype=torch.int64)
            for c in calls:
                rows = lambda x: torch.arange(n)[x] if isinstance(x, slice) else x  # noqa: E731
                q_rows, k_rows = rows(c.q_rows), rows(c.k_rows)
                for (qa, qb), (ka, kb) in zip(zip(c.cu_q[:-1].tolist(), c.cu_q[1:].tolist()),
                                              zip(c.cu_k[:-1].tolist(), c.cu_k[1:].tolist())):
                    i = torch.arange(qb - qa)[:, None]
                    j = torch.arange(kb - ka)[None, :]
                    vis = (j <= i + (kb - ka) - (qb - qa)) if c.causal else torch.ones_like(i * j, dtype=torch.bool)
                    got[q_rows[qa:qb, None], k_rows[None, ka:kb]] += vis.long()
            assert torch.equal(got, want), (r, src)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_steps_with_reference_kernel_in_one_process(cp):
    """All ranks' ring steps, one varlen call each, run in one process: output and gradients equal
    SDPA on the whole batch (fp64), padding rows 0."""
    res = cp_steps_in_one_process([13, 1, 0, 22, 5, 2], 4, 2, 16, cp, "reference", torch.float64)
    assert res["padding_out"] == 0.0
    bad = {k: v for k, v in res.items() if k != "padding_out" and not v <= 1e-12}
    assert not bad, bad


@functools.lru_cache(maxsize=None)
def _cp2_records():
    cases = [([37], 4, 2, "ring"), ([13, 1, 0, 22, 5], 4, 2, "ring"), ([13, 1, 0, 22, 5], 2, 2, "allgather"),
             ([29, 6], 4, 1, "allgather")]
    return [rec for rank in run_distributed(2, cp_kernels_rank, cases) for rec in rank]


def test_cp2_over_gloo_one_call_per_step_matches_block_path_and_sdpa():
    """cp=2 over gloo, ring and all-gather, packed unequal lengths (empty and 1-token sequences), GQA:
    the one-call-per-step path (reference kernel) against the block-by-block path the CPU runs and
    against SDPA on the whole batch, output and q/k/v gradients (fp64)."""
    records = _cp2_records()
    assert len(records) == 2 * 4 * 4 and {r[3] for r in records} == {"ring", "allgather"}
    bad = [r for r in records if not (r[-2] <= 1e-12 and r[-1] <= 1e-12)]
    assert not bad, bad


def test_unknown_kernel_is_refused_with_its_name():
    q = torch.zeros(4, 1, 2, 8)
    with pytest.raises(ValueError, match="'flash'"):
        causal_attention(q, q, q, kernel="flash")
    from parallel.context_attention import context_parallel_attention

    plan = plan_sequences([4], cp=1)
    with pytest.raises(ValueError, match="'flash_attn'.*segments, torch, reference"):
        context_parallel_attention(q[:, 0], q[:, 0], q[:, 0], plan, None, kernel="flash_attn")


# ---------------------------------------------------------------------- the kernel dispatch (CPU)
HOPPER, BLACKWELL, AMPERE = (9, 0), (10, 0), (8, 0)


@pytest.mark.parametrize("cap,installed,need_lse,equal,want", [
    (HOPPER, {"torch", "cudnn"}, False, True, "cudnn"),  # the measured case: cuDNN over torch's FA2
    (HOPPER, {"torch", "cudnn"}, False, False, "torch"),  # unequal lengths: no ragged cuDNN
    (HOPPER, {"torch", "cudnn"}, True, True, "torch"),  # a log-sum-exp (CP): flash only
    (HOPPER, {"torch", "cudnn", "fa3", "fa4"}, False, False, "fa3"),
    (HOPPER, {"torch", "cudnn", "fa3", "fa4"}, True, True, "fa3"),
    (HOPPER, {"torch", "cudnn", "fa4"}, True, False, "fa4"),
    (HOPPER, {"torch", "flash_attn"}, False, False, "flash_attn"),
    (HOPPER, {"torch", "flash_attn"}, True, False, "torch"),
    (BLACKWELL, {"torch", "cudnn", "fa4"}, False, True, "fa4"),
    (BLACKWELL, {"torch", "cudnn"}, False, True, "cudnn"),
    (AMPERE, {"torch", "cudnn"}, False, True, "torch"),  # Ampere: torch's FA2, cuDNN not preferred
    (AMPERE, {"torch", "cudnn", "flash_attn"}, False, False, "flash_attn"),
    ((12, 0), {"torch", "cudnn"}, True, False, "torch"),
    (AMPERE, set(), False, False, None),
])
def test_kernel_choice_per_device_and_call(cap, installed, need_lse, equal, want):
    assert choose_kernel(cap, frozenset(installed), need_lse=need_lse, equal_lengths=equal) == want


def test_kernel_override_forces_applies_or_is_refused():
    usable = frozenset({"torch", "cudnn", "fa3"})
    assert choose_kernel(HOPPER, usable, equal_lengths=True, override="torch") == "torch"
    assert choose_kernel(HOPPER, usable, need_lse=True, override="fa3") == "fa3"
    # cudnn cannot take unequal lengths or a call that needs a log-sum-exp: the automatic choice runs
    assert choose_kernel(HOPPER, usable, equal_lengths=False, override="cudnn") == "fa3"
    assert choose_kernel(HOPPER, usable, need_lse=True, equal_lengths=True, override="cudnn") == "fa3"
    assert choose_kernel(HOPPER, usable, override="reference") == "reference"
    with pytest.raises(RuntimeError, match="'fa4'.*usable: cudnn, fa3, torch"):
        choose_kernel(HOPPER, usable, override="fa4")
    with pytest.raises(ValueError, match="'fa5'"):
        choose_kernel(HOPPER, usable, override="fa5")


def test_cpu_and_full_precision_never_consult_the_override(monkeypatch):
    """The exact paths stay exact: on CPU (any dtype) and for fp32 no kernel is chosen, whatever
    PMZ_ATTENTION_KERNEL says."""
    monkeypatch.setenv(KERNEL_ENV, "cudnn")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert flash_kernel(torch.zeros(4, 2, 64, dtype=dtype), need_lse=True, equal_lengths=True) is None


def test_equal_lengths_from_host_values():
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    assert equal_lengths(cu, cu, 12, 12, 4, 4)
    assert not equal_lengths(torch.tensor([0, 3, 8, 12]), cu, 12, 12, 5, 4)
    assert not equal_lengths(cu, cu, 12, 12, 4, 5)
    assert not equal_lengths(cu[:1], cu[:1], 0, 0, 0, 0)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_dense_sdpa_of_equal_length_sequences_matches_reference(hq, hkv):
    """The cuDNN kernel's layout (flat equal-length tokens as a dense ``[n, h, L, d]`` SDPA batch,
    GQA by ``enable_gqa``), here with SDPA's math backend on CPU: forward and backward against the
    per-sequence reference. Only the backend differs on a GPU (tests/test_gpu.py)."""
    from torch.nn.attention import SDPBackend

    lengths = [6, 6, 6]
    q, k, v, dout, cu, _ = packed_inputs(lengths, hq, hkv, 8, torch.float64, seed=7)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, _ = sequence_reference(*ref_in, cu, cu, causal=True)
    ref.backward(dout)
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    out = dense_sdpa(*mine, 3, True, 8 ** -0.5, [SDPBackend.MATH])
    out.backward(dout)
    assert max_rel(out, ref) <= 1e-12
    for got, want in zip(mine, ref_in):
        assert max_rel(got.grad, want.grad) <= 1e-12
    with pytest.raises(ValueError, match="'cudnn' takes equal-length"):
        varlen_attention(q, k, v, torch.tensor([0, 5, 18]), torch.tensor([0, 5, 18]), 13, 13, True, 1.0, "cudnn")


@pytest.mark.parametrize("form", ["padded", "padded_masked_full", "packed_equal", "packed_unequal", "padded_holes"])
def test_causal_attention_routes_each_batch_form_to_the_chosen_kernel(monkeypatch, form):
    """The automatic choice inside ``causal_attention`` on CPU: a stand-in dispatch answers 'cudnn'
    for equal lengths and 'reference' otherwise, cuDNN is replaced by SDPA's math backend; each batch
    form reaches the kernel its lengths call for and matches the reference, forward and backward."""
    from torch.nn.attention import SDPBackend

    import models.common.blocks.attention as attention

    calls = []

    def fake_choice(q, *, need_lse=False, equal_lengths=False, override=None):
        calls.append("cudnn" if equal_lengths else "reference")
        return calls[-1]

    monkeypatch.setattr(attention, "flash_kernel", fake_choice)
    monkeypatch.setattr(attention, "cudnn_backends", lambda: [SDPBackend.MATH])
    import parallel.varlen_kernels as vk

    monkeypatch.setattr(vk, "cudnn_backends", lambda: [SDPBackend.MATH])
    gen = torch.Generator().manual_seed(9)
    s, b = 6, 3
    if form.startswith("padded"):
        q, k, v = (torch.randn(s, b, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
        mask = None if form == "padded" else torch.ones(b, s, dtype=torch.long)
        if form == "padded_holes":
            mask[1, 2] = 0
        ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = masked_reference(*ref_in, mask)
        mine = [x.clone().requires_grad_() for x in (q, k, v)]
        out = causal_attention(*mine, attention_mask=mask)
    else:
        lengths = [4, 4, 4] if form == "packed_equal" else [5, 4, 3]
        q, k, v, _, cu, _ = packed_inputs(lengths, 4, 2, 8, torch.float64, seed=9)
        ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = sequence_reference(*ref_in, cu, cu, causal=True)[0].reshape(sum(lengths), 1, -1)
        mine = [x[:, None].clone().requires_grad_() for x in (q, k, v)]
        out = causal_attention(*mine, cu_seqlens=cu.long())
    want = "reference" if form in ("packed_unequal", "padded_holes") else "cudnn"
    assert calls[-1] == want, calls
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(dout)
    ref.backward(dout.reshape(ref.shape))
    assert max_rel(out.reshape(ref.shape), ref) <= 1e-12
    for got, ref_leaf in zip(mine, ref_in):
        assert max_rel(got.grad.reshape(ref_leaf.shape), ref_leaf.grad) <= 1e-12
