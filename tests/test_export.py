"""Live export (``model.iter_export``) from trained parallel models against transformers trained on
the same batches: every HF tensor exactly once, equal to transformers' after two SGD steps (fp32,
1e-5), identical on every rank, buckets within their bound (a single parameter larger than the
bound travels alone), a bf16 export equal to the fp32 one cast bitwise."""

from __future__ import annotations

import functools

import pytest

from tests.distributed import run_distributed
from tests.workers_export import export_suite

SMALL = 6000  # bytes: several buckets per stage; an embedding of 83 x 32 fp32 (10.6 kB) is oversize
LAYOUTS = {
    2: [("qwen2_tied8", dict(pp=2, vpp=2), SMALL), ("llama_untied8", dict(tp=2, sequence_parallel=True), 1 << 20),
        ("qwen2_tied8", dict(fsdp=True), SMALL)],
    4: [("llama_untied8", dict(tp=2, pp=2), SMALL), ("qwen2_tied8", dict(pp=2), 1 << 20),
        ("qwen2_tied8", dict(tp=2, cp=2, sequence_parallel=True), SMALL)],
}


@functools.lru_cache(maxsize=None)
def _run(world: int, dirs_key: tuple, out_root: str):
    dirs = dict(dirs_key)
    cases = [(case, dirs[case], kw, b) for case, kw, b in LAYOUTS[world]]
    return [r for rank in run_distributed(world, export_suite, cases, out_root) for r in rank]


@pytest.fixture(scope="module")
def export_dirs():
    """tests/test_pipeline.py's models (the same configs and seeds), read-only from the session's checkpoint cache."""
    from tests.cases import write_hf_model
    from tests.checkpoint_cache import cached
    from tests.test_pipeline import _configs

    return {name: cached(write_hf_model, name, cfg, seed=i) for i, (name, cfg) in enumerate(_configs().items())}


BOUNDS = {"names_mismatch": 0.0, "vs_transformers": 1e-5, "oversize_buckets": 0.0, "ranks_differ": 0.0,
          "bf16_not_cast": 0.0, "bf16_dtype": 0.0, "saved_vs_exported_not_bitwise": 0.0,
          "saved_logprobs_vs_ours": 1e-5, "bf16_saved_not_cast": 0.0, "bf16_saved_config_wrong": 0.0}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("saved"))


def _records(world, export_dirs, out_root):
    import os

    os.makedirs(f"{out_root}/w{world}", exist_ok=True)
    return _run(world, tuple(sorted(export_dirs.items())), f"{out_root}/w{world}")


@pytest.mark.parametrize("world", [2, 4])
def test_save_pretrained_loads_in_transformers_and_equals_export(world, export_dirs, out_root):
    records = [r for r in _records(world, export_dirs, out_root) if r[3].startswith(("saved", "bf16_saved"))]
    assert len({r[1] for r in records}) == len(LAYOUTS[world])
    assert any(r[3] == "saved_files" and r[4] > 1 for r in records)  # sharded with an index
    bad = [f"{r[0]} {r[1]} {r[3]}={r[4]:.3g}" for r in records if r[3] in BOUNDS and not r[4] <= BOUNDS[r[3]]]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("world", [2, 4])
def test_iter_export_matches_transformers_after_training(world, export_dirs, out_root):
    records = _records(world, export_dirs, out_root)
    assert {(r[0], r[1]) for r in records} and len({r[1] for r in records}) == len(LAYOUTS[world])
    small = [r for r in records if r[3] == "buckets" and r[2] == SMALL]
    assert small and all(r[4] > 3 for r in small)  # the small bound really splits the model
    bad = [f"{r[0]} {r[1]} bucket={r[2]} {r[3]}={r[4]:.3g}" for r in records
           if r[3] in BOUNDS and not r[4] <= BOUNDS[r[3]]]
    assert not bad, "\n".join(bad)


def test_save_pretrained_refuses_existing_destination_before_writing(tmp_path):
    from models.common.export import ExportError
    from models.qwen2 import build_parallel_model
    from tests.test_pipeline import _configs

    model = build_parallel_model(_configs()["qwen2_tied8"])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        model.save_pretrained(tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    with pytest.raises(ExportError, match="parent directory does not exist"):
        model.save_pretrained(tmp_path / "missing" / "out")
    stale = tmp_path / ".fresh.pmz-tmp-0123456789ab"  # left by a killed earlier run
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    model.save_pretrained(tmp_path / "fresh")  # control: one process, whole model
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == ["config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".*pmz-tmp*"))


def test_save_pretrained_failure_leaves_nothing(tmp_path, monkeypatch):
    """A write that fails (here: the safetensors writer, as on a full disk) ends in one ExportError
    and leaves neither the destination nor a temporary directory."""
    import safetensors.torch

    from models.common.export import ExportError
    from models.qwen2 import build_parallel_model
    from tests.test_pipeline import _configs

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    model = build_parallel_model(_configs()["qwen2_tied8"])
    with pytest.raises(ExportError, match="No space left on device"):
        model.save_pretrained(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_unknown_format_and_bad_bucket_size_refused():
    from models.common.export import ExportError
    from models.qwen2 import build_parallel_model
    from tests.test_pipeline import _configs

    model = build_parallel_model(_configs()["qwen2_tied8"])
    with pytest.raises(ExportError, match="unknown export format 'gguf'"):
        next(model.iter_export("gguf"))
    with pytest.raises(ExportError, match="bucket_bytes"):
        next(model.iter_export("hf", bucket_bytes=0))


def test_shared_memory_transport_equals_collectives(export_dirs):
    """iter_export(transport="shm") gives the collective transport's buckets bitwise (HF and vLLM
    targets; TP2xPP2 with one replicated KV head and padding-only vocabulary shards; TP2 with FSDP2
    over two replicas, where only the first replica writes) and leaves nothing in /dev/shm."""
    from tests.workers_export import shm_suite

    cases = [("llama_untied8", export_dirs["llama_untied8"], dict(tp=2, pp=2), SMALL),
             ("qwen2_tied8", export_dirs["qwen2_tied8"], dict(tp=2, fsdp=True), SMALL)]
    records = [r for rank in run_distributed(4, shm_suite, cases) for r in rank]
    assert len({r[2] for r in records}) == 6
    assert all(r[4] > 3 for r in records if r[2] != "shm_files_left")  # several buckets each
    bad = [r for r in records if r[3] != 0.0]
    assert not bad, bad
