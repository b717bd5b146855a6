"""``pmz convert --quantize fp8`` against independent references.

* HF targets (from an HF directory transformers wrote, a Megatron legacy checkpoint, a Megatron-Bridge
  one): every file equals tests/test_fp8_export.py's own per-block quantization (``ref_quantize``,
  one block at a time in plain torch) of the weights transformers wrote, bitwise; kept tensors are
  transformers' bytes (or their ``--dtype``); config.json's ``quantization_config`` is the format's
  with the kept linear modules found here by name; headers and index read as JSON here. Slabs of one
  block row are forced, so a tensor is quantized in several pieces.
* vLLM targets: ``--to vllm --tp 2 --quantize fp8`` equals ``save_vllm_sharded_state(...,
  quantization="fp8")`` (itself checked against the reference in test_fp8_export.py) file for file,
  tensor for tensor.
* Bad input (a name we do not write, a Megatron target, an FP8 source by config or by tensor dtype,
  a vLLM TP that cuts a block): one line naming the values, the CLI's exit status, nothing written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_fp8_export import CONFIG, KEPT_LINEAR, QUANTIZED, ref_quantize
from tests.test_pmz_newcomer import pmz
from tests.workers_fp8 import aligned_configs, as_bytes, build, fp8_configs, write_model

ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_cli")
    configs = fp8_configs()
    out = {name: Path(write_model(root, name, configs[name], seed=i))
           for i, name in enumerate(("qwen2", "qwen3_moe", "qwen2_5_vl"))}
    out["aligned_qwen2"] = Path(write_model(root / "aligned", "qwen2", aligned_configs()["qwen2"], seed=7))
    return out


@pytest.fixture
def one_block_row_slabs(monkeypatch):
    import converters.torch_path.hf_fp8 as hf_fp8

    monkeypatch.setattr(hf_fp8, "SLAB_BYTES", 1)  # worker processes are forked: they see it too


def _load(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        part = load_file(str(f))
        assert not set(part) & set(out)
        out.update(part)
    return out


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def _headers(directory: Path) -> dict[str, dict]:
    """Each file's safetensors header, read here as the format defines it (8-byte length + JSON)."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        raw = f.read_bytes()
        out[f.name] = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return out


def check_fp8_dir(out: Path, source_dir: Path, kept_dtype: torch.dtype | None = None) -> None:
    """``out`` holds the reference quantization of every linear weight transformers wrote in
    ``source_dir``, the other tensors as written (or cast to ``kept_dtype``), the format's config."""
    source, saved = _load(source_dir), _load(out)
    quantized = sorted(n for n in source if QUANTIZED.search(n))
    assert quantized and set(saved) == set(source) | {n + "_scale_inv" for n in quantized}
    for name, tensor in source.items():
        if name in quantized:
            q, s = ref_quantize(tensor)
            assert _equal(saved[name], q) and _equal(saved[name + "_scale_inv"], s), name
        else:
            assert _equal(saved[name], tensor if kept_dtype is None else tensor.to(kept_dtype)), name
    config = json.loads((out / "config.json").read_text())
    qconfig = dict(config["quantization_config"])
    skip = qconfig.pop("modules_to_not_convert")
    kept = {n.removesuffix(".weight") for n in source if KEPT_LINEAR.search(n)} | {"lm_head"}
    assert qconfig == CONFIG and skip[0] == "lm_head" and sorted(skip) == sorted(kept)
    if kept_dtype is not None:
        assert config["dtype"] == str(kept_dtype).removeprefix("torch.")
    headers = _headers(out)  # every tensor aligned to its element size; the index names every file's tensors
    for head in headers.values():
        for name, meta in head.items():
            if name != "__metadata__":
                assert meta["data_offsets"][0] % ITEMSIZE[meta["dtype"]] == 0, name
    if len(headers) > 1:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == {n: f for f, head in headers.items() for n in head if n != "__metadata__"}


def _ok(*args) -> None:
    res = pmz(*args, "--quiet")
    assert res.returncode == 0, res.stderr
    to = args[args.index('--to') + 1]
    layout = "HF safetensors" if to == "hf" else "vLLM sharded_state"
    assert res.stdout.startswith(f"wrote {to} checkpoint (fp8, {layout}"), res.stdout
    assert res.stdout.strip().endswith(f") to {Path(args[2]).resolve()}"), res.stdout


def test_hf_source_to_hf_fp8(sources, tmp_path, one_block_row_slabs):
    """Partial edge blocks (160 / 200 wide), all-zero blocks, tied embeddings; several files."""
    src = sources["qwen2"]
    _ok("convert", src, tmp_path / "fp8", "--to", "hf", "--quantize", "fp8", "--max-shard-size", "60KB",
        "--workers", "2")
    assert len(list((tmp_path / "fp8").glob("*.safetensors"))) > 1
    check_fp8_dir(tmp_path / "fp8", src)
    # --dtype: the kept tensors' dtype; FP8 is still quantized from the source's fp32
    _ok("convert", src, tmp_path / "bf16", "--to", "hf", "--quantize", "fp8", "--dtype", "bf16")
    check_fp8_dir(tmp_path / "bf16", src, kept_dtype=torch.bfloat16)


def test_odd_sizes_stay_aligned(tmp_path):
    """FP8 tensors of 30 bytes: the fp32 scales and kept tensors must not follow them unaligned."""
    from transformers import Qwen2Config

    from tests.cases import write_hf_model

    config = Qwen2Config(vocab_size=50, hidden_size=6, intermediate_size=5, num_hidden_layers=1, num_attention_heads=3,
                         num_key_value_heads=1, head_dim=2, max_position_embeddings=16, tie_word_embeddings=False)
    src = write_hf_model(tmp_path, "odd", config)
    _ok("convert", src, tmp_path / "fp8", "--to", "hf", "--quantize", "fp8")
    check_fp8_dir(tmp_path / "fp8", src)


def test_megatron_source_to_hf_fp8(sources, tmp_path, one_block_row_slabs):
    """A legacy Megatron checkpoint at TP 2 / PP 2 (row pieces of two shards per tensor)."""
    from converters import convert

    megatron = convert(sources["qwen2"], tmp_path / "mcore", to="megatron", tp=2, pp=2)
    _ok("convert", megatron, tmp_path / "fp8", "--to", "hf", "--quantize", "fp8")
    check_fp8_dir(tmp_path / "fp8", sources["qwen2"])


def test_moe_hf_to_hf_fp8(sources, tmp_path):
    """Qwen3-MoE: every routed expert quantized, the router kept and listed in modules_to_not_convert."""
    _ok("convert", sources["qwen3_moe"], tmp_path / "fp8", "--to", "hf", "--quantize", "fp8")
    check_fp8_dir(tmp_path / "fp8", sources["qwen3_moe"])


def test_vision_language_bridge_to_hf_fp8(sources, tmp_path):
    """Qwen2.5-VL from Megatron-Bridge's layout: the vision blocks quantized, patch embedding and merger kept."""
    from converters import convert

    bridge = convert(sources["qwen2_5_vl"], tmp_path / "bridge", to="megatron-bridge", tp=2)
    _ok("convert", bridge, tmp_path / "fp8", "--to", "hf", "--quantize", "fp8")
    check_fp8_dir(tmp_path / "fp8", sources["qwen2_5_vl"])


def test_vllm_tp2_fp8_equals_save_vllm_sharded_state(sources, tmp_path):
    src = sources["aligned_qwen2"]
    _ok("convert", src, tmp_path / "cli", "--to", "vllm", "--tp", "2", "--quantize", "fp8")
    build("qwen2", str(src)).save_vllm_sharded_state(tmp_path / "model", tp=2, quantization="fp8")
    files = sorted(p.name for p in (tmp_path / "model").glob("*.safetensors"))
    assert files == sorted(p.name for p in (tmp_path / "cli").glob("*.safetensors")) and len(files) == 2
    for name in files:
        ours, theirs = load_file(str(tmp_path / "cli" / name)), load_file(str(tmp_path / "model" / name))
        assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))
        assert any(k.endswith("_scale_inv") for k in ours) and any(k.endswith("attn.k_scale") for k in ours)
        assert [k for k in ours if not _equal(ours[k], theirs[k])] == []
    config, expected = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("cli", "model"))
    assert config["quantization_config"] == expected["quantization_config"]


# ------------------------------------------------------------------------------------------- bad input


def _refused(rc: int, *args, names: tuple[str, ...], copy_path: bool = True) -> None:
    dst = Path(args[2])

    def beside() -> list[str] | None:  # None: the parent does not exist (and must not be created)
        return sorted(p.name for p in dst.parent.iterdir()) if dst.parent.exists() else None

    before = beside()
    res = pmz(*args, "--quiet", copy_path=copy_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == rc and len(lines) == 1 and res.stdout == "", res.stderr
    assert all(n in lines[0] for n in names), (names, lines[0])
    assert not dst.exists() and beside() == before  # no temp dir left, no parent created


def test_bad_quantize_arguments_exit_2(sources, tmp_path):
    from converters.cli import QUANTIZATIONS
    from models.common.export import fp8

    assert tuple(QUANTIZATIONS) == fp8.QUANTIZATIONS
    src = sources["qwen2"]
    _refused(2, "convert", src, tmp_path / "a", "--to", "hf", "--quantize", "fp4", names=("--quantize", "'fp4'"))
    for target in ("megatron", "megatron-dist", "megatron-bridge"):
        _refused(2, "convert", src, tmp_path / "b", "--to", target, "--quantize", "fp8",
                 names=("--quantize fp8", f"--to {target}"))


def test_vllm_tp_cutting_a_block_is_refused(sources, tmp_path):
    src = sources["qwen2"]  # 160 query rows: 80 per rank at TP 2; a 200-row gate packed before up at any TP
    _refused(1, "convert", src, tmp_path / "v2", "--to", "vllm", "--tp", "2", "--quantize", "fp8",
             names=("tp=2", "q_proj.weight: 80 rows per rank (of 160)", "128"))
    _refused(1, "convert", src, tmp_path / "v1", "--to", "vllm", "--quantize", "fp8",
             names=("tp=1", "gate_proj.weight: 200 rows packed before"))


def test_fp8_sources_are_refused(sources, tmp_path):
    """By quantization_config (our own FP8 HF and vLLM outputs), and by F8 tensors under a plain
    config on both paths; inspect and verify say the same."""
    hf8, vllm8 = tmp_path / "hf8", tmp_path / "vllm8"
    _ok("convert", sources["aligned_qwen2"], hf8, "--to", "hf", "--quantize", "fp8")
    _ok("convert", sources["aligned_qwen2"], vllm8, "--to", "vllm", "--quantize", "fp8")
    out = tmp_path / "out"
    for source in (hf8, vllm8):
        for extra in ((), ("--quantize", "fp8")):
            _refused(1, "convert", source, out / "x", "--to", "hf", *extra,
                     names=(str(source / "config.json"), "quantization_config", "'fp8'"))
    res = pmz("inspect", vllm8)  # inspect and verify read FP8 back from HF directories only
    assert res.returncode == 1 and len(res.stderr.splitlines()) == 1 and "only from an HF directory" in res.stderr
    plain = tmp_path / "plain-config"
    shutil.copytree(sources["aligned_qwen2"], plain)
    tensors = load_file(str(plain / "model.safetensors"))
    key = "model.layers.1.mlp.up_proj.weight"
    tensors[key] = tensors[key].to(torch.float8_e4m3fn)
    save_file(tensors, str(plain / "model.safetensors"), metadata={"format": "pt"})
    for copy_path in (True, False):
        _refused(1, "convert", plain, out / "y", "--to", "hf", names=(key, "F8_E4M3"), copy_path=copy_path)


def test_inspect_and_verify_read_fp8_back(sources, tmp_path):
    """inspect describes an FP8 HF directory; verify against its source passes, and fails once one
    element is moved to the next e4m3 value (no longer the nearest under its block's scale)."""
    src, fp8_dir = sources["qwen2"], tmp_path / "fp8"
    _ok("convert", src, fp8_dir, "--to", "hf", "--quantize", "fp8", "--max-shard-size", "60KB")
    quantized = [n for n in _load(src) if QUANTIZED.search(n)]
    res = pmz("inspect", fp8_dir)
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if x.startswith("quantization"))
    assert f"{len(quantized)} tensors as float8_e4m3fn" in line and "128x128" in line, line
    res = pmz("verify", src, fp8_dir)
    assert res.returncode == 0 and f"{len(quantized)} FP8 tensors compared dequantized" in res.stdout, res.stdout
    res = pmz("verify", src, fp8_dir, "--logits")
    assert res.returncode == 1 and "--logits" in res.stderr and len(res.stderr.splitlines()) == 1
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.down_proj.weight"
    tensors = load_file(str(bad / index[name]))
    bits = tensors[name].view(torch.uint8).flatten()
    magnitude = bits & 0x7F
    i = int(torch.nonzero((magnitude > 0x40) & (magnitude < 0x70))[0])  # a normal value well inside the range
    bits[i] += 1  # the next e4m3 magnitude, same sign
    save_file(tensors, str(bad / index[name]), metadata={"format": "pt"})
    res = pmz("verify", src, bad)
    assert res.returncode == 1 and name in res.stderr and "1 element(s) not the nearest e4m3" in res.stderr, res.stderr
