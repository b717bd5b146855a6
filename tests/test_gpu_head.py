"""CUDA-only checks of the fused, chunked LM head + loss (parallel/lm_head_loss.py) on the device.

- Loss and gradients (hidden states and weight, under a non-uniform per-token ``grad_output``,
  ignored targets, vocabulary padding, a chunk that does not divide the token count) against an
  fp64 reference on the same inputs, in bf16 and fp32, for the default chunk and a small one.
- bf16 backward: the weight gradient accumulated in fp32 inside the GEMM
  (``addmm(..., out_dtype=float32, out=grad_w)``) where this torch has that op (the probe
  ``gemm_accumulates_fp32`` says so exactly when a direct call works), and the fallback (a
  low-precision product per chunk, added in fp32) both within the bounds; the in-GEMM sum is no
  less accurate than the fallback's.
- The default chunk on CUDA: from free memory, large (>= 2048 tokens at vocab 151936 on a device
  with room), and what ``linear_cross_entropy`` uses.

Skipped on machines without CUDA; the CPU side is tests/test_fused_loss.py. The bounds are
estimates (not yet measured on a GPU): bf16 logits are rounded to bf16 before the fp32 softmax, as
the plain head does (~2^-8 relative), so the loss is within ~1e-2 of the exact one and gradients
within ~1e-2 relative; CPU measures the same paths within 2e-2 (tests/test_fused_loss.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import parallel.lm_head_loss as lhl
from parallel.lm_head_loss import (
    CUDA_CHUNK_TOKENS,
    chunk_tokens_for,
    default_chunk_tokens,
    free_device_bytes,
    gemm_accumulates_fp32,
    linear_cross_entropy,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BOUNDS = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2)}  # (loss abs, gradient max-relative)
N, HIDDEN, ROWS, VALID = 1000, 256, 5008, 4900  # 108 rows of vocabulary padding


def _case(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(N, HIDDEN, generator=gen, device="cuda").to(dtype)
    w = (torch.randn(ROWS, HIDDEN, generator=gen, device="cuda") * 0.1).to(dtype)
    t = torch.randint(0, VALID, (N,), generator=gen, device="cuda")
    t[::37] = -100
    g = torch.rand(N, generator=gen, device="cuda") + 0.5  # a per-token grad_output (RL-style weights)
    return h, w, t, g


def _reference(h, w, t, g):
    """fp64 on the same (rounded) inputs: loss [N] and the gradients of sum(g * loss)."""
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    loss = F.cross_entropy(h64 @ w64[:VALID].t(), t, reduction="none", ignore_index=-100)
    (loss * g.double()).sum().backward()
    return loss.detach(), h64.grad, w64.grad


def _fused(h, w, t, g, chunk):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, t, vocab_start=0, valid_columns=VALID, chunk_tokens=chunk)
    (loss * g).sum().backward()
    return loss.detach(), h.grad, w.grad


def _errors(ours, ref):
    loss, gh, gw = ours
    ref_loss, ref_gh, ref_gw = ref
    rel = [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in ((gh, ref_gh), (gw, ref_gw))]
    return (loss.double() - ref_loss).abs().max().item(), max(rel)


def _addmm_dtype_works() -> bool:
    """Whether this torch's CUDA addmm accumulates bf16 operands into an fp32 ``out`` that is also ``self``."""
    acc = torch.ones(4, 4, device="cuda")
    a = torch.ones(4, 8, device="cuda", dtype=torch.bfloat16)
    try:
        torch.addmm(acc, a, a.t(), out_dtype=torch.float32, out=acc)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool((acc == 9).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 96])
def test_fused_head_matches_fp64(dtype, chunk):
    h, w, t, g = _case(dtype)
    ours = _fused(h, w, t, g, chunk)
    loss_err, grad_err = _errors(ours, _reference(h, w, t, g))
    loss_bound, grad_bound = BOUNDS[dtype]
    assert loss_err <= loss_bound and grad_err <= grad_bound, (dtype, chunk, loss_err, grad_err)
    assert ours[1].dtype == ours[2].dtype == dtype
    assert (ours[2][VALID:] == 0).all()  # padding rows take no gradient
    assert (ours[0][t == -100] == 0).all()


def test_probe_says_what_the_op_does():
    dev = torch.device("cuda", torch.cuda.current_device())
    assert gemm_accumulates_fp32(dev, torch.bfloat16) == _addmm_dtype_works()
    assert not gemm_accumulates_fp32(dev, torch.float32)  # fp32 keeps its in-place addmm_
    assert not gemm_accumulates_fp32(torch.device("cpu"), torch.bfloat16)  # CPU: the reference path


def test_in_gemm_accumulation_against_the_fallback(monkeypatch):
    if not _addmm_dtype_works():
        pytest.skip(f"torch {torch.__version__}: CUDA addmm takes no fp32 accumulator for bf16 operands "
                    "(the fused head falls back to product-then-add)")
    h, w, t, g = _case(torch.bfloat16, seed=1)
    ref = _reference(h, w, t, g)
    assert gemm_accumulates_fp32(h.device, torch.bfloat16)  # probed now, so the spy sees only the head's calls
    calls = []
    real_addmm = torch.addmm

    def spy(*args, **kwargs):
        calls.append(kwargs.get("out_dtype"))
        return real_addmm(*args, **kwargs)

    monkeypatch.setattr(torch, "addmm", spy)
    in_gemm = _fused(h, w, t, g, 96)
    assert calls.count(torch.float32) == -(-N // 96)  # one accumulating GEMM per chunk
    monkeypatch.setattr(lhl, "gemm_accumulates_fp32", lambda device, dtype: False)
    calls.clear()
    fallback = _fused(h, w, t, g, 96)
    assert torch.float32 not in calls
    assert torch.equal(in_gemm[0], fallback[0]) and torch.equal(in_gemm[1], fallback[1])  # loss, grad_x: same path
    loss_bound, grad_bound = BOUNDS[torch.bfloat16]
    err_gemm = (in_gemm[2].double() - ref[2]).abs().max().item()
    err_fallback = (fallback[2].double() - ref[2]).abs().max().item()
    assert err_gemm / ref[2].abs().max().item() <= grad_bound
    assert err_fallback / ref[2].abs().max().item() <= grad_bound
    # one rounding fewer per chunk; both share the bf16 logits' and the final cast's roundings, so only
    # "not worse" (with slack for which element happens to be the worst) is asserted
    assert err_gemm <= 1.5 * err_fallback + 1e-6, (err_gemm, err_fallback)


def test_default_chunk_on_cuda_is_large(monkeypatch):
    dev = torch.device("cuda", torch.cuda.current_device())
    vocab = 151936
    free = free_device_bytes(dev)
    free_now, _ = torch.cuda.mem_get_info(dev)
    assert free >= free_now
    tokens = default_chunk_tokens(vocab, torch.bfloat16, dev)
    assert tokens == chunk_tokens_for(free, vocab, torch.bfloat16, "cuda")
    assert tokens > default_chunk_tokens(vocab)  # more than CPU's 441
    if free >= 32 << 30:  # room for 4 x a 4096-token chunk's buffers (~6 GB at this vocabulary)
        assert tokens == CUDA_CHUNK_TOKENS >= 2048
    # linear_cross_entropy takes it (asked for this device and dtype when no chunk is given)
    asked = []
    real_default = lhl.default_chunk_tokens

    def spy(local_vocab, dtype=torch.float32, device=None):
        asked.append((local_vocab, dtype, torch.device(device).type))
        return real_default(local_vocab, dtype, device)

    monkeypatch.setattr(lhl, "default_chunk_tokens", spy)
    h, w, t, _ = _case(torch.bfloat16)
    linear_cross_entropy(h, w, t, vocab_start=0, valid_columns=VALID)
    assert asked == [(VALID, torch.bfloat16, "cuda")]
    if free >= 1 << 30:  # 4900 columns: a 4096-token chunk's buffers take ~0.2 GB
        assert real_default(VALID, torch.bfloat16, dev) == CUDA_CHUNK_TOKENS
