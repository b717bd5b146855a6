"""CUDA-only checks of the flash attention paths, each against the exact reference (fp64 on the host,
tests/varlen_cases.py) on the same bf16/fp16 inputs, forward and backward: torch's own varlen kernels
through the kernel interface (causal, bottom-right causal, full; GQA; unequal lengths), padded batches
unpadded to one varlen call (left and right padding), packed batches, context-parallel blocks with
all blocks of a ring step in one call (every rank's steps run in one process), and the ``flash_attn``
package where installed (it is optional: skipped, not failed, without it); then each further kernel
choice of ``varlen_kernels`` (FlashAttention-3/4 through torch's dispatcher where their packages are
installed; cuDNN through SDPA for equal-length batches: dense padded, packed, fully-masked padded)
against the same reference, and the automatic choice and override on this device. Skipped on
machines without CUDA. The bounds are estimates (below), to be replaced by measured values plus a margin
(docs/numerics.md); the CPU side of the same paths is tests/test_varlen_attention.py."""

from __future__ import annotations

import pytest
import torch

from models.common.blocks.attention import causal_attention
from parallel.context_attention import context_parallel_attention
from parallel.sequence_layout import plan_sequences
from parallel.varlen_kernels import (
    FLASH_ATTN_INSTALLED,
    KERNEL_ENV,
    flash_kernel,
    installed_kernels,
    use_flash_impl,
    varlen_attention,
    varlen_backward,
    varlen_forward,
)
from tests.varlen_cases import cp_steps_in_one_process, masked_reference, max_rel, packed_inputs, sequence_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# max |flash - exact| / max |exact|: (output, gradients); log-sum-exp absolute. Not yet measured on a
# GPU: flash's roundings (P and dS rounded to the input dtype before their matmuls, outputs rounded)
# emulated on the host give bf16 3.8e-3 / 5.5e-3 and fp16 5.1e-4 / 6.1e-4 on these cases; bounds ~5x.
BOUNDS = {torch.bfloat16: (2e-2, 3e-2), torch.float16: (3e-3, 5e-3)}
LSE_BOUND = 1e-3
DTYPES = [torch.bfloat16, torch.float16]
LENGTHS = [37, 1, 64, 5, 130]


def _host_leaves(*xs):
    return [x.detach().double().cpu().requires_grad_() for x in xs]


def test_a_usable_kernel_is_chosen_for_half_precision(monkeypatch):
    """On CUDA the automatic choice is one of this device's usable kernels (cuDNN on Hopper for equal
    lengths, a flash kernel where a log-sum-exp is needed); fp32 keeps the exact paths."""
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    q = torch.zeros(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    usable = installed_kernels(q.device)
    assert "torch" in usable
    assert flash_kernel(q, need_lse=True) in ("torch", "fa3", "fa4")
    assert flash_kernel(q) in usable and flash_kernel(q) != "cudnn"
    if torch.cuda.get_device_capability() == (9, 0) and "cudnn" in usable:
        assert flash_kernel(q, equal_lengths=True) == "cudnn"
    assert flash_kernel(q.float()) is None
    monkeypatch.setenv(KERNEL_ENV, "torch")
    assert flash_kernel(q, equal_lengths=True) == "torch"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["causal", "bottom_right", "full"])
def test_torch_varlen_kernel_matches_exact_reference(dtype, case):
    k_lengths = {"causal": LENGTHS, "bottom_right": [40, 9, 64, 5, 200], "full": [3, 50, 17, 1, 90]}[case]
    causal = case != "full"
    q, k, v, dout, cu_q, cu_k = packed_inputs(LENGTHS, 8, 2, 64, dtype, "cuda", k_lengths=k_lengths)
    ref_in = _host_leaves(q, k, v)
    ref_out, ref_lse = sequence_reference(*ref_in, cu_q.cpu(), cu_k.cpu(), causal)
    ref_out.backward(dout.double().cpu())
    scale = 64 ** -0.5
    out, lse = varlen_forward(q, k, v, cu_q, cu_k, max(LENGTHS), max(k_lengths), causal, scale, "torch")
    grads = varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(LENGTHS), max(k_lengths), causal, scale, "torch")
    out_bound, grad_bound = BOUNDS[dtype]
    assert out.dtype == dtype and lse.shape == (8, sum(LENGTHS))
    assert max_rel(out, ref_out) <= out_bound
    assert (lse.double().cpu() - ref_lse).abs().max().item() <= LSE_BOUND
    for got, ref in zip(grads, ref_in):
        assert got.shape == ref.shape and max_rel(got, ref.grad) <= grad_bound


def _padded(dtype, seed=0):
    s, b = 48, 3
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, b, h, 64, generator=gen).to("cuda", dtype) for h in (8, 2, 2))
    dout = torch.randn(s, b, 8 * 64, generator=gen).to("cuda", dtype)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, 30:] = 0  # right padding
    mask[2, :11] = 0  # left padding
    return q, k, v, dout, mask.cuda()


@pytest.mark.parametrize("kernel", [None, "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_batch_unpadded_to_varlen_matches_exact_reference(dtype, kernel):
    q, k, v, dout, mask = _padded(dtype)
    ref_in = _host_leaves(q, k, v)
    ref = masked_reference(*ref_in, mask)
    ref.backward(dout.double().cpu())
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    out = causal_attention(*mine, attention_mask=mask, kernel=kernel)
    out.backward(dout)
    out_bound, grad_bound = BOUNDS[dtype]
    assert max_rel(out, ref) <= out_bound
    assert out[~mask.t().bool()].abs().max().item() == 0.0
    for got, want in zip(mine, ref_in):
        assert max_rel(got.grad, want.grad) <= grad_bound


@pytest.mark.parametrize("kernel", [None, "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_batch_varlen_matches_exact_reference(dtype, kernel):
    q, k, v, dout, cu, _ = packed_inputs(LENGTHS, 8, 2, 64, dtype, "cuda", seed=1)
    ref_in = _host_leaves(q, k, v)
    ref, _ = sequence_reference(*ref_in, cu.cpu(), cu.cpu(), causal=True)
    ref.backward(dout.double().cpu())
    mine = [x[:, None].clone().requires_grad_() for x in (q, k, v)]
    out = causal_attention(*mine, cu_seqlens=cu.long(), kernel=kernel)
    out.backward(dout.reshape(out.shape))
    out_bound, grad_bound = BOUNDS[dtype]
    assert max_rel(out.reshape(ref.shape), ref) <= out_bound
    for got, want in zip(mine, ref_in):
        assert max_rel(got.grad[:, 0], want.grad) <= grad_bound


@pytest.mark.parametrize("dtype", DTYPES)
def test_context_parallel_single_rank_on_flash_matches_exact_reference(dtype):
    """cp=1 through ``context_parallel_attention`` (no process group): the diagonal step as one
    bottom-right causal varlen call, kernel chosen automatically."""
    lengths = [37, 1, 0, 64, 5]
    plan = plan_sequences(lengths, cp=1, total=sum(lengths) + 6)
    q, k, v, dout, cu, _ = packed_inputs(lengths, 8, 2, 64, torch.float64, seed=2)
    ref_in = _host_leaves(q, k, v)
    ref, _ = sequence_reference(*ref_in, cu, cu, causal=True)
    ref.backward(dout)
    pad = lambda x: torch.cat([x, x.new_zeros(6, *x.shape[1:])]).to("cuda", dtype)  # noqa: E731
    mine = [pad(x).requires_grad_() for x in (q, k, v)]
    out = context_parallel_attention(*mine, plan, None)
    out.backward(pad(dout))
    n = sum(lengths)
    out_bound, grad_bound = BOUNDS[dtype]
    assert max_rel(out[:n], ref) <= out_bound and out[n:].abs().max().item() == 0.0
    for got, want in zip(mine, ref_in):
        assert max_rel(got.grad[:n], want.grad) <= grad_bound


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_steps_on_flash_match_exact_reference(dtype, cp):
    """Every CP rank's steps (diagonal and off-diagonal, one varlen call each) in one process, with
    torch's kernels: output and gradients restored to the global order."""
    res = cp_steps_in_one_process([37, 1, 0, 64, 5, 130], 8, 2, 64, cp, "torch", dtype, "cuda")
    out_bound, grad_bound = BOUNDS[dtype]
    assert res["padding_out"] == 0.0 and res["out"] <= out_bound, res
    assert max(res["dq"], res["dk"], res["dv"]) <= grad_bound, res


@pytest.mark.skipif(not FLASH_ATTN_INSTALLED, reason="the optional flash_attn package is not installed")
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attn_package_paths_match_exact_reference(dtype):
    q, k, v, dout, mask = _padded(dtype, seed=3)
    ref_in = _host_leaves(q, k, v)
    ref = masked_reference(*ref_in, mask)
    ref.backward(dout.double().cpu())
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    out = causal_attention(*mine, attention_mask=mask, kernel="flash_attn")
    out.backward(dout)
    out_bound, grad_bound = BOUNDS[dtype]
    assert max_rel(out, ref) <= out_bound
    for got, want in zip(mine, ref_in):
        assert max_rel(got.grad, want.grad) <= grad_bound
    qp, kp, vp, _, cu, _ = packed_inputs(LENGTHS, 8, 2, 64, dtype, "cuda", seed=4)
    packed = causal_attention(qp[:, None], kp[:, None], vp[:, None], cu_seqlens=cu, kernel="flash_attn")
    assert max_rel(packed.reshape(qp.shape), sequence_reference(qp.double().cpu(), kp.double().cpu(),
                                                                  vp.double().cpu(), cu.cpu(), cu.cpu(), True)[0]) \
        <= out_bound


# ---------------------------------------------------------------------- further kernel choices
LSE_KERNELS = ["torch", "fa3", "fa4"]


@pytest.fixture
def lse_kernel(request):
    """A flash kernel with log-sum-exp, skipped where its package is not installed; torch's own
    flash implementation is restored afterwards (FA3/FA4 activation is process-wide)."""
    kernel = request.param
    if kernel not in installed_kernels(torch.device("cuda")):
        pytest.skip(f"{kernel} is not usable here (package not installed or another GPU generation)")
    yield kernel
    use_flash_impl("torch")


@pytest.mark.parametrize("lse_kernel", LSE_KERNELS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["causal", "bottom_right"])
def test_each_lse_kernel_matches_exact_reference(lse_kernel, dtype, case):
    """FA3/FA4 (and torch's FA2) through the kernel interface: packed log-sum-exp, backward from it."""
    k_lengths = LENGTHS if case == "causal" else [40, 9, 64, 5, 200]
    q, k, v, dout, cu_q, cu_k = packed_inputs(LENGTHS, 8, 2, 64, dtype, "cuda", k_lengths=k_lengths)
    ref_in = _host_leaves(q, k, v)
    ref_out, ref_lse = sequence_reference(*ref_in, cu_q.cpu(), cu_k.cpu(), True)
    ref_out.backward(dout.double().cpu())
    scale = 64 ** -0.5
    out, lse = varlen_forward(q, k, v, cu_q, cu_k, max(LENGTHS), max(k_lengths), True, scale, lse_kernel)
    grads = varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(LENGTHS), max(k_lengths), True, scale,
                            lse_kernel)
    out_bound, grad_bound = BOUNDS[dtype]
    assert out.dtype == dtype and lse.shape == (8, sum(LENGTHS))
    assert max_rel(out, ref_out) <= out_bound
    assert (lse.double().cpu() - ref_lse).abs().max().item() <= LSE_BOUND
    for got, ref in zip(grads, ref_in):
        assert got.shape == ref.shape and max_rel(got, ref.grad) <= grad_bound


@pytest.mark.parametrize("lse_kernel", LSE_KERNELS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_steps_on_each_lse_kernel_match_exact_reference(lse_kernel, dtype):
    res = cp_steps_in_one_process([37, 1, 0, 64, 5, 130], 8, 2, 64, 2, lse_kernel, dtype, "cuda")
    out_bound, grad_bound = BOUNDS[dtype]
    assert res["padding_out"] == 0.0 and res["out"] <= out_bound, res
    assert max(res["dq"], res["dk"], res["dv"]) <= grad_bound, res


def _needs_cudnn():
    if "cudnn" not in installed_kernels(torch.device("cuda")):
        pytest.skip("cuDNN attention is not usable here")


def _kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


@pytest.mark.parametrize("form", ["padded", "padded_full_mask", "packed_equal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cudnn_equal_length_batches_match_exact_reference(dtype, form):
    """cuDNN through SDPA (forced by ``kernel="cudnn"``) for the three equal-length forms, forward and
    backward; no flash kernel runs (kernel names read from the profiler)."""
    _needs_cudnn()
    s, b = 64, 3
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(s, b, h, 64, generator=gen).to("cuda", dtype) for h in (8, 2, 2))
    dout = torch.randn(s, b, 8 * 64, generator=gen).to("cuda", dtype)
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    if form == "packed_equal":  # the b rows as b packed sequences of s tokens
        flat = [x.transpose(0, 1).reshape(s * b, 1, *x.shape[2:]) for x in (q, k, v)]
        ref_in = _host_leaves(*[x[:, 0] for x in flat])
        cu = torch.arange(b + 1, device="cuda") * s
        ref, _ = sequence_reference(*ref_in, cu.cpu(), cu.cpu(), causal=True)
        mine = [x.clone().requires_grad_() for x in flat]
        dflat = dout.view(s, b, 8, 64).transpose(0, 1).reshape(s * b, 8, 64)
        run = lambda: causal_attention(*mine, cu_seqlens=cu, kernel="cudnn")  # noqa: E731
        dout, ref = dflat.reshape(s * b, 1, -1), ref.reshape(s * b, 1, -1)
    else:
        mask = None if form == "padded" else torch.ones(b, s, dtype=torch.long, device="cuda")
        ref_in = _host_leaves(q, k, v)
        ref = masked_reference(*ref_in, None if mask is None else mask.cpu())
        run = lambda: causal_attention(*mine, attention_mask=mask, kernel="cudnn")  # noqa: E731
    out = run()
    out.backward(dout)
    ref.backward(dout.double().cpu())
    out_bound, grad_bound = BOUNDS[dtype]
    assert max_rel(out, ref) <= out_bound
    for got, want in zip(mine, ref_in):
        assert max_rel(got.grad.reshape(want.shape), want.grad) <= grad_bound
    names = _kernel_names(lambda: run().backward(dout))
    # Neither torch's FA2 (pytorch_flash::flash_fwd_kernel / flash_bwd_*) nor the memory-efficient
    # kernels (fmha_cutlassF/B) ran - SDPA's fallbacks when cuDNN refuses the shapes. Not "flash" alone:
    # cuDNN's own SDPA kernels are named ..._sdpa_sm90_flash_fprop/bprop_...
    others = [n for n in names if any(t in n for t in ("pytorch_flash", "flash_fwd", "flash_bwd", "fmha_cutlass"))]
    assert names and not others, sorted(set(names))[:20]


@pytest.mark.parametrize("dtype", DTYPES)
def test_automatic_choice_on_this_device_matches_exact_reference(dtype, monkeypatch):
    """No kernel given, no override: whatever this device chooses for an equal-length packed batch
    and for an unequal one, through ``varlen_attention``, matches the reference."""
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    for lengths in ([64, 64, 64], LENGTHS):
        q, k, v, dout, cu, _ = packed_inputs(lengths, 8, 2, 64, dtype, "cuda", seed=6)
        cu = cu.int()
        ref_in = _host_leaves(q, k, v)
        ref, _ = sequence_reference(*ref_in, cu.cpu(), cu.cpu(), causal=True)
        ref.backward(dout.double().cpu())
        kernel = flash_kernel(q, equal_lengths=len(set(lengths)) == 1)
        mine = [x.clone().requires_grad_() for x in (q, k, v)]
        out = varlen_attention(*mine, cu, cu, max(lengths), max(lengths), True, 64 ** -0.5, kernel)
        out.backward(dout)
        out_bound, grad_bound = BOUNDS[dtype]
        assert max_rel(out, ref) <= out_bound, kernel
        for got, want in zip(mine, ref_in):
            assert max_rel(got.grad, want.grad) <= grad_bound, kernel
    use_flash_impl("torch")
