"""CUDA-only checks of the fused elementwise ops (``parallel.fused_ops``): each kernel against the torch
reference on the same inputs, fp32 and bf16, forward and backward: RMSNorm alone and fused with the
residual add (Liger-Kernel, skipped without the package), SwiGLU on the packed ``[gate | up]`` tensor
and RoPE on views into the packed qkv, full and partial rotary (our Triton kernels); that the automatic
dispatch picks them on CUDA; and a decoder layer with the kernels against the same layer with
``PMZ_FUSED=0``. Skipped on machines without CUDA; the CPU side is tests/test_fused_ops.py.

Bounds: the kernels round where the reference rounds (fp32 math in between), so fp32 agrees to ~1e-6
and bf16 within a couple of bf16 ulps of the values' scale (2**-7 relative); Liger's RMSNorm backward
sums the weight gradient in fp32 over row blocks, the reference in the activation dtype."""

from __future__ import annotations

import pytest
import torch

from parallel import fused_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

needs_liger = pytest.mark.skipif(not fused_ops._has_liger(), reason="liger-kernel is not installed")
needs_triton = pytest.mark.skipif(not fused_ops._has_triton(), reason="Triton is not installed")

DTYPES = (torch.float32, torch.bfloat16)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # relative to the reference's max |value|


def _run(fn, inputs, ngrad, seed=0):
    leaves = [t.detach().clone().requires_grad_(i < ngrad) for i, t in enumerate(inputs)]
    outs = fn(*leaves)
    outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if o is not None]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sum((o.float() * torch.randn(o.shape, generator=gen, device="cuda")).sum() for o in outs).backward()
    return outs + [leaf.grad for leaf in leaves[:ngrad]]


def _compare(fn, backend, inputs, dtype, ngrad=None):
    ngrad = len(inputs) if ngrad is None else ngrad
    got = _run(lambda *a: fn(*a, backend=backend), inputs, ngrad)
    ref = _run(lambda *a: fn(*a, backend="reference"), inputs, ngrad)
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        scale = b.float().abs().max().clamp_min(1e-6)
        err = (a.float() - b.float()).abs().max() / scale
        assert err <= TOL[dtype], f"tensor {i}: max rel {err:.3e} > {TOL[dtype]:.1e}"


@needs_liger
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_liger_rms_norm_matches_reference(dtype, residual):
    x, r = torch.randn(2, 300, 1536, dtype=dtype, device="cuda"), torch.randn(2, 300, 1536, dtype=dtype, device="cuda")
    w = (1 + 0.1 * torch.randn(1536, device="cuda")).to(dtype)
    if residual:
        _compare(lambda x, r, w, backend: fused_ops.rms_norm(x, w, 1e-6, r, backend=backend), "liger", [x, r, w], dtype)
    else:
        _compare(lambda x, w, backend: fused_ops.rms_norm(x, w, 1e-6, backend=backend), "liger", [x, w], dtype)


@needs_liger
@pytest.mark.parametrize("dtype", DTYPES)
def test_liger_rms_norm_on_head_views(dtype):
    """q/k norm (Qwen3): RMSNorm over head_dim of a non-contiguous ``[s, b, heads, d]`` view of the qkv."""
    qkv = torch.randn(64, 2, 6 * 128, dtype=dtype, device="cuda")
    w = (1 + 0.1 * torch.randn(128, device="cuda")).to(dtype)
    _compare(lambda t, w, backend: fused_ops.rms_norm(t[..., :4 * 128].view(64, 2, 4, 128), w, 1e-6,
                                                      backend=backend), "liger", [qkv, w], dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_reference(dtype):
    gu = torch.randn(2, 300, 2 * 8960, dtype=dtype, device="cuda")
    _compare(fused_ops.swiglu, "triton", [gu], dtype)
    odd = torch.randn(37, 2 * 1000 + 2, dtype=dtype, device="cuda")  # inter not a multiple of the block
    _compare(fused_ops.swiglu, "triton", [odd], dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [128, 64])
@pytest.mark.parametrize("batch", [1, 3])
def test_rotary_matches_reference_on_qkv_views(dtype, rotary_dim, batch):
    from models.common.blocks.rope import RotaryEmbedding
    from models.common.config import RopeConfig

    s, hq, hkv, d = 257, 12, 2, 128
    qkv = torch.randn(s, batch, (hq + 2 * hkv) * d, dtype=dtype, device="cuda")
    rope = RotaryEmbedding(RopeConfig(theta=1e6), rotary_dim, 32768).cuda()
    cos, sin = rope(torch.randint(0, 4096, (batch, s), device="cuda"), dtype)

    def fn(t, cos, sin, backend):
        q, k, _ = t.split([hq * d, hkv * d, hkv * d], dim=-1)
        return fused_ops.apply_rotary(q.view(s, batch, hq, d), k.view(s, batch, hkv, d), cos, sin, backend=backend)

    _compare(fn, "triton", [qkv, cos, sin], dtype, ngrad=1)


@needs_triton
def test_rotary_with_mrope_tables():
    from models.common.blocks.rope import RotaryEmbedding
    from models.common.config import RopeConfig

    s, b, h, d = 100, 2, 4, 128
    rope = RotaryEmbedding(RopeConfig(theta=1e6, mrope_section=(16, 24, 24)), d, 32768).cuda()
    cos, sin = rope(torch.randint(0, 500, (3, b, s), device="cuda"), torch.bfloat16)
    q, k = (torch.randn(s, b, n, d, dtype=torch.bfloat16, device="cuda") for n in (h, 1))
    _compare(lambda q, k, c, sn, backend: fused_ops.apply_rotary(q, k, c, sn, backend=backend), "triton",
             [q, k, cos, sin], torch.bfloat16, ngrad=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_picks_the_kernels_on_cuda(dtype, monkeypatch):
    monkeypatch.delenv("PMZ_FUSED", raising=False)
    x = torch.randn(4, 2, 64, dtype=dtype, device="cuda")
    q, cos = torch.randn(4, 2, 3, 64, dtype=dtype, device="cuda"), torch.randn(4, 2, 1, 64, dtype=dtype, device="cuda")
    tri = "triton" if fused_ops._has_triton() else "reference"
    assert fused_ops.swiglu_backend(x) == tri
    assert fused_ops.rotary_backend(q, cos, cos) == tri
    lig = "liger" if fused_ops._has_liger() else "reference"
    assert fused_ops.rms_norm_backend(x, torch.ones(64, dtype=dtype, device="cuda")) == lig
    assert fused_ops.rms_norm_backend(x, torch.ones(64, dtype=dtype, device="cuda"), x) == lig
    assert fused_ops.rms_norm_backend(x.double(), torch.ones(64, dtype=torch.float64, device="cuda")) == "reference"
    monkeypatch.setenv("PMZ_FUSED", "0")
    assert fused_ops.swiglu_backend(x) == "reference" and fused_ops.rms_norm_backend(x, x[0, 0]) == "reference"


@pytest.mark.parametrize("qk_norm", [False, True])
def test_decoder_layer_with_kernels_matches_reference(qk_norm, monkeypatch):
    """One bf16 decoder layer (Qwen2 / Qwen3 shape, q/k norm when asked) with whatever kernels are
    installed against the same layer with PMZ_FUSED=0: output and every parameter gradient."""
    from dataclasses import replace

    from models.common.blocks.decoder import DecoderLayer
    from models.common.blocks.rope import RotaryEmbedding
    from models.common.config import ModelConfig, RopeConfig
    from parallel.config import ParallelConfig
    from parallel.groups import ParallelGroups

    cfg = ModelConfig(vocab_size=1000, hidden_size=512, intermediate_size=1408, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, rope=RopeConfig(theta=1e6),
                      qkv_bias=not qk_norm, qk_norm=qk_norm)
    torch.manual_seed(0)
    layer = DecoderLayer(replace(cfg), ParallelGroups.single(ParallelConfig()), torch.bfloat16, "cuda")
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0 if p.dim() > 1 else 1.0, 0.05)
    x = torch.randn(512, 1, 512, dtype=torch.bfloat16, device="cuda")
    cos, sin = RotaryEmbedding(cfg.rope, 64, 4096).cuda()(torch.arange(512, device="cuda")[None], torch.bfloat16)
    results = []
    for fused in ("1", "0"):
        monkeypatch.setenv("PMZ_FUSED", fused)
        layer.zero_grad()
        inp = x.clone().requires_grad_()
        out = layer(inp, cos, sin)
        out.float().square().mean().backward()
        results.append([out.detach(), inp.grad] + [p.grad for p in layer.parameters()])
    for i, (a, b) in enumerate(zip(*results)):
        err = (a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)
        assert err <= 3e-2, f"tensor {i}: max rel {err:.3e}"
