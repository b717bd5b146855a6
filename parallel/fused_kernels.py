"""Triton kernels of our own behind ``parallel.fused_ops`` (imported only when one is chosen, so a
machine without Triton never imports this module): SwiGLU on the packed ``[gate | up]`` projection
output and the rotary rotation on ``[s, b, heads, d]`` views of the packed qkv. Both read strided
inputs in place (no ``chunk``/``contiguous`` copies) and write one fresh contiguous output.

Numerics follow the reference's roundings: every product the torch code rounds to the activation
dtype is rounded here too (fp32 math in between), so bf16 results match it to the last bit in most
elements and within one bf16 ulp elsewhere; fp32 agrees to ~1e-7 (fused multiply-adds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# ---------------------------------------------------------------------- SwiGLU
@triton.jit
def _swiglu_fwd(gu_ptr, out_ptr, gu_stride, out_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + inter + cols, mask=mask, other=0.0)
    dtype = u.dtype
    act = (g / (1.0 + tl.exp(-g))).to(dtype)  # F.silu: fp32 math, rounded to the activation dtype
    out = (act.to(tl.float32) * u.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


@triton.jit
def _swiglu_bwd(gu_ptr, dout_ptr, dgu_ptr, gu_stride, dout_stride, dgu_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u_raw = tl.load(gu_ptr + row * gu_stride + inter + cols, mask=mask, other=0.0)
    dtype = u_raw.dtype
    u = u_raw.to(tl.float32)
    d = tl.load(dout_ptr + row * dout_stride + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    act = (g * sig).to(dtype).to(tl.float32)
    du = d * act
    dact = (d * u).to(dtype).to(tl.float32)
    dg = dact * sig * (1.0 + g * (1.0 - sig))
    tl.store(dgu_ptr + row * dgu_stride + cols, dg.to(dtype), mask=mask)
    tl.store(dgu_ptr + row * dgu_stride + inter + cols, du.to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with a unit last stride: a view where strides allow, else a copy."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


_SWIGLU_BLOCK = 1024


class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        gu = _rows(gate_up)
        n, two_inter = gu.shape
        inter = two_inter // 2
        out = torch.empty(n, inter, dtype=gu.dtype, device=gu.device)
        if n and inter:
            grid = (n, triton.cdiv(inter, _SWIGLU_BLOCK))
            _swiglu_fwd[grid](gu, out, gu.stride(0), out.stride(0), inter, BLOCK=_SWIGLU_BLOCK)
        ctx.save_for_backward(gu)
        ctx.shape = gate_up.shape
        return out.view(*gate_up.shape[:-1], inter)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> torch.Tensor:
        (gu,) = ctx.saved_tensors
        n, two_inter = gu.shape
        inter = two_inter // 2
        d = _rows(dout)
        dgu = torch.empty(n, two_inter, dtype=gu.dtype, device=gu.device)
        if n and inter:
            grid = (n, triton.cdiv(inter, _SWIGLU_BLOCK))
            _swiglu_bwd[grid](gu, d, dgu, gu.stride(0), d.stride(0), dgu.stride(0), inter, BLOCK=_SWIGLU_BLOCK)
        return dgu.view(ctx.shape)


# ---------------------------------------------------------------------- rotary
@triton.jit
def _rotary(x_ptr, cos_ptr, sin_ptr, out_ptr, B, H,
            xs_s, xs_b, xs_h, cs_s, cs_b, ss_s, ss_b, os_s, os_b, os_h,
            HALF: tl.constexpr, PAD_HALF: tl.constexpr, REST: tl.constexpr, PAD_REST: tl.constexpr,
            BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    s = tok // B
    b = tok % B
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, PAD_HALF)
    cmask = cols < HALF
    mask = (heads < H)[:, None] & cmask[None, :]
    c_row = cos_ptr + s * cs_s + b * cs_b
    s_row = sin_ptr + s * ss_s + b * ss_b
    c1 = tl.load(c_row + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_row + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_row + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_row + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    x_at = x_ptr + s * xs_s + b * xs_b + heads[:, None].to(tl.int64) * xs_h
    o_at = out_ptr + s * os_s + b * os_b + heads[:, None].to(tl.int64) * os_h
    x1_raw = tl.load(x_at + cols[None, :], mask=mask, other=0.0)
    dtype = x1_raw.dtype
    x1 = x1_raw.to(tl.float32)
    x2 = tl.load(x_at + HALF + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # Each product rounded to the activation dtype, then the sum, as x * cos + rotate_half(x) * sin does.
    if BACKWARD:  # the transpose: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
        y1 = (x1 * c1).to(dtype).to(tl.float32) + (x2 * s2).to(dtype).to(tl.float32)
        y2 = (x2 * c2).to(dtype).to(tl.float32) - (x1 * s1).to(dtype).to(tl.float32)
    else:  # y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
        y1 = (x1 * c1).to(dtype).to(tl.float32) - (x2 * s1).to(dtype).to(tl.float32)
        y2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    tl.store(o_at + cols[None, :], y1.to(dtype), mask=mask)
    tl.store(o_at + HALF + cols[None, :], y2.to(dtype), mask=mask)
    if REST > 0:  # partial rotary: the channels after the rotary ones pass through
        rcols = tl.arange(0, PAD_REST)
        rmask = (heads < H)[:, None] & (rcols < REST)[None, :]
        rest = tl.load(x_at + 2 * HALF + rcols[None, :], mask=rmask, other=0.0)
        tl.store(o_at + 2 * HALF + rcols[None, :], rest, mask=rmask)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    x = _unit_last(x)
    S, B, H, D = x.shape
    rd = cos.shape[-1]
    cos = _unit_last(cos).expand(S, B, 1, rd)
    sin = _unit_last(sin).expand(S, B, 1, rd)
    out = torch.empty(S, B, H, D, dtype=x.dtype, device=x.device)
    if out.numel():
        half, rest = rd // 2, D - rd
        block_h = min(triton.next_power_of_2(H), 16)
        grid = (S * B, triton.cdiv(H, block_h))
        _rotary[grid](x, cos, sin, out, B, H, x.stride(0), x.stride(1), x.stride(2),
                      cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
                      out.stride(0), out.stride(1), out.stride(2),
                      HALF=half, PAD_HALF=triton.next_power_of_2(half), REST=rest,
                      PAD_REST=triton.next_power_of_2(rest) if rest else 1, BLOCK_H=block_h, BACKWARD=backward)
    return out


class Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, backward=True), None, None
