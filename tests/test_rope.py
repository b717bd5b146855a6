"""RoPE cos/sin tables against transformers' LlamaRotaryEmbedding, for every supported scaling type.

Our layout: ``position_ids [b, s] -> cos, sin [s, b, 1, head_dim]``; transformers':
``[b, s, head_dim]``. transformers' dynamic-NTK module caches the longest length it has seen, so
each reference call uses a FRESH transformers module (the result for a model that sees the batch
fresh), while our module is reused across calls to show it has no call history.
"""

from __future__ import annotations

import pytest
import torch

from models.common.blocks.rope import RotaryEmbedding, apply_rotary
from models.llama.config import model_config
from tests.cases import write_hf_model

TOL = 1e-6

ROPE_CASES = {
    "default": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=64),
    "linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                   max_position_embeddings=64),
    "dynamic": dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
                    max_position_embeddings=16),
    "llama3": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8},
                   max_position_embeddings=64),
}


def _config(kind: str, head_dim: int = 16):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, **ROPE_CASES[kind])


def _ours(hf_config) -> RotaryEmbedding:
    cfg = model_config(hf_config)
    return RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)


def _reference(hf_config, position_ids: torch.Tensor):
    """transformers' cos/sin from a fresh module, ``[b, s, hd]``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaRotaryEmbedding(hf_config)
    x = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        return rope(x, position_ids)


def _positions(max_pos: int, batch: int = 2) -> list[torch.Tensor]:
    """Several position layouts whose largest id is ``max_pos``."""
    gen = torch.Generator().manual_seed(max_pos)
    seq = torch.arange(max_pos + 1)
    out = [seq.unsqueeze(0).expand(batch, -1).clone()]  # plain 0..max_pos, batch of equal rows
    offset = torch.stack([seq[: max_pos // 2 + 1] + max_pos - max_pos // 2, seq[: max_pos // 2 + 1]])  # left-shifted
    out.append(offset)
    rand = torch.randint(0, max_pos + 1, (3, 7), generator=gen)  # unordered, repeated ids
    rand[1, 3] = max_pos
    out.append(rand)
    return out


def _compare(ours: RotaryEmbedding, hf_config, position_ids: torch.Tensor) -> None:
    cos, sin = ours(position_ids, torch.float32)
    b, s = position_ids.shape
    hd = hf_config.head_dim
    assert cos.shape == sin.shape == (s, b, 1, hd)
    ref_cos, ref_sin = _reference(hf_config, position_ids)
    assert ref_cos.shape == (b, s, hd)
    ours_cos = cos.squeeze(2).transpose(0, 1)
    ours_sin = sin.squeeze(2).transpose(0, 1)
    err = max((ours_cos - ref_cos).abs().max().item(), (ours_sin - ref_sin).abs().max().item())
    assert err <= TOL, f"max |cos/sin difference| {err:.3g} for max position {int(position_ids.max())}"


@pytest.mark.parametrize("kind", ["default", "linear", "llama3"])
@pytest.mark.parametrize("head_dim", [16, 24])
def test_static_rope_matches_transformers(kind, head_dim):
    hf_config = _config(kind, head_dim)
    ours = _ours(hf_config)
    for max_pos in (0, 5, 31, 63, 200):
        for pos in _positions(max_pos):
            _compare(ours, hf_config, pos)


@pytest.mark.parametrize("head_dim", [16, 24])
def test_dynamic_rope_matches_fresh_transformers_at_every_length(head_dim):
    hf_config = _config("dynamic", head_dim)
    ours = _ours(hf_config)  # one module for every call: long, short, long again
    for max_pos in (40, 3, 14, 15, 16, 17, 25, 10, 40, 39):
        for pos in _positions(max_pos):
            _compare(ours, hf_config, pos)


def test_dynamic_rope_scales_only_past_max_positions():
    """Sanity on the reference itself: the frequencies change exactly when seq_len > 16."""
    hf_config = _config("dynamic")
    default = _config("default")
    short = torch.arange(16).unsqueeze(0)  # seq_len 16 = max_position_embeddings
    long = torch.arange(17).unsqueeze(0)
    assert torch.equal(_reference(hf_config, short)[0], _reference(default, short)[0])
    assert not torch.allclose(_reference(hf_config, long)[0], _reference(default, long)[0])
    ours = _ours(hf_config)
    assert not torch.allclose(ours(long, torch.float32)[0], _ours(default)(long, torch.float32)[0])


def test_scaled_types_differ_from_default():
    """The scaling is really applied (a test comparing defaults to defaults would pass vacuously)."""
    pos = torch.arange(30).unsqueeze(0)
    base = _ours(_config("default"))(pos, torch.float32)[0]
    for kind in ("linear", "llama3"):
        assert not torch.allclose(_ours(_config(kind))(pos, torch.float32)[0], base), kind


@pytest.mark.parametrize("kind", ["default", "linear", "llama3", "dynamic"])
def test_apply_rotary_matches_transformers(kind):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf_config = _config(kind)
    gen = torch.Generator().manual_seed(0)
    b, s, heads, hd = 2, 20, 3, hf_config.head_dim
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    q = torch.randn(b, heads, s, hd, generator=gen)
    k = torch.randn(b, heads, s, hd, generator=gen)
    ref_cos, ref_sin = _reference(hf_config, pos)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    cos, sin = _ours(hf_config)(pos, torch.float32)
    got_q = apply_rotary(q.permute(2, 0, 1, 3), cos, sin).permute(1, 2, 0, 3)
    got_k = apply_rotary(k.permute(2, 0, 1, 3), cos, sin).permute(1, 2, 0, 3)
    assert (got_q - ref_q).abs().max().item() <= 1e-5
    assert (got_k - ref_k).abs().max().item() <= 1e-5


def test_linear_scaling_full_model_logits_match_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from models.llama import build_parallel_model

    cfg = LlamaConfig(vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    path = write_hf_model(tmp_path, "llama_linear", cfg, seed=5)
    ours = build_parallel_model(str(path)).eval()
    assert ours.config.rope.rope_type == "linear" and ours.config.rope.factor == 2.0
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, 80, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours(ids).logits
        want = ref(ids).logits
    assert got.shape == want.shape == (2, 24, 80)
    assert (got - want).abs().max().item() <= 1e-5
