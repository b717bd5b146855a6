"""Qwen3.5-MoE and Qwen3-Next (text) against transformers, fp32 (tests/workers_qwen3_next.py): the hybrid
Gated DeltaNet / gated-attention layers with mixture-of-experts MLPs (shared expert with its sigmoid gate,
the load-balancing loss), at TP1 (this process) and, in one 2-rank gloo group, TP2, TP2+SP, EP2, CP2,
Ulysses2 (and CP2 with EP2 over the CP ranks for Qwen3-Next): padded and packed batches (each sequence
alone in transformers), every HF tensor's gradient, ``save_pretrained`` bitwise, and a second SGD step.
In the same group: PP2 (Qwen3.5-MoE, 1F1B) and PP2 x VPP2 (Qwen3-Next, interleaved; one chunk holds only
the dense layer) with ``forward_backward`` and the aux loss per micro-batch over two SGD steps, and LoRA
against peft at TP2(+SP) on the Gated DeltaNet projections (Qwen3.5-MoE's ``in_proj_qkv/z/b/a``; Qwen3-Next's
fused ``in_proj_qkvz``/``in_proj_ba`` too), ``out_proj``, the attention projections and
Qwen3.5-MoE's shared-expert MLP; LoRA on routed experts is refused by LoRA itself.
Also the ``Groups`` sharding rule that de-interleaves Qwen3-Next's ``in_proj_qkvz``/``in_proj_ba``.
"""

from __future__ import annotations

import pytest
import torch

from parallel.sharding import Groups, ShardingError, read_piece
from tests.distributed import run_distributed
from tests.workers_qwen3_5 import write_model
from tests.workers_qwen3_next import case, configs, suite

BOUNDS = {
    "padded_logits": 5e-5, "packed_logits": 5e-5,
    "padded_loss": 1e-5, "packed_loss": 1e-5, "padded_aux_loss": 1e-6,
    "padded_grads": 1e-4, "packed_grads": 1e-4,  # relative to each tensor's largest gradient
    "router_layers": 0.0, "saved_tensors": 0.0, "step1_loss": 1e-5, "step1_grads": 1e-4,
}
PIPELINE_BOUNDS = {**{f"pp_{m}_step{s}": b for s in (0, 1) for m, b in (("loss", 1e-5), ("aux_loss", 1e-6),
                                                                        ("grads", 1e-4))},
                   "pp_logprobs": 1e-4}
LORA_BOUNDS = {"logits_vs_peft": 2e-5, "lora_grads_vs_peft": 1e-4, "base_params_with_grad": 0.0,
               "lora_grads_count_mismatch": 0.0, "saved_adapter_logits": 2e-5, "saved_config_differs": 0.0,
               "merged_vs_peft": 1e-6, "merged_export_vs_saved": 0.0}
LAYOUTS = [dict(tp=2), dict(tp=2, sequence_parallel=True), dict(ep=2), dict(cp=2), dict(ulysses=2)]
PLAN = [(name, kwargs) for name in ("qwen3_5_moe", "qwen3_next") for kwargs in LAYOUTS] + [
    ("qwen3_next", dict(cp=2, ep=2))]  # the EP group made of the two CP ranks
PIPELINES = [("qwen3_5_moe", dict(pp=2), "1f1b"),
             ("qwen3_next", dict(pp=2, vpp=2), "interleaved_1f1b")]  # layer 1 (dense) is a chunk of its own
# peft's regular-expression form (our LoRA reads the same), routed experts excluded (our LoRA refuses them).
# Qwen3-Next: peft 0.21 turns any gate_proj/up_proj/down_proj target of a qwen2_moe-like model into its fused
# routed experts (shared expert and dense MLP included), so only the mixers' projections are compared there.
LORA_TARGETS = {
    "qwen3_5_moe": r".*\.(linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)|self_attn\.[qkvo]_proj"
                   r"|shared_expert\.(gate|up|down)_proj)",
    "qwen3_next": r".*\.(linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj)|self_attn\.[qkvo]_proj)"}
LORA_LAYOUTS = {"qwen3_5_moe": dict(tp=2, sequence_parallel=True), "qwen3_next": dict(tp=2)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_next")
    return {name: write_model(root, name, cfg, seed=i) for i, (name, cfg) in enumerate(configs().items())}


@pytest.fixture(scope="module")
def records(dirs):
    from parallel import ParallelConfig
    from tests.workers_lora import make_adapter

    loras = []
    for name, kwargs in LORA_LAYOUTS.items():
        make_adapter(dirs[name], f"{dirs[name]}_adapter", LORA_TARGETS[name])
        loras.append((name, f"{dirs[name]}_adapter", kwargs))
    single = [r for name in dirs for r in case(dirs[name], ParallelConfig())]
    distributed = [r for rank in run_distributed(2, suite, dirs, PLAN, PIPELINES, loras) for r in rank]
    return single + distributed


def _out_of_bounds(records, bounds) -> list[str]:
    return [f"{name} {layout} {metric}={value:.3g} (max {bounds[metric]})"
            for name, layout, metric, value in records if metric in bounds and not value <= bounds[metric]]


def _layouts_with(records, bounds) -> set:
    """The (model, layout) pairs whose records are of this kind; each must carry every metric of it."""
    layouts = {(r[0], r[1]) for r in records if r[2] in bounds}
    for metric in bounds:
        assert {(r[0], r[1]) for r in records if r[2] == metric} == layouts, metric
    return layouts


def test_matches_transformers_in_every_layout(records):
    layouts = _layouts_with(records, BOUNDS)
    assert len(layouts) == len(PLAN) + 2, sorted(layouts)
    bad = _out_of_bounds(records, BOUNDS)
    assert not bad, "\n".join(bad)
    assert all(v > 1.0 for _, _, m, v in records if m in ("packed_loss_value", "aux_loss_value"))


def test_pipeline_stages_match_transformers_over_two_steps(records):
    assert len(_layouts_with(records, PIPELINE_BOUNDS)) == len(PIPELINES)
    bad = _out_of_bounds(records, PIPELINE_BOUNDS)
    assert not bad, "\n".join(bad)


def test_lora_matches_peft(records):
    assert len(_layouts_with(records, LORA_BOUNDS)) == len(LORA_LAYOUTS)
    bad = _out_of_bounds(records, LORA_BOUNDS)
    assert not bad, "\n".join(bad)


def test_configs():
    from models.qwen3_5_moe.config import model_config as moe_config
    from models.qwen3_next.config import model_config as next_config

    cfg = moe_config(configs()["qwen3_5_moe"])
    assert cfg.moe.norm_topk_prob and cfg.sparse_layers() == frozenset(range(4)) and cfg.moe.shared_expert
    cfg = next_config(configs()["qwen3_next"])
    assert not cfg.moe.norm_topk_prob and cfg.sparse_layers() == frozenset({0, 2, 3})
    assert cfg.linear_layers() == frozenset({0, 1, 3}) and cfg.rotary_dim == 4


def _groups_by_hand(full: torch.Tensor, sizes, groups: int, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s rows written out: its groups' first components, then their second ones, ..."""
    width, per = sum(sizes), groups // n
    out = []
    for c, rows in enumerate(sizes):
        for g in range(rank * per, (rank + 1) * per):
            start = g * width + sum(sizes[:c])
            out.append(full[start:start + rows])
    return torch.cat(out)


@pytest.mark.parametrize("sizes,groups,n", [((2, 2, 3, 3), 4, 1), ((2, 2, 3, 3), 4, 2), ((2, 2, 3, 3), 4, 4),
                                            ((1, 1), 6, 3), ((4, 4, 8, 8), 2, 2)])
def test_groups_rule_deinterleaves_and_merges_back_bitwise(sizes, groups, n, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(groups * 10 + n)
    full = torch.randn(groups * sum(sizes), 5, generator=gen)
    rule = Groups(sizes, groups)
    shards = rule.split_all(full, n)
    for r, shard in enumerate(shards):
        assert torch.equal(shard, _groups_by_hand(full, sizes, groups, r, n))
        assert rule.shard_shape(tuple(full.shape), n) == tuple(shard.shape)
    assert torch.equal(rule.merge(shards), full)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        lazy = f.get_slice("w")
        for r in range(n):
            assert torch.equal(read_piece(lambda idx: lazy[idx], tuple(full.shape), rule.piece(full.shape, r, n)),
                               shards[r])


def test_groups_rule_errors():
    with pytest.raises(ShardingError, match=r"tensor of 10 rows is not 2 groups of \[2, 2\] rows \(expected 8\)"):
        Groups((2, 2), 2).piece((10, 3), 0, 1)
    with pytest.raises(ShardingError, match=r"size 3 is not divisible by 2 ranks"):
        Groups((2, 2), 3).piece((12, 3), 0, 2)
