"""Variable-length (varlen) attention kernels behind one interface: flat tokens, sequences marked by
cumulative lengths, forward with log-sum-exp and backward from a given output and log-sum-exp.

    varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, kernel)            -> out, lse
    varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, kernel) -> dq, dk, dv
    varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, kernel)          -> out (autograd)

``q [Tq, hq, d]``, ``k/v [Tk, hkv, d]`` (GQA: query head ``h`` uses KV head ``h // (hq / hkv)``);
sequence ``i`` is queries ``cu_q[i]:cu_q[i+1]`` against keys ``cu_k[i]:cu_k[i+1]``; ``cu_*`` int32 on
the tensors' device. ``out`` has q's dtype, ``lse [hq, Tq]`` is fp32 (fp64 for fp64 inputs in the
reference) and is the natural log of ``sum exp(scale * q.k)``. ``causal`` is flash's **bottom-right**
aligned mask: query ``i`` of a sequence sees key ``j`` iff ``j <= i + (k_len - q_len)`` (the usual
mask when ``q_len == k_len``). Every query row must see at least one key (callers never build rows
that see none: flash leaves their lse undefined for us).

Kernels (``kernel=``):
  * ``"torch"``: torch's own flash kernels, ``aten._flash_attention_forward/_backward`` (CUDA, fp16 /
    bf16, head size a multiple of 8 up to 256, sm80 or newer). Dropout is 0, so backward never reads
    the philox seed/offset it is given (torch's ``varlen_attn`` passes the same placeholders). Older
    torch builds return the log-sum-exp padded ``[b, hq, max_q]`` instead of packed ``[hq, Tq]``:
    ``varlen_forward`` always returns it packed and ``varlen_backward`` hands the kernel the layout
    its forward produces (probed once per device).
  * ``"flash_attn"``: the ``flash_attn`` package's ``flash_attn_varlen_func``, only in
    ``varlen_attention`` and only where installed (an optional extra, never required). Its backward
    from a *given* output and log-sum-exp is private API that changes between releases, so the
    context-parallel blocks use ``"torch"``.
  * ``"reference"``: exact per-sequence matmul/softmax in fp32 (fp64 for fp64), the same semantics
    on any device; what CPU tests run in place of a flash kernel, and the check of the flash ones.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

FLASH_ATTN_INSTALLED = importlib.util.find_spec("flash_attn") is not None
KERNELS = ("torch", "flash_attn", "reference")


# ---------------------------------------------------------------------- which kernel applies
@functools.lru_cache(maxsize=None)
def _torch_flash_on(device: torch.device) -> bool:
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(device) >= (8, 0)


def flash_kernel(q: torch.Tensor, *, need_lse: bool = False) -> str | None:
    """The flash kernel for tensors like ``q`` (``"flash_attn"`` where installed, else ``"torch"``), or
    None where none takes them: CPU, fp32/fp64, a head size flash does not take, a GPU before sm80.
    ``need_lse``: the caller needs ``varlen_forward``/``varlen_backward`` (context parallel): ``"torch"``."""
    d = q.shape[-1]
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256):
        return None
    if FLASH_ATTN_INSTALLED and not need_lse:
        return "flash_attn"
    return "torch" if _torch_flash_on(q.device) else None


def _check_kernel(kernel: str, allowed: tuple[str, ...]) -> None:
    if kernel not in allowed:
        raise ValueError(f"attention kernel {kernel!r}: this call takes one of {', '.join(allowed)}")


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype of outputs, log-sum-exps and gradients: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------- the interface
def varlen_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                   kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every sequence and its log-sum-exp: ``out [Tq, hq, d]`` (q's dtype), ``lse [hq, Tq]``."""
    _check_kernel(kernel, ("torch", "reference"))
    if kernel == "reference":
        return _reference_forward(q, k, v, cu_q, cu_k, causal, scale)
    return _torch_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                    kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients given the output ``out`` and log-sum-exp ``lse [hq, Tq]`` of each query row, which
    may be *final* values merged over more keys than these (context parallel): then the result is
    these keys' share of the gradients. ``dq [Tq, hq, d]``, ``dk/dv [Tk, hkv, d]`` in q's dtype."""
    _check_kernel(kernel, ("torch", "reference"))
    if kernel == "reference":
        return _reference_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)
    return _torch_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)


class _VarlenAttention(torch.autograd.Function):
    """``varlen_forward`` with ``varlen_backward`` as its gradient (saves q, k, v, out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, kernel):
        out, lse = varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, kernel)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = max_q, max_k, causal, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = varlen_backward(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


def varlen_attention(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                     kernel: str) -> torch.Tensor:
    """Differentiable varlen attention ``[Tq, hq, d]`` through ``kernel`` (any of ``KERNELS``)."""
    _check_kernel(kernel, KERNELS)
    if kernel == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, _kernel_max_q(max_q), max_k, dropout_p=0.0,
                                      softmax_scale=scale, causal=causal)
    return _VarlenAttention.apply(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, kernel)


# ---------------------------------------------------------------------- torch's flash kernels (CUDA)
def _kernel_max_q(max_q: int) -> int:
    """flash's varlen forward treats ``max_q == 1`` as decoding (GQA heads folded into the query
    axis, which assumes exactly one query per sequence, and causal dropped). An upper bound is all
    the kernel needs, so 1 is passed as 2: the general path, the same result."""
    return max(int(max_q), 2)


def _token_coords(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence and position within it of each of the ``total`` flat tokens (on device, no sync)."""
    t = torch.arange(total, device=cu.device)
    bounds = cu.to(torch.long)
    seq = torch.searchsorted(bounds[1:], t, right=True)
    return seq, t - bounds[seq]


def lse_packed_from_padded(lse: torch.Tensor, cu: torch.Tensor, total: int) -> torch.Tensor:
    """``[b, h, max_q]`` (sequence-padded) -> ``[h, total]`` (packed)."""
    seq, pos = _token_coords(cu, total)
    return lse[seq, :, pos].t().contiguous()


def lse_padded_from_packed(lse: torch.Tensor, cu: torch.Tensor, max_q: int) -> torch.Tensor:
    """``[h, total]`` (packed) -> ``[b, h, max_q]`` (sequence-padded; unused slots 0)."""
    seq, pos = _token_coords(cu, lse.shape[1])
    padded = lse.new_zeros((cu.numel() - 1, lse.shape[0], max_q))
    padded[seq, :, pos] = lse.t()
    return padded


@functools.lru_cache(maxsize=None)
def _padded_lse(device: torch.device) -> bool:
    """Whether this torch's flash forward returns the varlen log-sum-exp padded (one tiny call)."""
    q = torch.zeros(3, 1, 8, dtype=torch.float16, device=device)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    return torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 2, 2, 0.0, False, False)[1].dim() == 3


def _torch_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, _kernel_max_q(max_q), int(max_k), 0.0,
                                                       causal, False, scale=scale)[:2]
    if lse.dim() == 3:
        lse = lse_packed_from_padded(lse, cu_q, q.shape[0])
    return out, lse


def _torch_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    max_q = _kernel_max_q(max_q)
    lse = lse.to(torch.float32).contiguous()
    if _padded_lse(q.device):
        lse = lse_padded_from_packed(lse, cu_q, max_q)
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout 0: never read
    offset = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(dout.contiguous(), q, k, v, out.contiguous(), lse, cu_q, cu_k,
                                                    max_q, int(max_k), 0.0, causal, seed, offset, scale=scale)


# ---------------------------------------------------------------------- the exact reference
def _pairs(cu_q, cu_k):
    bq, bk = cu_q.tolist(), cu_k.tolist()
    if len(bq) != len(bk):
        raise ValueError(f"cu_q has {len(bq) - 1} sequences, cu_k {len(bk) - 1}")
    return zip(zip(bq[:-1], bq[1:]), zip(bk[:-1], bk[1:]))


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """``[h, nq, nk]`` scaled scores in the accumulation dtype, -inf where the mask hides a key."""
    acc = acc_dtype(q)
    groups = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.to(acc), k.repeat_interleave(groups, dim=1).to(acc)) * scale
    if causal:
        nq, nk = q.shape[0], k.shape[0]
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (nk - nq), float("-inf"))
    return s


def _reference_forward(q, k, v, cu_q, cu_k, causal, scale):
    acc = acc_dtype(q)
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)
    for (qa, qb), (ka, kb) in _pairs(cu_q, cu_k):
        if qb == qa or kb == ka:
            continue
        s = _scores(q[qa:qb], k[ka:kb], causal, scale)
        block_lse = torch.logsumexp(s, dim=-1)  # [h, nq]
        p = torch.exp(s - block_lse[..., None]).nan_to_num(0.0)  # rows that see nothing: 0
        vs = v[ka:kb].repeat_interleave(groups, dim=1).to(acc)
        out[qa:qb] = torch.einsum("hqk,khd->qhd", p, vs).to(q.dtype)
        lse[:, qa:qb] = block_lse
    return out, lse


def _reference_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    acc = acc_dtype(q)
    hkv = k.shape[1]
    groups = q.shape[1] // hkv
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for (qa, qb), (ka, kb) in _pairs(cu_q, cu_k):
        if qb == qa or kb == ka:
            continue
        nk = kb - ka
        p = torch.exp(_scores(q[qa:qb], k[ka:kb], causal, scale) - lse[:, qa:qb, None].to(acc))
        do, o = dout[qa:qb].to(acc), out[qa:qb].to(acc)
        ks, vs = (x[ka:kb].repeat_interleave(groups, dim=1).to(acc) for x in (k, v))
        dp = torch.einsum("qhd,khd->hqk", do, vs)
        ds = p * (dp - (do * o).sum(-1).t()[..., None]) * scale
        dq[qa:qb] = torch.einsum("hqk,khd->qhd", ds, ks)
        dk[ka:kb] += torch.einsum("hqk,qhd->khd", ds, q[qa:qb].to(acc)).reshape(nk, hkv, groups, -1).sum(2)
        dv[ka:kb] += torch.einsum("hqk,qhd->khd", p, do).reshape(nk, hkv, groups, -1).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
