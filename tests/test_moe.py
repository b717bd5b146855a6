"""Qwen2-MoE with expert parallelism against transformers' Qwen2MoeForCausalLM (gloo, CPU, fp32).

One group of processes per world size runs every layout of that size (EP, TP(+SP), recompute,
micro-batches, PP/VPP, Ulysses); each rank compares with a transformers model built from the same
directory: logits, loss including the load-balancing loss, router logits, a padded batch, and two
SGD steps (gradients of every HF tensor, experts included). FSDP2 with ep > 1 and LoRA on experts
or the router are refused by name.
"""

from __future__ import annotations

import functools
import re

import pytest

from tests.checkpoint_cache import cached
from tests.distributed import run_distributed
from tests.workers_moe import MOE_CASES, dispatch_suite, fsdp_with_ep_refusal, suite, write_moe_model

FP32_TOL = 1e-5
GRAD_REL_TOL = 1e-4

LAYOUTS = {
    1: [("shared", {}), ("plain", {})],
    2: [("shared", {"ep": 2}), ("plain", {"ep": 2}), ("shared", {"ep": 2, "moe_dispatcher": "allgather"}),
        ("shared", {"tp": 2}), ("plain", {"tp": 2, "sequence_parallel": True}),
        ("shared", {"ep": 2, "recompute": "full"}),
        # forward_backward with the aux loss: micro-batches at pp=1, interleaved stages (a chunk without sparse layers)
        ("shared", {"ep": 2}, {"microbatches": 2}), ("plain", {"pp": 2, "vpp": 2}),
        # the sequence split over Ulysses ranks: aux-loss statistics and router logits over both ranks' tokens
        ("shared", {"ulysses": 2})],
    4: [("shared", {"ep": 4}), ("shared", {"tp": 2, "ep": 2, "sequence_parallel": True}),
        ("plain", {"tp": 2, "ep": 2, "moe_dispatcher": "allgather"}), ("shared", {"pp": 2, "ep": 2}),
        ("shared", {"pp": 2, "ep": 2}, {"microbatches": 1, "schedule": "gpipe"}),
        ("plain", {"tp": 2, "pp": 2, "sequence_parallel": True, "recompute": "full"})],
}


@pytest.fixture(scope="module")
def moe_dirs():
    """Read-only, from the session's checkpoint cache ("shared" at seed 0 is also tests/test_convert_moe's)."""
    return tuple(sorted((name, cached(write_moe_model, name, seed=i)) for i, name in enumerate(MOE_CASES)))


@functools.lru_cache(maxsize=None)
def _records(world: int, dirs: tuple) -> list[tuple]:
    per_rank = run_distributed(world, suite, dict(dirs), LAYOUTS[world])
    return [rec for rank_records in per_rank for rec in rank_records]


def _bound(metric: str) -> tuple[str, float]:
    if metric == "loss_change":
        return "min", 1e-3
    if metric.startswith("grads_step"):
        return "max", GRAD_REL_TOL
    if metric in ("router_layers", "saved_tensors"):
        return "max", 0.0  # bitwise
    return "max", FP32_TOL


METRICS = {"logits": "logits|masked_logits|logits_after_steps", "loss": "loss|step\\d_loss",
           "aux": "aux_loss|step\\d_microbatch_aux_loss",
           "masked_aux": "masked_aux_loss", "router": "router_logits|router_layers", "grads": "grads_step\\d",
           "moved": "loss_change", "saved": "saved_tensors"}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
@pytest.mark.parametrize("metric", sorted(METRICS))
def test_moe_parity(moe_dirs, world, metric):
    records = _records(world, moe_dirs)
    pat = re.compile(METRICS[metric])
    selected = [r for r in records if pat.fullmatch(r[2])]
    assert selected, f"no records for {metric}"
    bad = []
    for case, layout, name, value in selected:
        kind, bound = _bound(name)
        if (kind == "max" and not value <= bound) or (kind == "min" and not value >= bound):
            bad.append(f"{case} {layout} {name}={value:.3g} (bound {kind} {bound})")
    layouts = {(case, layout) for case, layout, *_ in selected}
    if metric in ("loss", "grads", "saved"):  # every layout (pipeline ones: no logits, aux or router records)
        assert len(layouts) == len(LAYOUTS[world]), f"layouts without {metric} records: {layouts}"
    assert not bad, "; ".join(bad)


DISPATCH_CASES = [(d, counts, skew) for d in ("alltoall", "allgather")
                  for counts, skew in (([9, 4], False), ([6, 5], True), ([7, 0], False))]


def test_dispatchers_match_dense_reference():
    """Both dispatchers against a per-token reference: uneven token counts, a rank whose experts get no
    token (skewed router), a rank with no tokens at all; outputs and every gradient."""
    per_rank = run_distributed(2, dispatch_suite, DISPATCH_CASES)
    records = [rec for rank_records in per_rank for rec in rank_records]
    assert len(records) == 2 * len(DISPATCH_CASES) * 5
    bad = [f"{case} {layout} {name}={value:.3g}" for case, layout, name, value in records if not value <= FP32_TOL]
    assert not bad, "; ".join(bad)


def _edited_copy(src, dst, edit):
    """A copy of the HF directory ``src`` whose tensors pass through ``edit(dict)``."""
    from safetensors.torch import load_file, save_file

    from tests.checkpoint_cache import copy

    copy(src, dst)  # writable: the source is read-only in the session's checkpoint cache
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_bad_moe_checkpoints_and_layouts_are_refused_by_name(moe_dirs, tmp_path):
    """Missing expert, wrong router shape, experts not divisible by ep, LoRA targets selecting experts or
    the router: one clear error, before any process group exists (single process here: a collective
    would fail differently)."""
    from pathlib import Path

    from peft import LoraConfig

    from models.common.blocks.lora import LoraError
    from models.common.sources import CheckpointError
    from models.qwen2_moe import build_parallel_model
    from parallel import ParallelConfig, ParallelConfigError

    src = Path(dict(moe_dirs)["shared"])
    missing = _edited_copy(src, tmp_path / "missing",
                           lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*layers\.2\.mlp\.experts\.5\.up_proj"):
        build_parallel_model(missing)
    router = _edited_copy(src, tmp_path / "router", lambda t: t.update(
        {"model.layers.0.mlp.gate.weight": t["model.layers.0.mlp.gate.weight"][:6].clone()}))
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.gate\.weight \(6, 64\) \(expected \(8, 64\)\)"):
        build_parallel_model(router)
    with pytest.raises(ParallelConfigError, match="num_experts=8 is not divisible by ep=3"):
        build_parallel_model(src, ParallelConfig(ep=3))
    with pytest.raises(ParallelConfigError, match=r"ep=2 does not divide dp\*cp = 1\*1"):
        build_parallel_model(src, ParallelConfig(ep=2))
    for targets, words in ((["q_proj", "up_proj"], "'up_proj' selects model.layers.0.mlp.experts.0.up_proj"),
                           ("all-linear", "'gate' selects model.layers.0.mlp.gate"),
                           (r".*\.experts", "'experts' selects model.layers.0.mlp.experts")):
        with pytest.raises(LoraError, match=re.escape(words) + ".*not supported"):
            build_parallel_model(src, lora=LoraConfig(r=2, target_modules=targets))


def test_fsdp_with_expert_parallel_is_refused_on_every_rank(moe_dirs):
    """FSDP2 would shard each parameter over a replica mesh whose EP ranks hold different experts (measured
    before the refusal: logits off by 0.66, gradients by 1e10): one line, on every rank, before any group."""
    per_rank = run_distributed(2, fsdp_with_ep_refusal, dict(moe_dirs)["plain"])
    for message in per_rank:
        assert re.search(r"fsdp with ep=2 is not supported \(FSDP2 shards .* different experts", message), message
