"""vLLM ``sharded_state`` targets on the copy path (converters/copy_path/vllm.py: byte ranges, no torch) against the
torch path (``PMZ_COPY_PATH=0``, converters/torch_path/vllm.py), which tests/test_vllm*.py check against vLLM 0.32's
own strict loader.

* Every covered model and layout converts on both paths into the same files, byte for byte (same file set,
  every rank file, config.json, tokenizer files), and the copy path was taken (the engine's ``_convert_by_copy``
  returned True): dense Qwen2 (GQA, qkv bias, vocab 101, untied) and Llama (one KV head replicated over TP 4,
  tied, biases everywhere) in fp32 and bf16, Qwen3 (q/k norms), Qwen2-MoE (shared expert and its gate; and a
  shared expert of width 0: the gate alone), Qwen3-MoE (tied, a dense layer among sparse ones), from HF, Megatron
  legacy (TP2 x PP2 x VPP2, MoE EP2) and torch_dist sources; the Gated DeltaNet hybrids (Qwen3.5 with an MTP block,
  left out with the torch path's note; Qwen3.5-MoE; Qwen3-Next), a Qwen3.5 conditional-generation checkpoint (its
  tower on every stage; also from torch_dist) and Qwen2.5-VL, at TP 1/2/4 with PP 1/2; parts cut small
  (``--max-shard-size``) and a 1 KiB copy buffer (every tensor filled in many rounds).
* ``pmz convert --to vllm`` in a fresh interpreter never imports torch.
* HF -> vLLM (copy path) -> HF gives back every source tensor bitwise.
* A layout vLLM cannot hold is refused before anything is written, with the torch path's one-line error, and
  nothing is left at the destination; a dtype change stays on the torch path.
* vLLM directories as a copy-path source (converters/copy_path/vllm_source.py) give the HF and vLLM files the
  torch path's ``VllmReader`` gives, byte for byte, and its Megatron rank files tensor for tensor; a Qwen2-MoE
  with a shared expert of width 0 (which the torch path cannot read back) comes back bitwise.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from converters.cli import main as pmz
from converters.engine import convert
from tests.cases import copy_path_configs, qwen3_configs, write_hf_model
from tests.test_copy_targets import _torch_path, run_pmz_without_torch


def _write_moe(root: Path, name: str, seed: int) -> Path:
    from tests.workers_moe import write_moe_model

    (root / "moe").mkdir(exist_ok=True)
    return Path(shutil.move(write_moe_model(root / "moe", name, seed=seed), root / f"qwen2moe_{name}"))


def _write_hybrid(root: Path, name: str) -> Path:
    from tests.test_convert_hybrid import _configs, add_mtp
    from tests.workers_qwen3_5 import write_model

    (root / "hybrid").mkdir(exist_ok=True)
    path = Path(shutil.move(write_model(root / "hybrid", name, _configs()[name], 11), root / name))
    if name == "qwen3_5":
        add_mtp(str(path), 0)
    return path


def _write_condgen(root: Path) -> Path:
    from tests.test_hybrid_checkpoints import conditional_generation_checkpoint

    (root / "condgen").mkdir(exist_ok=True)
    path, _ = conditional_generation_checkpoint(root / "condgen", "qwen3_5")
    return Path(shutil.move(path, root / "condgen_qwen3_5"))


def _write_vl(root: Path) -> Path:
    from tests.vl_cases import write_vl_model

    (root / "vl").mkdir(exist_ok=True)
    return Path(shutil.move(write_vl_model(root / "vl", "v25_tied", 2), root / "qwen2_5_vl"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """HF checkpoints saved by transformers, and Megatron ones written from them by the torch path."""
    root = tmp_path_factory.mktemp("copy_vllm")
    dense = copy_path_configs()
    out = {"qwen2": write_hf_model(root, "qwen2", dense["qwen2"], seed=5),
           "llama": write_hf_model(root, "llama", dense["llama_tied_bias"], seed=6),
           "qwen3": write_hf_model(root, "qwen3", qwen3_configs()["qwen3_untied"], seed=7),
           "qwen3moe": write_hf_model(root, "qwen3moe", qwen3_configs()["qwen3moe_step2"], seed=8),
           "qwen2moe": _write_moe(root, "shared", 1), "qwen2moe_plain": _write_moe(root, "plain", 2),
           "qwen3_5": _write_hybrid(root, "qwen3_5"), "qwen3_5_moe": _write_hybrid(root, "qwen3_5_moe"),
           "qwen3_next": _write_hybrid(root, "qwen3_next"), "condgen": _write_condgen(root), "vl": _write_vl(root)}
    _torch_path(out["qwen2"], root / "qwen2_bf16", to="hf", dtype="bf16", workers=1)
    out["qwen2_bf16"] = root / "qwen2_bf16"
    for name, src, fmt, layout in (("qwen2_legacy", "qwen2", "megatron", dict(tp=2, pp=2, vpp=2)),
                                   ("qwen2_dist", "qwen2", "megatron-dist", dict(tp=2)),
                                   ("llama_legacy", "llama", "megatron", dict(tp=4)),
                                   ("qwen2moe_legacy", "qwen2moe", "megatron", dict(tp=2, ep=2)),
                                   ("qwen3moe_dist", "qwen3moe", "megatron-dist", dict(tp=2, ep=2)),
                                   ("qwen3moe_grouped", "qwen3moe", "megatron",
                                    dict(tp=2, ep=2, moe_grouped_gemm=True)),
                                   ("qwen3_5_legacy", "qwen3_5", "megatron", dict(tp=2, pp=2)),
                                   ("condgen_dist", "condgen", "megatron-dist", dict(tp=2))):
        _torch_path(out[src], root / name, to=fmt, workers=1, **layout)
        out[name] = root / name
    return out


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def assert_same_files(slow: Path, fast: Path) -> None:
    a, b = _files(slow), _files(fast)
    assert sorted(b) == sorted(a), f"file sets differ: {sorted(set(a) ^ set(b))}"
    differ = [name for name in a if a[name] != b[name]]
    assert not differ, f"{fast}: {differ} differ from the torch path's"


def _both_paths(src: Path, out: Path, **layout) -> tuple[Path, Path]:
    slow, fast = out / "torch", out / "copy"
    _torch_path(src, slow, to="vllm", workers=1, **layout)
    convert(src, fast, to="vllm", workers=2, **layout)
    return slow, fast


CASES = {  # source -> layouts (tp, pp[, max shard size])
    "qwen2": [(1, 1), (2, 1), (4, 2), (2, 1, "20KB")],
    "llama": [(4, 1), (2, 2)],
    "qwen2_bf16": [(2, 2), (4, 1, "10KB")],
    "qwen3": [(2, 2)],
    "qwen3moe": [(1, 1), (4, 2)],
    "qwen2moe": [(2, 1), (2, 2, "30KB")],
    "qwen2moe_plain": [(2, 1)],
    "qwen2_legacy": [(2, 1), (1, 2)],
    "qwen2_dist": [(4, 2)],
    "llama_legacy": [(2, 1)],
    "qwen2moe_legacy": [(2, 2)],
    "qwen3moe_dist": [(4, 1)],
    "qwen3moe_grouped": [(1, 1), (2, 1)],  # experts transposed in the source: w2's bands cut by select, not scattered
    "qwen3_5": [(1, 1), (2, 2)],
    "qwen3_5_legacy": [(2, 1)],
    "qwen3_5_moe": [(2, 2)],
    "qwen3_next": [(2, 1), (4, 2)],
    "condgen": [(2, 2)],
    "condgen_dist": [(2, 1)],
    "vl": [(2, 2)],
}


@pytest.mark.parametrize("name", list(CASES))
def test_copy_path_writes_the_torch_paths_files(sources, tmp_path, paths_taken, name):
    for i, (tp, pp, *size) in enumerate(CASES[name]):
        layout = dict(tp=tp, pp=pp, **({"max_shard_size": size[0]} if size else {}))
        slow, fast = _both_paths(sources[name], tmp_path / str(i), **layout)
        assert paths_taken[-1] is True, f"{name} {layout}: the copy path was not taken"
        assert_same_files(slow, fast)
        if size:
            assert len(list(fast.glob("*-part-1.safetensors"))) > 0, "the parts were not cut"


def test_mtp_block_left_out_with_the_torch_paths_note(sources, tmp_path, capfd):
    _torch_path(sources["qwen3_5"], tmp_path / "torch", to="vllm", tp=2, workers=1)
    slow = capfd.readouterr().err
    convert(sources["qwen3_5"], tmp_path / "copy", to="vllm", tp=2)
    fast = capfd.readouterr().err
    assert "its MTP block (mtp.*, 1 layer) is not written" in fast and fast == slow


def test_small_buffers(sources, tmp_path):
    """A 1 KiB buffer (every tensor, band and interleaved row set filled in many rounds) and one worker."""
    from converters.copy_path.sources import open_raw_source
    from converters.copy_path.vllm import plan_vllm_target, write_vllm_by_copy

    for name, tp, pp in (("qwen2_legacy", 4, 2), ("qwen2moe", 2, 1), ("qwen3_5", 2, 1)):
        slow = tmp_path / f"{name}-torch"
        _torch_path(sources[name], slow, to="vllm", tp=tp, pp=pp, workers=1)
        source = open_raw_source(str(sources[name]))
        fast = tmp_path / f"{name}-copy"
        fast.mkdir()
        write_vllm_by_copy(source, plan_vllm_target(source, tp=tp, pp=pp), str(fast), max_shard_bytes=5 << 30,
                           workers=1, progress=False, files_from=str(sources[name]) if source.format == "hf" else None,
                           buffer_bytes=1024)
        assert_same_files(slow, fast)


def test_cli_conversion_to_vllm_never_imports_torch(sources, tmp_path):
    for i, name in enumerate(("qwen2", "qwen2moe_legacy")):
        out = tmp_path / f"out{i}"
        run_pmz_without_torch("convert", str(sources[name]), str(out), "--to", "vllm", "--tp", "2", "--pp", "2")
        assert (out / "model-pp-1-tp-1-part-0.safetensors").is_file()
        run_pmz_without_torch("convert", str(out), str(tmp_path / f"back{i}"), "--to", "hf")  # and read back
        assert (tmp_path / f"back{i}" / "config.json").is_file()


def test_round_trip_through_vllm_is_bitwise(sources, tmp_path, paths_taken):
    from safetensors.torch import load_file

    for name in ("qwen2", "qwen2moe", "qwen3_next"):
        src = sources[name]
        convert(src, tmp_path / f"{name}-vllm", to="vllm", tp=2, pp=2)
        assert paths_taken[-1] is True
        convert(tmp_path / f"{name}-vllm", tmp_path / f"{name}-hf", to="hf")
        assert paths_taken[-1] is True  # a vLLM source on the copy path too (open_raw_source's VllmRawSource)
        want = {k: v for f in src.glob("*.safetensors") for k, v in load_file(str(f)).items()}
        got = {k: v for f in (tmp_path / f"{name}-hf").glob("*.safetensors") for k, v in load_file(str(f)).items()}
        if name == "qwen3_next":  # the MTP block is not in vLLM's state
            want = {k: v for k, v in want.items() if not k.startswith("mtp.")}
        assert got.keys() == want.keys()
        for k, t in want.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), f"{name}: {k}"


def test_bad_layouts_refused_in_one_line_with_nothing_written(sources, tmp_path, capsys, monkeypatch):
    """tp not dividing the heads, pp past the layers, tp past a hybrid's key heads: the torch path's message,
    exit 1, nothing at the destination."""
    for name, extra in (("qwen2", ["--tp", "3"]), ("qwen2", ["--pp", "5"]), ("qwen3_5", ["--tp", "4"])):
        messages = []
        for copy in ("1", "0"):
            monkeypatch.setenv("PMZ_COPY_PATH", copy)
            dst = tmp_path / f"bad-{name}-{copy}"
            assert pmz(["convert", str(sources[name]), str(dst), "--to", "vllm", *extra, "--quiet"]) == 1
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and "vLLM layout" in err, err
            assert not dst.exists() and not list(tmp_path.glob(f".bad-{name}-{copy}*"))
            messages.append(err)
        assert messages[0] == messages[1]


def test_a_dtype_change_takes_the_torch_path(sources, tmp_path, monkeypatch):
    import converters.copy_path.vllm as cv

    monkeypatch.setattr(cv, "write_vllm_by_copy", lambda *a, **k: pytest.fail("copy path used"))
    convert(sources["qwen2"], tmp_path / "bf16", to="vllm", tp=2, dtype="bf16")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "model-rank-0-part-0.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


# ------------------------------------------------------------------ vLLM sharded_state as a copy-path source


def _vllm_source(path: Path):
    """``converters/copy_path/vllm_source.VllmRawSource`` of a vLLM directory (as ``open_raw_source`` opens it)."""
    from converters.copy_path.vllm_source import VllmRawSource
    from converters.formats import open_checkpoint

    return VllmRawSource(open_checkpoint("vllm", str(path)))


@pytest.fixture(scope="module")
def vllm_dirs(sources, tmp_path_factory) -> dict[str, Path]:
    """vLLM directories written by the torch path (the reference writer) from the HF sources."""
    root = tmp_path_factory.mktemp("vllm_dirs")
    out = {}
    for name, tp, pp in (("qwen2", 4, 2), ("llama", 2, 1), ("qwen2_bf16", 2, 2), ("qwen2moe", 2, 2),
                         ("qwen3_5", 2, 1), ("qwen3_next", 2, 2), ("condgen", 2, 2),
                         ("vl", 2, 2)):
        _torch_path(sources[name], root / name, to="vllm", tp=tp, pp=pp, workers=1)
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", ["qwen2", "llama", "qwen2_bf16", "qwen2moe", "qwen3_5", "qwen3_next", "condgen",
                                  "vl"])
def test_vllm_source_gives_the_torch_paths_hf_and_vllm_files(vllm_dirs, tmp_path, name):
    """A vLLM directory read by the copy path (``VllmRawSource``) into HF (``write_hf_by_copy``) and into vLLM at
    another layout (``write_vllm_by_copy``): the files the torch path (``VllmReader``) writes, byte for byte."""
    from converters.copy_path.hf import write_hf_by_copy
    from converters.copy_path.vllm import plan_vllm_target, write_vllm_by_copy

    src = vllm_dirs[name]
    source = _vllm_source(src)
    slow, fast = tmp_path / "hf-torch", tmp_path / "hf-copy"
    _torch_path(src, slow, to="hf", workers=1)
    fast.mkdir()
    write_hf_by_copy(source, str(fast), max_shard_bytes=5 << 30, workers=2, progress=False)
    assert_same_files(slow, fast)
    slow, fast = tmp_path / "vllm-torch", tmp_path / "vllm-copy"
    _torch_path(src, slow, to="vllm", tp=1, pp=1, workers=1)
    fast.mkdir()
    write_vllm_by_copy(source, plan_vllm_target(source, tp=1, pp=1), str(fast), max_shard_bytes=5 << 30, workers=2,
                       progress=False, files_from=None)
    assert_same_files(slow, fast)


def test_vllm_source_to_megatron(vllm_dirs, tmp_path):
    """vLLM -> Megatron legacy on the copy path: the torch path's rank files, tensor for tensor."""
    from converters.copy_path.megatron import plan_copy_target, write_megatron_by_copy
    from tests.test_copy_targets import _same_rank_file, _tree

    source = _vllm_source(vllm_dirs["qwen2"])
    slow, fast = tmp_path / "torch", tmp_path / "copy"
    _torch_path(vllm_dirs["qwen2"], slow, to="megatron", tp=2, pp=2, workers=1)
    fast.mkdir()
    target = plan_copy_target(source, fmt="megatron", tp=2, pp=2, vpp=1, divisible_by=128)
    write_megatron_by_copy(source, target, str(fast), workers=2, progress=False)
    assert _tree(fast) == _tree(slow)
    for rel in _tree(slow):
        if rel.name == "model_optim_rng.pt":
            _same_rank_file(slow / rel, fast / rel)
        else:
            assert (fast / rel).read_bytes() == (slow / rel).read_bytes(), rel


def test_vllm_source_of_a_width_zero_shared_expert(sources, tmp_path):
    """Qwen2-MoE whose shared expert has width 0 (vLLM builds only its gate): read back on the copy path into the
    source's tensors bitwise, the empty shared-expert tensors included."""
    from safetensors.torch import load_file

    from converters.copy_path.hf import write_hf_by_copy

    src = sources["qwen2moe_plain"]
    convert(src, tmp_path / "vllm", to="vllm", tp=2, pp=2)
    out = tmp_path / "hf"
    out.mkdir()
    write_hf_by_copy(_vllm_source(tmp_path / "vllm"), str(out), max_shard_bytes=5 << 30, workers=2, progress=False)
    want = {k: v for f in src.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == want.keys() and any(t.numel() == 0 for t in got.values())
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k


def test_vllm_source_notes_a_declared_mtp_block_as_the_torch_path(vllm_dirs, capfd):
    from converters.torch_path.vllm import VllmReader

    VllmReader(str(vllm_dirs["qwen3_5"]))
    slow = capfd.readouterr().err
    _vllm_source(vllm_dirs["qwen3_5"])
    fast = capfd.readouterr().err
    assert "declares an MTP block (mtp_num_hidden_layers=1)" in fast and fast == slow
