"""GPU-only checks (flash-attn path vs SDPA). Skipped, and reported as skipped, on CPU machines only:
on a CUDA machine a missing flash-attn is a failure (tools/setup.sh installs it wherever nvidia-smi is)."""

from __future__ import annotations

import pytest
import torch

from models.common.blocks import attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(autouse=True)
def _flash_attn_installed():
    assert attention._FLASH_AVAILABLE, "CUDA is here but flash-attn is not importable: run tools/setup.sh " \
                                       "(it installs flash-attn on machines with nvidia-smi)"


def _qkv(s, b, hq, hkv, d, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(s, b, h, d, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def test_flash_padded_matches_sdpa():
    q, k, v = _qkv(64, 2, 8, 2, 64)
    flash = attention.causal_attention(q, k, v)
    qt, kt, vt = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    ref = attention._sdpa(qt, kt, vt, None, causal=True).permute(2, 0, 1, 3).reshape(flash.shape)
    assert (flash.float() - ref.float()).abs().max().item() < 2e-2


def test_flash_varlen_matches_per_sequence_sdpa():
    q, k, v = _qkv(40, 1, 8, 2, 64)
    cu = torch.tensor([0, 7, 25, 40], device="cuda")
    flash = attention.causal_attention(q, k, v, cu_seqlens=cu)
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[a:b].permute(1, 2, 0, 3) for x in (q, k, v))
        outs.append(attention._sdpa(qs, ks, vs, None, causal=True).permute(2, 0, 1, 3))
    ref = torch.cat(outs).reshape(flash.shape)
    assert (flash.float() - ref.float()).abs().max().item() < 2e-2
