"""Runs every Triton kernel of ours and every Liger-Kernel op the models call in Triton's CPU interpreter
and prints what it measured, one JSON line per compared tensor; tests/test_triton_interpreter.py runs
this as a subprocess with ``TRITON_INTERPRET=1`` (the variable must be set before Triton is imported)
and holds the bounds.

Cases (``parallel.fused_ops`` with ``backend=`` forced, so the kernel runs on CPU tensors): our SwiGLU
kernel (forward, backward), our rotary kernel on views into a packed qkv (full and partial rotary, a
``[s, 1, 1, d]`` table broadcast over the batch; forward, backward), Liger's ``LigerRMSNormFunction``
and ``LigerFusedAddRMSNormFunction`` (forward, backward of x, residual and weight). Each in fp32 and
bf16 on the same random inputs, with one fixed random upstream gradient per output.

Per tensor it reports, with ``M = max |exact|``: ``err`` = max |kernel - reference| (both in the dtype
under test) / M; for bf16 also ``kernel_err`` and ``ref_err``, the max |. - exact| / M of the kernel's
and the reference's bf16 results against ``exact``, the reference run on the same (bf16-valued)
inputs in fp64 (the reference RMSNorm takes its statistics in fp32 even then: 1e-7 relative, far
below a bf16 ulp), and ``ulp``, one bf16 ulp of ``M`` divided by ``M``.

Interpreter shims (compiled kernels need none of them; they make the interpreter do what the GPU does):
  * a Python float kernel argument reaches the interpreted kernel as a Python float, where a compiled
    kernel gets an fp32 scalar (Liger calls ``eps.to(tl.float32)``): converted to an fp32 scalar;
  * libdevice's ``rsqrt`` (imported by Liger's RMSNorm modules) has no interpreter implementation:
    replaced in those two modules by ``1 / sqrt``;
  * the interpreter rounds fp32 -> bf16 casts toward zero (it drops the low mantissa bits), where the
    GPU's ``cvt.rn.bf16.f32`` rounds to nearest even: that one cast goes through torch's conversion,
    which rounds to nearest even. Without it bf16 results sit up to one ulp off for no fault of the
    kernel.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (tests/test_triton_interpreter.py does)")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from parallel import fused_ops  # noqa: E402


# ---------------------------------------------------------------------- the shims (see the module docstring)
def _install_shims() -> None:
    plain_cvt = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return plain_cvt(arg)

    interpreter._implicit_cvt = implicit_cvt

    builder = interpreter.InterpreterBuilder
    plain_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(bits.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return plain_cast(self, src, dst_type)

    builder.cast_impl = cast_impl

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle.data
        return (np.ascontiguousarray(handle.data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)

    def narrow(data, dtype):
        if data.dtype != np.float32:  # comparisons: booleans
            return interpreter.TensorHandle(data, tl.int1 if data.dtype == np.bool_ else dtype)
        return cast_impl(None, interpreter.TensorHandle(data, tl.float32), tl.bfloat16)

    plain_binary, plain_unary = builder.binary_op, builder.unary_op

    def binary_op(self, lhs, rhs, op):
        if tl.bfloat16 not in (lhs.dtype.scalar, rhs.dtype.scalar):
            return plain_binary(self, lhs, rhs, op)
        return narrow(op(widen(lhs), widen(rhs)), tl.bfloat16)

    def unary_op(self, arg, op):
        if arg.dtype.scalar != tl.bfloat16:
            return plain_unary(self, arg, op)
        return narrow(op(widen(arg)), tl.bfloat16)

    builder.binary_op, builder.unary_op = binary_op, unary_op

    if fused_ops._has_liger():
        import liger_kernel.ops.fused_add_rms_norm as liger_add_norm
        import liger_kernel.ops.rms_norm as liger_norm

        @triton.jit
        def _rsqrt(x):
            return 1.0 / tl.sqrt(x)

        liger_norm.rsqrt = liger_add_norm.rsqrt = _rsqrt


# ---------------------------------------------------------------------- running and measuring
def _run(fn, inputs, grads_out, ngrad):
    """Outputs of ``fn(*inputs)`` and the gradients of its first ``ngrad`` inputs for upstream ``grads_out``."""
    leaves = [t.detach().clone().requires_grad_(i < ngrad) for i, t in enumerate(inputs)]
    outs = fn(*leaves)
    outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if o is not None]
    torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, grads_out)])
    return [o.detach() for o in outs] + [leaf.grad for leaf in leaves[:ngrad]]


def _upstream(fn, inputs, seed):
    """One random upstream gradient per output, in the outputs' dtype (what autograd would hand the kernel)."""
    with torch.no_grad():
        outs = fn(*inputs, backend="reference")
    outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if o is not None]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]


def measure(name, backend, fn, inputs, ngrad=None, seed=1):
    """One case: ``fn(*inputs, backend=backend)`` against ``backend="reference"``; JSON line per tensor."""
    ngrad = len(inputs) if ngrad is None else ngrad
    dtype = inputs[0].dtype
    grads_out = _upstream(fn, inputs, seed)
    got = _run(lambda *a: fn(*a, backend=backend), inputs, grads_out, ngrad)
    ref = _run(lambda *a: fn(*a, backend="reference"), inputs, grads_out, ngrad)
    exact = _run(lambda *a: fn(*a, backend="reference"), [t.double() for t in inputs],
                 [g.double() for g in grads_out], ngrad)
    labels = [f"out{i}" for i in range(len(got) - ngrad)] + [f"grad{i}" for i in range(ngrad)]
    for label, a, b, e in zip(labels, got, ref, exact):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape == e.shape, (name, label, a.dtype, a.shape, b.shape)
        top = e.abs().max().item() or 1.0
        row = {"case": name, "dtype": str(dtype).removeprefix("torch."), "tensor": label,
               "err": (a.double() - b.double()).abs().max().item() / top,
               "kernel_err": (a.double() - e).abs().max().item() / top,
               "ref_err": (b.double() - e).abs().max().item() / top}
        if dtype == torch.bfloat16:
            row["ulp"] = 2.0 ** (np.floor(np.log2(top)) - 7) / top
        print(json.dumps(row), flush=True)


def main() -> None:
    _install_shims()
    liger = fused_ops._has_liger()
    s, b, hq, hkv, d = 5, 3, 4, 2, 16

    def rope(t, cos, sin, backend):
        q, k, _ = t.split([hq * d, hkv * d, hkv * d], dim=-1)
        return fused_ops.apply_rotary(q.view(s, b, hq, d), k.view(s, b, hkv, d), cos, sin, backend=backend)

    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        qkv = torch.randn(s, b, (hq + 2 * hkv) * d).to(dtype)
        for rd in (d, d // 2):
            angle = torch.randn(s, b, 1, rd // 2).repeat(1, 1, 1, 2)
            measure(f"rotary rd={rd}", "triton", rope, [qkv, angle.cos().to(dtype), angle.sin().to(dtype)], ngrad=1)
        measure("rotary table [s,1,1,d]", "triton", rope,
                [qkv, torch.randn(s, 1, 1, d).to(dtype), torch.randn(s, 1, 1, d).to(dtype)], ngrad=1)
        measure("swiglu", "triton", fused_ops.swiglu, [torch.randn(s, b, 2 * 40).to(dtype)])
        if liger:
            x, r = torch.randn(s, b, 64).to(dtype), torch.randn(s, b, 64).to(dtype)
            w = (1 + 0.1 * torch.randn(64)).to(dtype)
            measure("rms_norm", "liger", lambda x, w, backend: fused_ops.rms_norm(x, w, 1e-6, backend=backend), [x, w])
            measure("rms_norm+residual", "liger",
                    lambda x, r, w, backend: fused_ops.rms_norm(x, w, 1e-6, r, backend=backend), [x, r, w])
    print(json.dumps({"done": True, "liger": liger, "triton": triton.__version__}), flush=True)


if __name__ == "__main__":
    main()
