"""Fused elementwise ops of the decoder: RMSNorm (optionally fused with the residual add), SwiGLU on the
packed ``[gate | up]`` tensor, and the rotary rotation of q and k (full or partial rotary).

Each op is ONE dispatch over two paths:

* ``"reference"``: the torch code the models always ran (RMSNorm in fp32 cast back as transformers does,
  ``F.silu(gate) * up``, ``x * cos + rotate_half(x) * sin``). CPUs, fp64, torch.compile'd code and any
  input a kernel does not take run it, bitwise as before; the tests compare against it.
* a fused kernel on CUDA: Liger-Kernel's ``LigerRMSNormFunction`` / ``LigerFusedAddRMSNormFunction``
  (casting mode ``"llama"``: transformers' numerics) when the ``liger-kernel`` package is installed
  (``"liger"``), and two small Triton kernels of our own (``"triton"``) for SwiGLU and RoPE, whose
  layouts Liger's ops do not take without copies (see docs/architecture.md, "Fused elementwise ops").
  Optional packages are used where installed, never required; Triton ships with CUDA builds of torch.

Inside ``torch.compile`` the reference path is traced: inductor fuses these elementwise chains itself,
and an opaque kernel would only cut its graph. ``PMZ_FUSED=0`` turns the kernels off (the reference
everywhere). ``backend=`` forces a path (tests: ``"triton"`` / ``"liger"`` also run on CPU tensors
under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

_BACKENDS = ("reference", "triton", "liger")


# ---------------------------------------------------------------------- reference (the models' code)
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: ``weight * (x / rms(x)).to(dtype)`` with the statistics in fp32."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a packed ``[..., 2 * inter]`` = ``[gate | up]`` tensor."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [s, b, heads, head_dim]`` by ``cos/sin [s, b, 1, rotary_dim]``; with ``rotary_dim <
    head_dim`` (partial rotary) the first ``rotary_dim`` channels rotate and the rest pass through."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


# ---------------------------------------------------------------------- availability and choice
@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a Triton that does not load on this machine
        return False
    return True


@functools.cache
def _has_liger() -> bool:
    if not _has_triton():
        return False
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction  # noqa: F401
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction  # noqa: F401
    except Exception:
        return False
    return True


def _kernels_allowed(x: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and os.environ.get("PMZ_FUSED", "1") != "0" and not torch.compiler.is_compiling())


def rms_norm_backend(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> str:
    """``"liger"`` where Liger's RMSNorm takes these tensors (CUDA, liger installed, one dtype for input,
    weight and residual: Liger's output keeps the input dtype while transformers' ``weight * h`` would
    promote to the weight's), else ``"reference"``."""
    same = weight.dtype == x.dtype and (residual is None or (residual.dtype == x.dtype
                                                             and residual.shape == x.shape))
    return "liger" if _kernels_allowed(x) and same and weight.dim() == 1 and _has_liger() else "reference"


def swiglu_backend(gate_up: torch.Tensor) -> str:
    return "triton" if _kernels_allowed(gate_up) and gate_up.shape[-1] % 2 == 0 and _has_triton() else "reference"


def rotary_backend(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str:
    ok = (cos.dtype == x.dtype and cos.dim() == 4 and cos.shape[-1] % 2 == 0 and cos.shape[-1] <= x.shape[-1]
          and cos.shape[2] == 1 and x.dim() == 4 and not (cos.requires_grad or sin.requires_grad))
    return "triton" if _kernels_allowed(x) and ok and _has_triton() else "reference"


def _check(backend: str | None) -> None:
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {_BACKENDS} or None (automatic)")


# ---------------------------------------------------------------------- the dispatched ops
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(x + residual), x + residual)``; without ``residual``: ``(rms_norm(x), None)``.

    The residual form is the decoder's ``h = h + block(...)`` followed by the next pre-norm: one kernel
    reads both, writes the sum (the new residual stream) and its norm."""
    _check(backend)
    backend = backend or rms_norm_backend(x, weight, residual)
    if backend == "liger":
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # in_place=False: dY may be a gradient another consumer still reads (Liger's own caveat).
        if residual is None:
            return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False), None
        return LigerFusedAddRMSNormFunction.apply(x, residual, weight, eps, 0.0, "llama", False)
    if backend == "triton":
        raise ValueError("rms_norm has no Triton kernel of its own: backend 'liger' or 'reference'")
    if residual is not None:
        x = residual + x
        return rms_norm_reference(x, weight, eps), x
    return rms_norm_reference(x, weight, eps), None


def swiglu(gate_up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of the packed ``[..., 2 * inter]`` projection output -> ``[..., inter]``."""
    _check(backend)
    backend = backend or swiglu_backend(gate_up)
    if backend == "triton":
        from parallel import fused_kernels

        return fused_kernels.SwiGLU.apply(gate_up)
    if backend == "liger":
        raise ValueError("swiglu runs Liger's kernel only on separate gate/up tensors: use 'triton' or 'reference'")
    return swiglu_reference(gate_up)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on ``q [s, b, hq, d]`` and ``k [s, b, hkv, d]`` (views into the packed qkv are fine) with
    ``cos/sin [s, b, 1, rd]`` (``rd <= d``: partial rotary rotates the first ``rd`` channels; 1-D and
    M-RoPE tables alike: the M-RoPE sections are already interleaved into the table)."""
    _check(backend)
    out = []
    for x in (q, k):
        chosen = backend or rotary_backend(x, cos, sin)
        if chosen == "triton":
            from parallel import fused_kernels

            out.append(fused_kernels.Rotary.apply(x, cos, sin))
        elif chosen == "liger":
            raise ValueError("apply_rotary: Liger's rope wants [b, h, s, d] (copies here): use 'triton'")
        else:
            out.append(rotary_reference(x, cos, sin))
    return out[0], out[1]


__all__ = ["rms_norm", "swiglu", "apply_rotary", "rms_norm_reference", "swiglu_reference", "rotary_reference",
           "rotate_half", "rms_norm_backend", "swiglu_backend", "rotary_backend"]
