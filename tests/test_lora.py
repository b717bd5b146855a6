"""LoRA on the parallel layers against peft (a real client) on the same adapter: logits, LoRA
gradients (and none on the frozen base), our saved adapter loading into peft with r / lora_alpha
kept, merged weights equal to peft's ``merge_and_unload``; at TP=1 and TP=2 with and without SP, plain and
rsLoRA scaling; two SGD steps of ``forward_backward`` with PP, FSDP2 and TP+SP+CP next to peft;
bad target modules refused before any process group."""

from __future__ import annotations

import functools

import pytest

from tests.distributed import run_distributed
from tests.workers_lora import TARGETS, lora_suite, make_adapter


@pytest.fixture(scope="module")
def adapters(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for case, targets, rslora in (("qwen2_untied", TARGETS, False),
                                  ("llama_llama3", ["q_proj", "v_proj", "down_proj"], True)):
        path = root / case / "adapter"
        make_adapter(hf_dirs[case], str(path), targets, rslora=rslora)
        out[case] = str(path)
    return out


@functools.lru_cache(maxsize=None)
def _run(world: int, key: tuple):
    hf_dirs, adapters = dict(key[0]), dict(key[1])
    layouts = [dict(tp=world)] + ([dict(tp=world, sequence_parallel=True)] if world > 1 else [])
    cases = [(case, hf_dirs[case], adapters[case], kw) for kw in layouts for case in sorted(adapters)]
    return [r for rank in run_distributed(world, lora_suite, cases) for r in rank]


BOUNDS = {"logits_vs_peft": 1e-5, "lora_grads_vs_peft": 1e-4, "base_params_with_grad": 0.0,
          "lora_grads_count_mismatch": 0.0, "saved_adapter_logits": 1e-5, "saved_config_differs": 0.0,
          "merged_vs_peft": 1e-6, "merged_export_vs_saved": 0.0}


@pytest.mark.parametrize("world", [1, 2])
def test_lora_matches_peft(world, hf_dirs, adapters):
    records = _run(world, (tuple(sorted(hf_dirs.items())), tuple(sorted(adapters.items()))))
    assert {r[0] for r in records} == set(adapters) and {r[2] for r in records} == {True, False}
    assert {r[3] for r in records} == set(BOUNDS)
    bad = [f"{r[0]} {r[1]} rslora={r[2]} {r[3]}={r[4]:.3g}" for r in records if not r[4] <= BOUNDS[r[3]]]
    assert not bad, "\n".join(bad)


def test_unknown_lora_target_refused(hf_dirs):
    from peft import LoraConfig

    from models.common.blocks.lora import LoraError
    from models.qwen2 import build_parallel_model

    with pytest.raises(LoraError, match="foo_proj"):
        build_parallel_model(hf_dirs["qwen2_untied"], lora=LoraConfig(r=4, target_modules=["q_proj", "foo_proj"]))


@pytest.mark.parametrize("world,layouts", [(2, [dict(pp=2), dict(fsdp=True)]),
                                           (4, [dict(tp=2, sequence_parallel=True, cp=2)])])
def test_lora_training_matches_peft_across_layouts(world, layouts, hf_dirs, adapters):
    from tests.workers_lora import lora_training_suite

    records = [r for rank in run_distributed(world, lora_training_suite, hf_dirs["qwen2_untied"],
                                             adapters["qwen2_untied"], layouts) for r in rank]
    assert len({r[1] for r in records}) == len(layouts)
    bad = [f"{r[1]} {r[2]}={r[3]:.3g}" for r in records if not r[3] <= 1e-5]
    assert not bad, "\n".join(bad)


def test_lora_configs_and_adapters_that_do_not_fit_are_refused(hf_dirs, adapters):
    from peft import LoraConfig

    from models.common.blocks.lora import LoraError
    from models.qwen2 import build_parallel_model
    from parallel import ParallelConfigError
    from tests.workers_lora import TARGETS

    path = hf_dirs["qwen2_untied"]
    with pytest.raises(LoraError, match="use_dora"):
        build_parallel_model(path, lora=LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    model = build_parallel_model(path, lora=LoraConfig(r=4, lora_alpha=99, target_modules=TARGETS))
    from models.common.blocks.lora import check_lora_config
    from models.common.weights import hf_shapes
    from parallel import ParallelConfig

    dropout = LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.1)
    with pytest.raises(ParallelConfigError, match="lora_dropout"):  # TP ranks would drop different inputs
        check_lora_config(model.config, model.weight_map, dropout, ParallelConfig(tp=2),
                          hf_shapes(model.config, model.weight_map))
    check_lora_config(model.config, model.weight_map, dropout, ParallelConfig(tp=2, sequence_parallel=True),
                      hf_shapes(model.config, model.weight_map))  # control: with SP each rank drops its own tokens
    with pytest.raises(LoraError, match="lora_alpha"):  # the adapter was made with lora_alpha=16
        model.load_lora_adapter(adapters["qwen2_untied"])
    fewer = build_parallel_model(path, lora=LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj"]))
    with pytest.raises(LoraError, match="target_modules"):
        fewer.load_lora_adapter(adapters["qwen2_untied"])


def test_lora_with_tied_embeddings_split_over_stages():
    """The frozen tied embedding/head pair takes no cross-stage gradient sum (it used to crash);
    the loss equals the single-stage model's on the same LoRA initialisation."""
    from tests.test_pipeline import _configs
    from tests.workers_lora import tied_pipeline_lora

    cfg = _configs()["qwen2_tied8"]
    staged = run_distributed(2, tied_pipeline_lora, cfg)
    single = run_distributed(1, tied_pipeline_lora, cfg)
    assert staged[0] == staged[1]
    assert abs(staged[0] - single[0]) <= 1e-5


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_saved_adapter_files_take_the_umask(hf_dirs, tmp_path, umask):
    """adapter_model.safetensors gets ``0666 & ~umask`` like adapter_config.json (safetensors' save_file
    alone leaves 0600: a vLLM server running as another user could not read the adapter)."""
    import os
    import stat

    from peft import LoraConfig

    from models.qwen2 import build_parallel_model

    model = build_parallel_model(hf_dirs["qwen2_untied"], lora=LoraConfig(r=4, target_modules=["q_proj"]))
    old = os.umask(umask)
    try:
        model.save_lora_adapter(tmp_path / "adapter")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "adapter").iterdir()}
    assert modes == {"adapter_config.json": 0o666 & ~umask, "adapter_model.safetensors": 0o666 & ~umask}, modes
