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
  * ``"torch"``: torch's own flash kernels (FlashAttention-2 based), ``aten._flash_attention_forward
    /_backward`` (CUDA, fp16 / bf16, head size a multiple of 8 up to 256, sm80 or newer). Dropout is
    0, so backward never reads the philox seed/offset it is given (torch's ``varlen_attn`` passes the
    same placeholders). Older torch builds return the log-sum-exp padded ``[b, hq, max_q]`` instead
    of packed ``[hq, Tq]``: ``varlen_forward`` always returns it packed and ``varlen_backward`` hands
    the kernel the layout its forward produces (probed once per device).
  * ``"fa3"`` / ``"fa4"``: the same aten calls with FlashAttention-3 (Hopper, the
    ``flash_attn_interface`` package) or FlashAttention-4 (sm90/sm100, ``flash_attn.cute``, the
    ``flash-attn-4`` wheel) activated in torch's dispatcher through
    ``torch.nn.attention.activate_flash_attention_impl`` (torch's own shims, ``torch/nn/attention/
    _fa3.py``/``_fa4.py``: forward with log-sum-exp and backward from a given one, varlen, GQA). The
    activation is **process-wide**: while one is active, every flash call of the process runs it
    (SDPA's flash backend included); a call through ``"torch"`` restores torch's own kernel first.
    Their varlen log-sum-exp is packed ``[hq, Tq]`` (read in torch's shims and the packages'
    interfaces, not yet run here).
  * ``"cudnn"``: cuDNN's fused attention through SDPA (``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``,
    ``enable_gqa``), only in ``varlen_attention`` and only for **equal-length** sequences with equal
    query and key lengths (then the flat tokens are a dense ``[n, L]`` batch; no log-sum-exp is
    returned, so not for context parallelism). cuDNN also has a ragged form
    (``aten._cudnn_attention_forward`` with ``cum_seq_q/cum_seq_k``), but torch 2.13's own
    ``varlen_attn`` keeps it switched off (``_should_use_cudnn`` returns False) and refuses GQA on it,
    so it is not used here.
  * ``"flash_attn"``: the ``flash_attn`` (FlashAttention-2) package's ``flash_attn_varlen_func``, only
    in ``varlen_attention`` and only where installed (an optional extra, never required). Its
    backward from a *given* output and log-sum-exp is private API that changes between releases, so
    the context-parallel blocks use the kernels above.
  * ``"reference"``: exact per-sequence matmul/softmax in fp32 (fp64 for fp64), the same semantics
    on any device; what CPU tests run in place of a flash kernel, and the check of the flash ones.

Which kernel runs (``flash_kernel`` -> ``choose_kernel``): per device (compute capability), per what
the call needs (a log-sum-exp: context-parallel ring steps; equal lengths: cuDNN) and what is
installed, the first of ``PREFERENCE[major]`` that takes the call. The order is **chosen by
reading, not measured by this project**, except one point: on an H200 (torch 2.11) the backward of
torch's FA2-based varlen kernel took 31.1 ms per step where SDPA's cuDNN kernels took 16.6 ms
(docs/benchmarks.md, from one profile of transformers' SDPA), so on Hopper cuDNN comes first where it
applies. FA3/FA4 are ahead of torch's FA2 by their authors' published figures. ``PMZ_ATTENTION_KERNEL``
(or ``flash_kernel(override=)``) overrides the choice, for tests and benchmarks: a kernel that is not
usable there is an error; one that cannot take a particular call (``cudnn`` on unequal lengths or
where a log-sum-exp is needed, ``flash_attn`` for the latter) leaves that call to the automatic
choice. ``kernel=`` at a call forces exactly that kernel (an error where it cannot take the call).
The CPU (and fp32/fp64) paths never consult it: they stay the exact SDPA / reference paths.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

KERNEL_ENV = "PMZ_ATTENTION_KERNEL"
KERNELS = ("torch", "fa3", "fa4", "cudnn", "flash_attn", "reference")
LSE_KERNELS = ("torch", "fa3", "fa4", "reference")  # forward with lse, backward from a given lse
_FLASH_IMPL = {"torch": None, "fa3": "FA3", "fa4": "FA4"}  # torch.nn.attention impl names
# Preference per compute-capability major (chosen by reading; see the module docstring).
PREFERENCE = {
    9: ("cudnn", "fa3", "fa4", "flash_attn", "torch"),  # Hopper
    10: ("fa4", "cudnn", "flash_attn", "torch"),  # datacenter Blackwell
}
DEFAULT_PREFERENCE = ("flash_attn", "torch")  # Ampere/Ada and anything else
# cuDNN's attention only above 9.15.0: torch itself prefers it on sm90/sm100 only there
# (check_prefer_cudnn_attention in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: older cuDNN
# has a wrong-results bug for sequence lengths not a multiple of 128, pytorch/pytorch#169849).
CUDNN_MIN_VERSION = 91500


def _spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
        return False


# The FA2 package's compiled extension: the ``flash-attn-4`` wheel also installs a ``flash_attn``
# package (``flash_attn.cute``) without ``flash_attn_varlen_func``.
FLASH_ATTN_INSTALLED = _spec("flash_attn_2_cuda")


# ---------------------------------------------------------------------- which kernel applies
@functools.lru_cache(maxsize=None)
def _torch_flash_on(device: torch.device) -> bool:
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(device) >= (8, 0)


def _flash_impls() -> tuple[str, ...]:
    """The FlashAttention implementations this torch can activate (``"FA3"``, ``"FA4"``)."""
    from torch.nn import attention

    lister = getattr(attention, "list_flash_attention_impls", None)
    return tuple(lister()) if lister is not None else ()


@functools.lru_cache(maxsize=None)
def installed_kernels(device: torch.device) -> frozenset[str]:
    """The GPU kernels usable on ``device`` with this torch and these packages (probes nothing on
    the GPU; importability of the FA3/FA4 packages is checked without importing them)."""
    cap = torch.cuda.get_device_capability(device)
    found = set()
    if _torch_flash_on(device):
        found.add("torch")
    if (torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled() and cap >= (8, 0)
            and (torch.backends.cudnn.version() or 0) > CUDNN_MIN_VERSION):
        found.add("cudnn")
    impls = _flash_impls()
    if "FA3" in impls and cap[0] == 9 and _spec("flash_attn_interface"):
        found.add("fa3")
    if "FA4" in impls and cap[0] in (9, 10) and _spec("flash_attn.cute.interface"):
        found.add("fa4")
    if FLASH_ATTN_INSTALLED and cap >= (8, 0):
        found.add("flash_attn")
    return frozenset(found)


def _takes(kernel: str, need_lse: bool, equal_lengths: bool) -> bool:
    if need_lse and kernel not in LSE_KERNELS:
        return False
    return kernel != "cudnn" or equal_lengths


def choose_kernel(capability: tuple[int, int], installed, *, need_lse: bool = False, equal_lengths: bool = False,
                  override: str | None = None) -> str | None:
    """The kernel for a call on a device of ``capability`` where ``installed`` kernels are usable
    (pure: CPU tests inject both). ``need_lse``: the caller needs ``varlen_forward``/``varlen_backward``
    (context parallel); ``equal_lengths``: every sequence has the same length, queries as keys.
    ``override`` (or ``PMZ_ATTENTION_KERNEL``, read by ``flash_kernel``): see the module docstring."""
    if override:
        if override not in KERNELS:
            raise ValueError(f"attention kernel {override!r} ({KERNEL_ENV}): one of {', '.join(KERNELS)}")
        if override == "reference":
            return override
        if override not in installed:
            raise RuntimeError(f"attention kernel {override!r} was asked for ({KERNEL_ENV} or kernel=) but is not "
                               f"usable here (sm{capability[0]}{capability[1]}; usable: "
                               f"{', '.join(sorted(installed)) or 'none'})")
        if _takes(override, need_lse, equal_lengths):
            return override
    for kernel in PREFERENCE.get(capability[0], DEFAULT_PREFERENCE):
        if kernel in installed and _takes(kernel, need_lse, equal_lengths):
            return kernel
    return None


def flash_kernel(q: torch.Tensor, *, need_lse: bool = False, equal_lengths: bool = False,
                 override: str | None = None) -> str | None:
    """The fast kernel for tensors like ``q`` (``choose_kernel`` with this device's capability and
    kernels, ``override`` else ``PMZ_ATTENTION_KERNEL``), or None where none takes them: CPU,
    fp32/fp64, a head size flash does not take, a GPU before sm80 - the exact paths run there."""
    d = q.shape[-1]
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256):
        return None
    return choose_kernel(torch.cuda.get_device_capability(q.device), installed_kernels(q.device),
                         need_lse=need_lse, equal_lengths=equal_lengths,
                         override=override or os.environ.get(KERNEL_ENV) or None)


def equal_lengths(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, max_q: int, max_k: int) -> bool:
    """Whether every sequence has the same length, queries as keys, from host values only (no
    device read): ``n`` sequences, none empty, ``total == n * max`` for both."""
    n = cu_q.numel() - 1
    return n > 0 and cu_k.numel() - 1 == n and max_q == max_k and total_q == total_k == n * max_q


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
    _check_kernel(kernel, LSE_KERNELS)
    if kernel == "reference":
        return _reference_forward(q, k, v, cu_q, cu_k, causal, scale)
    return _torch_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, kernel)


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                    kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients given the output ``out`` and log-sum-exp ``lse [hq, Tq]`` of each query row, which
    may be *final* values merged over more keys than these (context parallel): then the result is
    these keys' share of the gradients. ``dq [Tq, hq, d]``, ``dk/dv [Tk, hkv, d]`` in q's dtype."""
    _check_kernel(kernel, LSE_KERNELS)
    if kernel == "reference":
        return _reference_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)
    return _torch_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, kernel)


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
    if kernel == "cudnn":
        if not equal_lengths(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k):
            raise ValueError("attention kernel 'cudnn' takes equal-length sequences only (queries as keys)")
        return dense_sdpa(q, k, v, cu_q.numel() - 1, causal, scale, cudnn_backends())
    return _VarlenAttention.apply(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, kernel)


# ---------------------------------------------------------------------- cuDNN through SDPA (CUDA)
def cudnn_backends() -> list:
    """cuDNN's attention first, then SDPA's flash and memory-efficient kernels, in that priority order
    (``_sdpa_context``): shapes cuDNN refuses at run time (a key length of 1, a head size above its
    limit for this cuDNN, deterministic mode, ...) fall back to another fused kernel instead of SDPA's
    "No available kernel" error; math is never enabled."""
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def _sdpa_context(backends):
    """``sdpa_kernel(backends, set_priority=True)`` (the list is a priority order), plain
    ``sdpa_kernel(backends)`` on a torch without ``set_priority``; no restriction for None."""
    import contextlib

    from torch.nn.attention import sdpa_kernel

    if not backends:
        return contextlib.nullcontext()
    try:
        return sdpa_kernel(backends, set_priority=True)
    except TypeError:
        return sdpa_kernel(backends)


def dense_sdpa(q, k, v, n: int, causal: bool, scale: float, backends) -> torch.Tensor:
    """Flat tokens of ``n`` equal-length sequences as one dense SDPA call restricted to ``backends``
    (``sdpa_kernel``; None: SDPA's own choice): ``[n * L, h, d] -> [n, h, L, d]`` views, GQA through
    ``enable_gqa``, top-left causal (the same as flash's bottom-right for equal lengths). Differentiable
    through SDPA's own backward. Returns ``[n * L, hq, d]``."""
    import torch.nn.functional as F

    total, hq, d = q.shape
    qd, kd, vd = (x.view(n, x.shape[0] // n, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
    with _sdpa_context(backends):
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale,
                                             enable_gqa=hq != k.shape[1])
    return out.transpose(1, 2).reshape(total, hq, d)


def dense_attention(q, k, v, causal: bool, scale: float, backends) -> torch.Tensor:
    """A padded batch with no padding, ``[s, b, h, d]``, through SDPA restricted to ``backends``
    without gathering tokens: ``[b, h, s, d]`` views in, ``[s, b, hq * d]`` out."""
    import torch.nn.functional as F

    s, b, hq, d = q.shape
    qt, kt, vt = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    with _sdpa_context(backends):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale,
                                             enable_gqa=hq != k.shape[2])
    return out.permute(2, 0, 1, 3).reshape(s, b, hq * d)


# ---------------------------------------------------------------------- flash kernels via aten (CUDA)
def use_flash_impl(kernel: str) -> None:
    """Make ``aten._flash_attention_*`` run ``kernel``'s implementation: activate FA3/FA4 in torch's
    dispatcher, or restore torch's own for ``"torch"`` (process-wide; a no-op when already so)."""
    want = _FLASH_IMPL[kernel]
    from torch.nn import attention

    current_of = getattr(attention, "current_flash_attention_impl", None)  # not in every torch release
    current = current_of() if current_of is not None else _ACTIVE_IMPL[0]
    if current == want:
        return
    if want is None:
        attention.restore_flash_attention_impl()
    else:
        attention.activate_flash_attention_impl(want)
    _ACTIVE_IMPL[0] = want


_ACTIVE_IMPL: list[str | None] = [None]  # what use_flash_impl last set, where torch cannot say


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


def _padded_lse(device: torch.device, kernel: str) -> bool:
    """Whether ``kernel``'s flash forward returns the varlen log-sum-exp padded: never FA3/FA4 (packed
    ``[hq, Tq]`` in their interfaces); torch's own, probed once per device."""
    return kernel == "torch" and _torch_padded_lse(device)


@functools.lru_cache(maxsize=None)
def _torch_padded_lse(device: torch.device) -> bool:
    """Whether torch's own flash forward returns the varlen log-sum-exp padded (one tiny call)."""
    q = torch.zeros(3, 1, 8, dtype=torch.float16, device=device)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    return torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 2, 2, 0.0, False, False)[1].dim() == 3


def _torch_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, kernel="torch"):
    use_flash_impl(kernel)
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, _kernel_max_q(max_q), int(max_k), 0.0,
                                                       causal, False, scale=scale)[:2]
    if lse.dim() == 3:
        lse = lse_packed_from_padded(lse, cu_q, q.shape[0])
    return out, lse


def _torch_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, kernel="torch"):
    use_flash_impl(kernel)
    max_q = _kernel_max_q(max_q)
    lse = lse.to(torch.float32).contiguous()
    if _padded_lse(q.device, kernel):
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
