"""The MoE hybrids (Qwen3.5-MoE, Qwen3-Next) under FSDP2, ``recompute="full"`` and ``compile=True``, and the
model loader on checkpoints whose experts are stored fused, against transformers fp32, in one 2-rank gloo
group (tests/workers_hybrid_moe_training.py): FSDP2 over dp2 for both models (FSDP2 with EP is refused by
the builder, tests/test_moe.py), recompute at EP2 (Qwen3.5-MoE) and TP2+SP (Qwen3-Next) with the
per-sequence cases of tests/test_qwen3_next.py (padded and packed logits, loss with the load-balancing
loss, every HF tensor's gradient, save_pretrained bitwise, a second SGD step); ``compile=True`` at EP2
(Qwen3.5-MoE) and TP2 (Qwen3-Next), two SGD steps next to the eager model and transformers; and
Qwen3.5-MoE at EP2 loaded from transformers' in-memory (fused) tensors saved as they are: bitwise the
per-expert checkpoint's model, transformers' logits, each rank reading only its own experts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_qwen3_next import BOUNDS as NEXT_BOUNDS
from tests.workers_hybrid_moe_training import suite
from tests.workers_qwen3_5 import write_model
from tests.workers_qwen3_next import configs

# the per-sequence case's bounds (tests/test_qwen3_next.py) with logits held to 1e-5 absolute
BOUNDS = {**NEXT_BOUNDS, "padded_logits": 1e-5, "packed_logits": 1e-5}
COMPILE_BOUNDS = {**{f"compile_{m}_step{s}": b for s in (0, 1) for m, b in (("loss", 1e-5), ("grads", 1e-4),
                                                                              ("loss_vs_eager", 1e-5))},
                  "compiled_no_graphs": 0.0}
FUSED_BOUNDS = {"params_not_bitwise": 0.0, "fused_logits": 1e-5, "foreign_experts_read": 0.0,
                "own_experts_unread": 0.0}
PLAN = [("qwen3_5_moe", dict(fsdp=True)), ("qwen3_next", dict(fsdp=True)),
        ("qwen3_5_moe", dict(ep=2, recompute="full")),
        ("qwen3_next", dict(tp=2, sequence_parallel=True, recompute="full"))]
# compile time is per distinct layer graph: Qwen3-Next compiles as a 2-layer model of its two kinds of layer
# (Gated DeltaNet + dense MLP, gated attention + experts), at TP1 over dp2 (both ranks the same batch)
COMPILES = [("qwen3_5_moe", dict(ep=2)), ("qwen3_next_small", dict())]


def small_next_config():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
                           max_position_embeddings=128, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                           num_experts_per_tok=2, router_aux_loss_coef=0.1, tie_word_embeddings=False, num_experts=4,
                           norm_topk_prob=False, mlp_only_layers=[0], intermediate_size=96, linear_num_key_heads=2,
                           linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)


def write_fused(per_expert: str, out: Path) -> str:
    """A checkpoint of transformers' in-memory tensors (experts fused: ``mlp.experts.gate_up_proj [E, 2F, H]``,
    ``down_proj [E, H, F]``) saved with safetensors as they are, beside the per-expert checkpoint's config."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    assert any(name.endswith(".mlp.experts.gate_up_proj") for name in state)  # transformers holds them fused
    out.mkdir()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(Path(per_expert) / "config.json", out / "config.json")
    return str(out)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_moe_training")
    dirs = {name: write_model(root, name, cfg, seed=i) for i, (name, cfg) in enumerate(configs().items())}
    dirs["qwen3_next_small"] = write_model(root, "qwen3_next_small", small_next_config(), seed=5)
    dirs["fused"] = write_fused(dirs["qwen3_5_moe"], root / "qwen3_5_moe_fused")
    return dirs


@pytest.fixture(scope="module")
def records(dirs):
    fused = (dirs["fused"], dirs["qwen3_5_moe"], dict(ep=2))
    return [r for rank in run_distributed(2, suite, dirs, PLAN, COMPILES, fused) for r in rank]


def _check(records, bounds, layouts: int) -> None:
    seen = {(r[0], r[1]) for r in records if r[2] in bounds}
    assert len(seen) == layouts, sorted(seen)
    for metric in bounds:  # every layout of this kind carries every metric
        assert {(r[0], r[1]) for r in records if r[2] == metric} == seen, metric
    bad = [f"{name} {layout} {metric}={value:.3g} (max {bounds[metric]})"
           for name, layout, metric, value in records if metric in bounds and not value <= bounds[metric]]
    assert not bad, "\n".join(bad)


def test_fsdp_and_recompute_match_transformers_per_sequence(records):
    _check(records, BOUNDS, len(PLAN))
    assert all(v > 1.0 for _, _, m, v in records if m in ("packed_loss_value", "aux_loss_value"))


def test_compile_matches_eager_and_transformers_over_two_steps(records):
    _check(records, COMPILE_BOUNDS, len(COMPILES))
    assert all(v > 1.0 for _, _, m, v in records if m.startswith("compile_aux_loss_value"))  # the aux loss counted


def test_fused_expert_checkpoint_loads_like_the_per_expert_one(records):
    _check(records, FUSED_BOUNDS, 1)
    assert {v for _, _, m, v in records if m == "experts_read"} == {configs()["qwen3_5_moe"].num_experts / 2}


def test_fused_experts_of_another_shape_are_refused(dirs, tmp_path):
    """The loader refuses a fused tensor that does not fit the config in one line, before any group."""
    from safetensors.torch import load_file, save_file

    from models.common.errors import CheckpointError
    from models.qwen3_5_moe import build_parallel_model

    bad = tmp_path / "bad"
    bad.mkdir()
    state = load_file(str(Path(dirs["fused"]) / "model.safetensors"))
    state["model.layers.1.mlp.experts.down_proj"] = state["model.layers.1.mlp.experts.down_proj"][:, :, :16].clone()
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_text(json.dumps(json.loads((Path(dirs["fused"]) / "config.json").read_text())))
    with pytest.raises(CheckpointError, match=r"fused experts model\.layers\.1\.mlp\.experts\.down_proj have shape "
                                              r"\(8, 64, 16\), the config implies \(8, 64, 32\)"):
        build_parallel_model(str(bad))
