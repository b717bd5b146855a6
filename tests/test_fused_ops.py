"""The fused-op dispatch (``parallel.fused_ops``) on CPU: every op picks the torch reference here, the
reference is bitwise the code the models ran before the dispatch (copied below as it was), the API's
shapes (residual fusion, partial rotary, M-RoPE tables) and the argument checks. The kernels themselves
run in Triton's CPU interpreter in tests/test_triton_interpreter.py (fp32 and bf16); the CUDA dispatch
with the device faked in tests/test_kernel_dispatch.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.common.blocks.rope import RotaryEmbedding
from models.common.config import RopeConfig
from parallel import fused_ops
from parallel.layers import RMSNorm

DTYPES = (torch.float32, torch.bfloat16)


# ---------------------------------------------------------------------- the code before the dispatch
def old_rms_norm(x, weight, eps):
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def old_swiglu(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def old_rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def old_apply_rotary(x, cos, sin):
    return x * cos + old_rotate_half(x) * sin


def _grads(fn, *inputs, seed=0):
    """Output and the gradients of every input under one fixed random upstream gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


def _same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------- dispatch on CPU
def test_cpu_dispatch_picks_the_reference():
    x = torch.randn(4, 2, 8)
    assert fused_ops.rms_norm_backend(x, torch.ones(8)) == "reference"
    assert fused_ops.rms_norm_backend(x, torch.ones(8), x) == "reference"
    assert fused_ops.swiglu_backend(x) == "reference"
    q = torch.randn(4, 2, 3, 8)
    cos = torch.randn(4, 2, 1, 8)
    assert fused_ops.rotary_backend(q, cos, cos) == "reference"


def test_unknown_or_unfit_backend_is_refused():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="backend="):
        fused_ops.swiglu(x, backend="cuda")
    with pytest.raises(ValueError, match="no Triton kernel"):
        fused_ops.rms_norm(x, torch.ones(8), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="separate gate/up"):
        fused_ops.swiglu(x, backend="liger")


# ---------------------------------------------------------------------- the reference is the old code
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reference_is_the_old_code(dtype):
    x, w = torch.randn(5, 3, 64, dtype=dtype), torch.randn(64, dtype=dtype)
    new = _grads(lambda a, b: fused_ops.rms_norm(a, b, 1e-6)[0], x, w)
    old = _grads(lambda a, b: old_rms_norm(a, b, 1e-6), x, w)
    _same(new[0] + new[1], old[0] + old[1])
    norm = RMSNorm(64, 1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    assert torch.equal(norm(x), old_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_fusion_is_the_old_add_then_norm(dtype):
    """``norm(attn, residual=x)`` is the decoder's old ``x = x + attn; norm(x)``, both outputs, both
    gradients, bit for bit."""
    x, attn, w = torch.randn(6, 2, 32, dtype=dtype), torch.randn(6, 2, 32, dtype=dtype), torch.randn(32, dtype=dtype)

    def old(x, attn, w):
        h = x + attn
        return old_rms_norm(h, w, 1e-5), h

    new = _grads(lambda x, a, w: fused_ops.rms_norm(a, w, 1e-5, residual=x), x, attn, w)
    _same(new[0] + new[1], _grads(old, x, attn, w)[0] + _grads(old, x, attn, w)[1])
    norm = RMSNorm(32, 1e-5, dtype=dtype)
    out, res = norm(attn, residual=x)
    assert out.shape == res.shape == x.shape and torch.equal(res, x + attn)
    assert fused_ops.rms_norm(x, w, 1e-5)[1] is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_reference_is_the_old_code(dtype):
    gu = torch.randn(7, 2, 2 * 24, dtype=dtype)
    new, old = _grads(fused_ops.swiglu, gu), _grads(old_swiglu, gu)
    _same(new[0] + new[1], old[0] + old[1])
    assert new[0][0].shape == (7, 2, 24)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_reference_is_the_old_code_on_qkv_views(dtype):
    """q and k as the attention block makes them: views into the packed qkv ``[s, b, (hq + 2 hkv) d]``."""
    s, b, hq, hkv, d = 5, 2, 4, 2, 16
    qkv = torch.randn(s, b, (hq + 2 * hkv) * d, dtype=dtype)
    cos, sin = RotaryEmbedding(RopeConfig(theta=10000.0), d, 64)(torch.arange(s).repeat(b, 1), dtype)

    def split(t):
        q, k, _ = t.split([hq * d, hkv * d, hkv * d], dim=-1)
        return q.view(s, b, hq, d), k.view(s, b, hkv, d)

    new = _grads(lambda t: fused_ops.apply_rotary(*split(t), cos, sin), qkv)
    old = _grads(lambda t: tuple(old_apply_rotary(x, cos, sin) for x in split(t)), qkv)
    _same(new[0] + new[1], old[0] + old[1])


def test_partial_rotary_rotates_the_first_channels_and_passes_the_rest():
    """cos/sin narrower than head_dim: transformers' partial rotary (rotate ``[..., :rd]``, keep the rest)."""
    s, b, h, d, rd = 4, 1, 3, 16, 8
    q, k = torch.randn(s, b, h, d), torch.randn(s, b, 1, d)
    cos, sin = RotaryEmbedding(RopeConfig(theta=10000.0), rd, 64)(torch.arange(s)[None], torch.float32)
    assert cos.shape == (s, b, 1, rd)
    rq, rk = fused_ops.apply_rotary(q, k, cos, sin)
    for x, r in ((q, rq), (k, rk)):
        assert r.shape == x.shape
        assert torch.equal(r[..., rd:], x[..., rd:])
        assert torch.equal(r[..., :rd], old_apply_rotary(x[..., :rd], cos, sin))


def test_mrope_tables_take_the_same_rotation():
    """M-RoPE interleaves its sections into an ordinary ``[s, b, 1, d]`` table, so the rotation (and the
    fused kernel) is the 1-D one; with three equal rows it is plain RoPE."""
    s, b, h, d = 6, 2, 2, 16
    rope = RotaryEmbedding(RopeConfig(theta=10000.0, mrope_section=(2, 3, 3)), d, 64)
    rows = torch.stack([torch.arange(s).repeat(b, 1), torch.arange(s).flip(0).repeat(b, 1),
                        (torch.arange(s) % 3).repeat(b, 1)])
    cos, sin = rope(rows, torch.float32)
    assert cos.shape == sin.shape == (s, b, 1, d)
    q, k = torch.randn(s, b, h, d), torch.randn(s, b, 1, d)
    rq, rk = fused_ops.apply_rotary(q, k, cos, sin)
    assert torch.equal(rq, old_apply_rotary(q, cos, sin)) and torch.equal(rk, old_apply_rotary(k, cos, sin))
    plain = RotaryEmbedding(RopeConfig(theta=10000.0), d, 64)(torch.arange(s).repeat(b, 1), torch.float32)
    text = rope(torch.arange(s).repeat(3, b, 1), torch.float32)
    assert torch.equal(text[0], plain[0]) and torch.equal(text[1], plain[1])


def test_kill_switch_and_compile_keep_the_reference(monkeypatch):
    """``PMZ_FUSED=0`` and tracing under torch.compile both keep the reference (inductor fuses it)."""
    x = torch.randn(2, 8)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(fused_ops, "_has_triton", lambda: True)
    monkeypatch.setattr(fused_ops, "_has_liger", lambda: True)
    assert fused_ops.swiglu_backend(x) == "triton" and fused_ops.rms_norm_backend(x, torch.ones(8)) == "liger"
    assert fused_ops.rms_norm_backend(x, torch.ones(8, dtype=torch.float64)) == "reference"  # weight dtype differs
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert fused_ops.swiglu_backend(x) == "reference"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setenv("PMZ_FUSED", "0")
    assert fused_ops.swiglu_backend(x) == "reference" and fused_ops.rms_norm_backend(x, torch.ones(8)) == "reference"


@pytest.mark.parametrize("dtype", DTYPES)
def test_decoder_layer_fusion_is_the_old_composition(dtype):
    """The decoder layer with the residual add fused into the post-attention norm is, on CPU, bit for
    bit the old ``x = x + attn(norm(x)); x + mlp(norm(x))`` (output and every gradient)."""
    from models.common.blocks.decoder import DecoderLayer
    from models.common.config import ModelConfig
    from parallel.config import ParallelConfig
    from parallel.groups import ParallelGroups

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, qk_norm=True)
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, ParallelGroups.single(ParallelConfig()), dtype, "cpu")
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0 if p.dim() > 1 else 1.0, 0.1)
    x = torch.randn(6, 2, 32, dtype=dtype)
    cos, sin = RotaryEmbedding(cfg.rope, 8, 64)(torch.arange(6).repeat(2, 1), dtype)

    def old(x):
        x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, None, None, None, None)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    results = []
    for fn in (lambda x: layer(x, cos, sin), old):
        layer.zero_grad()
        out, grads = _grads(fn, x)
        results.append(out + grads + [p.grad for p in layer.parameters()])
    _same(*results)
