"""vLLM pipeline stages whose model builds the embedding, the final norm or the LM head on every stage
(``models/common/vllm_stages.py``: Qwen3-VL-MoE, Qwen3-MoE, Qwen3.5, Qwen3-Next here) in ``sharded_state`` at PP 2,
checked by vLLM 0.32.

* ``pmz convert --to vllm`` (copy path) at TP 1 x PP 2 (and TP 2 x PP 2 for untied Qwen3-VL-MoE and Qwen3-MoE):
  each stage's copy of those tensors is byte-equal to the last stage's; vLLM -> HF gives transformers' tensors
  back bitwise (the readers take them from one stage). The torch path's writer and the live
  ``save_vllm_sharded_state(pp=2)`` write the same tensors.
* Real vLLM 0.32 (one client, a ``state`` job of tests/vllm_client.py at TP 1 x PP 2): on each stage vLLM's own
  model filled by its ``load_weights`` from the HF directory (Qwen3-VL-MoE: the experts in the original
  releases' transposed layout, which vLLM's loader reads) and by its strict ``ShardedStateLoader`` from pmz's
  files holds the same keys (those tensors among them, on both stages) and tensors, bitwise: a key pmz left out
  or added fails the strict loader. Qwen3-VL-MoE: the untied case (3 layers, stages 0-1 | 2, DeepStack 2) and
  the tied one (4 layers, 2 | 2); Qwen3-MoE: the tied ``qwen3moe_step2`` case; the hybrids of
  tests/test_vllm_hybrid.py (Qwen3.5: the embedding on both stages; Qwen3-Next: the embedding and its untied head).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from converters.engine import convert
from tests.test_convert_qwen3_vl import _bitwise, _tensors
from tests.test_convert_qwen3_vl_moe import _for_vllm, _release, _write
from tests.test_vllm import _load
from tests.vllm_harness import run_clients

VL_CASES = ("untied", "tied")
HYBRIDS = ("qwen3_5", "qwen3_next")
# case -> the layouts converted and read back (each also at TP 1 x PP 2 through vLLM's strict loader)
LAYOUTS = {"untied": ((1, 2), (2, 2)), "tied": ((1, 2),), "qwen3_moe": ((1, 2), (2, 2)), "qwen3_5": ((1, 2),),
           "qwen3_next": ((1, 2),)}
# what each case's files hold on every stage (vllm_stages.EVERY_STAGE, by vLLM's names); the tied cases' head is the
# embedding, stored once as lm_head.weight
LM, TEXT = "language_model.", ""
WHOLE = {"untied": [LM + "model.embed_tokens.weight", LM + "model.norm.weight", LM + "lm_head.weight"],
         "tied": [LM + "model.norm.weight", LM + "lm_head.weight"],
         "qwen3_moe": [TEXT + "model.norm.weight", TEXT + "lm_head.weight"],
         "qwen3_5": [TEXT + "model.embed_tokens.weight"],
         "qwen3_next": [TEXT + "model.embed_tokens.weight", TEXT + "lm_head.weight"]}


def _write_sources(root: Path) -> dict[str, Path]:
    from tests.cases import qwen3_configs, write_hf_model
    from tests.workers_qwen3_5 import write_model
    from tests.workers_vllm_hybrid import configs

    out = {name: _write(root, name, seed=60 + i) for i, name in enumerate(VL_CASES)}
    out["qwen3_moe"] = write_hf_model(root, "qwen3moe_step2", qwen3_configs()["qwen3moe_step2"], seed=71)
    out.update({name: Path(write_model(root, name, configs()[name], seed=72 + i)) for i, name in enumerate(HYBRIDS)})
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_pp_every_stage")
    sources = _write_sources(root)
    converted = {(name, tp, pp): convert(src, root / f"{name}-tp{tp}-pp{pp}", to="vllm", tp=tp, pp=pp, workers=2)
                 for name, src in sources.items() for tp, pp in LAYOUTS[name]}
    cases = []
    for name, src in sources.items():
        ref, ours = src, converted[name, 1, 2]
        if name in VL_CASES:  # vLLM reads fused experts transposed and needs text_config.norm_topk_prob
            release = _release(src, root / f"release-{name}")  # (tests/test_convert_qwen3_vl_moe.py says why)
            ref, ours = _for_vllm(release, root / f"ref-{name}"), _for_vllm(ours, root / f"ours-{name}")
        cases.append({"model": str(ref), "sharded": str(ours), "out": str(root / f"state-{name}")})
    run_clients([("state", {"tp": 1, "pp": 2, "cases": cases}, root / "state.json")])
    return {"root": root, "sources": sources, "converted": converted}


def _stage_tensors(directory: Path, pp_rank: int, tp_rank: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob(f"model-pp-{pp_rank}-tp-{tp_rank}-part-*.safetensors")):
        out.update(_load(path))
    return out


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_stage_holds_what_vllm_builds_there_and_back_to_hf_is_bitwise(run, tmp_path, name):
    for tp, pp in LAYOUTS[name]:
        directory = run["converted"][name, tp, pp]
        for t in range(tp):
            last = _stage_tensors(directory, pp - 1, t)
            for p in range(pp - 1):
                stage = _stage_tensors(directory, p, t)
                assert all(torch.equal(stage[k], last[k]) for k in WHOLE[name]), (tp, pp, p, t)
        back = convert(directory, tmp_path / f"back-tp{tp}-pp{pp}", to="hf", workers=2)
        assert not _bitwise(_tensors(back), _tensors(run["sources"][name])), (tp, pp)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_vllm_strict_loader_takes_every_stage_as_its_own_hf_load(run, name):
    for rank in range(2):
        prefix = run["root"] / f"state-{name}.rank{rank}"
        ours, ref = _load(f"{prefix}.ours.safetensors"), _load(f"{prefix}.reference.safetensors")
        assert all(k in ref for k in WHOLE[name]), sorted(k for k in ref if ".layers." not in k)
        assert set(ours) == set(ref), sorted(set(ours) ^ set(ref))[:6]
        bad = _bitwise(ours, ref)
        assert not bad, f"{name} rank {rank}: {bad[:6]}"


@pytest.mark.parametrize("name", ["untied", "qwen3_moe"])
def test_torch_path_writes_the_copy_paths_files(run, tmp_path, name):
    """The torch path's writer reads the units each stage's listing needs (the final norm on every stage too)."""
    from tests.test_copy_path_vllm import assert_same_files
    from tests.test_copy_targets import _torch_path

    slow = _torch_path(run["sources"][name], tmp_path / "torch", to="vllm", tp=1, pp=2, workers=1)
    assert_same_files(slow, run["converted"][name, 1, 2])


@pytest.mark.parametrize("name,module", [("untied", "qwen3_vl_moe"), ("qwen3_moe", "qwen3_moe")])
def test_live_save_vllm_sharded_state_writes_the_converted_tensors(run, tmp_path, name, module):
    """``save_vllm_sharded_state(tp=1, pp=2)`` of a model built from the source (one process) places each exported
    tensor on every stage the listing names it for: the converted stages' tensors, bitwise."""
    import importlib

    model = importlib.import_module(f"models.{module}").build_parallel_model(str(run["sources"][name]))
    model.save_vllm_sharded_state(tmp_path / "live", tp=1, pp=2)
    for p in range(2):
        live, converted = _stage_tensors(tmp_path / "live", p, 0), _stage_tensors(run["converted"][name, 1, 2], p, 0)
        assert not _bitwise(live, converted), (name, p)
