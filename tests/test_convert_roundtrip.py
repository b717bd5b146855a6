"""HF <-> Megatron round trips on random tiny shapes, checked against transformers' own files.

The reference is always what transformers wrote (``save_pretrained``) read back with
``safetensors.torch.load_file``, torch's own ``torch.distributed.checkpoint`` reader for torch_dist
files and plain ``torch.load`` for legacy rank files; converters only produce the outputs.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

from converters import convert
from tests.cases import _case_configs, write_hf_model

SUPPRESS = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]


def load_hf_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, read by safetensors itself (all *.safetensors files)."""
    files = sorted(Path(path).glob("*.safetensors"))
    assert files, f"no safetensors in {path}"
    out: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(str(f))
        assert not (out.keys() & part.keys()), f"tensor stored twice in {path}"
        out.update(part)
    return out


def assert_bitwise(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str) -> None:
    assert set(expected) == set(actual), (f"{what}: key sets differ; missing {sorted(set(expected) - set(actual))}, "
                                          f"extra {sorted(set(actual) - set(expected))}")
    for name, ref in expected.items():
        got = actual[name]
        assert got.dtype == ref.dtype, f"{what}: {name} dtype {got.dtype} != {ref.dtype}"
        assert got.shape == ref.shape, f"{what}: {name} shape {tuple(got.shape)} != {tuple(ref.shape)}"
        assert torch.equal(got, ref), f"{what}: {name} differs (max abs {(got.double() - ref.double()).abs().max()})"


# ---------------------------------------------------------------------------------------------- shapes


@st.composite
def model_configs(draw):
    from transformers import LlamaConfig, Qwen2Config

    arch = draw(st.sampled_from(["llama", "qwen2"]))
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2]))
    common = dict(
        vocab_size=draw(st.integers(17, 300)),
        hidden_size=draw(st.sampled_from([16, 24, 32])),
        intermediate_size=draw(st.sampled_from([8, 12, 16, 24, 40])),
        num_hidden_layers=draw(st.sampled_from([2, 4])),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=draw(st.sampled_from([4, 8, 12])),
        max_position_embeddings=32,
        tie_word_embeddings=draw(st.booleans()),
        rms_norm_eps=1e-6,
    )
    if arch == "qwen2":
        return Qwen2Config(**common)
    bias = draw(st.booleans())  # Megatron has one switch for o_proj and MLP biases: both or neither
    return LlamaConfig(**common, attention_bias=bias, mlp_bias=bias)


def layout_options(cfg) -> list[tuple[int, int, int]]:
    """(tp, pp, vpp) valid for ``cfg`` by Megatron's rules (written out here, not imported)."""
    heads, kv, ffn, layers = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                              cfg.num_hidden_layers)
    tps = [t for t in (1, 2, 4) if heads % t == 0 and ffn % t == 0 and (kv % t == 0 or t % kv == 0)]
    return [(t, p, v) for t in tps for p in (1, 2, 4) for v in (1, 2) if layers % (p * v) == 0 and (v == 1 or p > 1)]


def padded_vocab(vocab: int, tp: int, divisible_by: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def check_legacy_structure(path: Path, cfg, tp: int, pp: int, vpp: int, divisible_by: int) -> None:
    """Rank folders, chunks and the embedding shard as Megatron-LM lays them out, read with plain torch."""
    tracker = (path / "latest_checkpointed_iteration.txt").read_text().strip()
    it_dir = path / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    expected = {f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp)}
    assert {d.name for d in it_dir.iterdir() if d.is_dir()} == expected
    per_chunk = cfg.num_hidden_layers // (pp * vpp)
    first = it_dir / ("mp_rank_00_000" if pp > 1 else "mp_rank_00") / "model_optim_rng.pt"
    data = torch.load(first, map_location="cpu", weights_only=False)
    chunks = ["model"] if vpp == 1 else [f"model{v}" for v in range(vpp)]
    assert [k for k in data if k.startswith("model")] == chunks
    for chunk in chunks:
        local = {int(m.group(1)) for k in data[chunk] if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
        assert local == set(range(per_chunk)), f"{chunk} holds local layers {sorted(local)}"
    emb = data[chunks[0]]["embedding.word_embeddings.weight"]
    assert tuple(emb.shape) == (padded_vocab(cfg.vocab_size, tp, divisible_by) // tp, cfg.hidden_size)
    assert data["args"].tensor_model_parallel_size == tp and data["args"].pipeline_model_parallel_size == pp


def check_dist_embedding(path: Path, original: dict[str, torch.Tensor], cfg, tp: int, divisible_by: int) -> None:
    """torch's own DCP reader loads the padded embedding: real rows equal HF's, padding rows zero."""
    import warnings

    import torch.distributed.checkpoint as dcp

    tracker = (path / "latest_checkpointed_iteration.txt").read_text().strip()
    it_dir = path / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    reader = dcp.FileSystemReader(str(it_dir))
    md = reader.read_metadata()
    key = "embedding.word_embeddings.weight"
    size = md.state_dict_metadata[key].size
    assert tuple(size) == (padded_vocab(cfg.vocab_size, tp, divisible_by), cfg.hidden_size)
    sd = {key: torch.full(tuple(size), float("nan"))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=reader)
    assert torch.equal(sd[key][: cfg.vocab_size], original["model.embed_tokens.weight"])
    assert torch.count_nonzero(sd[key][cfg.vocab_size:]) == 0


# ---------------------------------------------------------------------------------------------- properties


@settings(max_examples=15, deadline=None, derandomize=True, database=None, suppress_health_check=SUPPRESS)
@given(data=st.data())
def test_hf_megatron_hf_and_megatron_reshard_are_bitwise(data):
    cfg = data.draw(model_configs(), label="config")
    fmt_a = data.draw(st.sampled_from(["megatron", "megatron-dist"]), label="first format")
    fmt_b = "megatron-dist" if fmt_a == "megatron" else "megatron"  # legacy <-> torch_dist
    tp_a, pp_a, vpp_a = data.draw(st.sampled_from(layout_options(cfg)), label="first layout")
    others = [o for o in layout_options(cfg) if o != (tp_a, pp_a, vpp_a)] or [(tp_a, pp_a, vpp_a)]
    tp_b, pp_b, vpp_b = data.draw(st.sampled_from(others), label="second layout")  # a different TP/PP when any
    div = data.draw(st.sampled_from([1, 8, 128]), label="make_vocab_size_divisible_by")
    seed = data.draw(st.integers(0, 1000), label="seed")
    with tempfile.TemporaryDirectory(prefix="pmz-rt-") as tmp:
        root = Path(tmp)
        src = write_hf_model(root, "src", cfg, seed=seed)
        original = load_hf_dir(src)

        a = root / "a"
        convert(src, a, to=fmt_a, tp=tp_a, pp=pp_a, vpp=vpp_a, make_vocab_size_divisible_by=div, workers=1)
        if fmt_a == "megatron":
            check_legacy_structure(a, cfg, tp_a, pp_a, vpp_a, div)
        else:
            check_dist_embedding(a, original, cfg, tp_a, div)
        convert(a, root / "a_hf", to="hf", workers=2)
        assert_bitwise(original, load_hf_dir(root / "a_hf"), f"HF -> {fmt_a} tp{tp_a} pp{pp_a} vpp{vpp_a} -> HF")

        b = root / "b"
        convert(a, b, to=fmt_b, tp=tp_b, pp=pp_b, vpp=vpp_b, make_vocab_size_divisible_by=div, workers=2)
        if fmt_b == "megatron":
            check_legacy_structure(b, cfg, tp_b, pp_b, vpp_b, div)
        else:
            check_dist_embedding(b, original, cfg, tp_b, div)
        convert(b, root / "b_hf", to="hf", workers=1)
        assert_bitwise(original, load_hf_dir(root / "b_hf"),
                       f"HF -> {fmt_a} tp{tp_a} pp{pp_a} vpp{vpp_a} -> {fmt_b} tp{tp_b} pp{pp_b} vpp{vpp_b} -> HF")


# ---------------------------------------------------------------------------------------------- fixed cases


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory):
    """qwen2 as tests/cases.py's qwen2_untied (vocab 101 not divisible by TP, GQA) with 4 layers (room for VPP)."""
    from transformers import Qwen2Config

    base = _case_configs()["qwen2_untied"].to_dict()
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps")
    cfg = Qwen2Config(**{k: base[k] for k in keep}, num_hidden_layers=4)
    return write_hf_model(tmp_path_factory.mktemp("rt_src"), "qwen2_untied4", cfg, seed=7)


@pytest.mark.parametrize("fmt", ["megatron", "megatron-dist"])
def test_bf16_output_equals_transformers_cast(hf_src, tmp_path, fmt):
    from transformers import AutoModelForCausalLM

    original = load_hf_dir(hf_src)
    assert all(t.dtype == torch.float32 for t in original.values())
    mid, out = tmp_path / "mid", tmp_path / "out"
    convert(hf_src, mid, to=fmt, tp=2, pp=2, dtype="bf16", workers=2)
    convert(mid, out, to="hf", workers=1)  # default: the source's dtype, bf16
    expected = {k: v.to(torch.bfloat16) for k, v in original.items()}
    assert_bitwise(expected, load_hf_dir(out), f"HF fp32 -> {fmt} bf16 -> HF")

    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16", config
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    state = model.state_dict()
    for name, ref in expected.items():
        assert torch.equal(state[name], ref), name


def test_bf16_megatron_rank_files_hold_bf16(hf_src, tmp_path):
    convert(hf_src, tmp_path / "mid", to="megatron", tp=2, dtype="bf16", workers=1)
    for f in (tmp_path / "mid").rglob("model_optim_rng.pt"):
        data = torch.load(f, map_location="cpu", weights_only=False)
        dtypes = {v.dtype for v in data["model"].values() if isinstance(v, torch.Tensor)}
        assert dtypes == {torch.bfloat16}, (f, dtypes)


def _logits(path, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("source_fmt", ["hf", "megatron"])
def test_sharded_hf_output(hf_src, tmp_path, source_fmt):
    limit = 20_000
    src = hf_src
    if source_fmt == "megatron":
        src = tmp_path / "mid"
        convert(hf_src, src, to="megatron", tp=2, pp=2, workers=1)
    out = tmp_path / "out"
    convert(src, out, to="hf", max_shard_size="20KB", workers=2)

    files = sorted(out.glob("*.safetensors"))
    n = len(files)
    assert n >= 3, [f.name for f in files]
    assert [f.name for f in files] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()

    index = json.loads((out / "model.safetensors.index.json").read_text())
    original = load_hf_dir(hf_src)
    actual_map, data_bytes = {}, 0
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names = list(sf.keys())
            sizes = [sf.get_tensor(k).numel() * sf.get_tensor(k).element_size() for k in names]
        actual_map.update({k: f.name for k in names})
        data_bytes += sum(sizes)
        if len(names) > 1:  # only a single tensor larger than the limit may make a file exceed it
            assert sum(sizes) <= limit, (f.name, sum(sizes))
    assert index["weight_map"] == actual_map
    assert set(index["weight_map"]) == set(original)
    assert index["metadata"]["total_size"] == data_bytes
    assert_bitwise(original, load_hf_dir(out), "sharded output")

    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(0))
    diff = (_logits(out, ids) - _logits(hf_src, ids)).abs().max().item()
    assert diff <= 1e-6


def test_shard_files_never_exceed_max_shard_size(hf_src, tmp_path):
    """``--max-shard-size`` is documented as the largest safetensors *file*: header included."""
    too_big = []
    for limit in range(6_000, 40_001, 1_750):
        out = tmp_path / f"out_{limit}"
        convert(hf_src, out, to="hf", max_shard_size=limit, workers=1)
        for f in sorted(out.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                n_tensors = len(list(sf.keys()))
            if n_tensors > 1 and f.stat().st_size > limit:
                too_big.append(f"limit {limit}: {f.name} is {f.stat().st_size} bytes ({n_tensors} tensors)")
    assert not too_big, "; ".join(too_big[:5]) + f" ... ({len(too_big)} files over the limit)"


@pytest.mark.parametrize("to,kw", [
    ("hf", dict(max_shard_size="20KB")),
    ("hf", dict()),
    ("megatron", dict(tp=2, pp=2)),
    ("megatron", dict(tp=1, pp=2, vpp=2, dtype="bf16")),
    ("megatron-dist", dict(tp=2, pp=1)),
])
def test_output_bytes_do_not_depend_on_workers(hf_src, tmp_path, to, kw):
    src = tmp_path / "legacy_src"
    convert(hf_src, src, to="megatron", tp=2, workers=1)  # a Megatron source, to convert from too
    for source in (hf_src, src):
        outs = []
        for workers in (1, 2):
            dst = tmp_path / f"{Path(source).name}_{to}_w{workers}"
            convert(source, dst, to=to, workers=workers, **kw)
            outs.append({str(p.relative_to(dst)): p.read_bytes() for p in sorted(dst.rglob("*")) if p.is_file()})
        assert sorted(outs[0]) == sorted(outs[1]), f"workers=1 and workers=2 write different files: " \
                                                   f"{sorted(outs[0])} vs {sorted(outs[1])}"
        different = [name for name in outs[0] if outs[0][name] != outs[1][name]]
        assert not different, f"bytes differ between workers=1 and workers=2: {different}"


def test_hf_config_dir_files_are_copied(hf_src, tmp_path):
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text((Path(hf_src) / "config.json").read_text())
    tok = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 64, "bos_token": "<s>"}
    gen = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_p": 0.9}
    (cfg_dir / "tokenizer_config.json").write_text(json.dumps(tok, indent=1))
    (cfg_dir / "generation_config.json").write_text(json.dumps(gen, indent=3))
    (cfg_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))

    mid = tmp_path / "mid"
    convert(hf_src, mid, to="megatron-dist", tp=2, workers=1)
    out = tmp_path / "out"
    convert(mid, out, to="hf", hf_config=str(cfg_dir), workers=1)
    for name in ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        assert (out / name).read_bytes() == (cfg_dir / name).read_bytes(), name
    assert_bitwise(load_hf_dir(hf_src), load_hf_dir(out), "with --hf-config")

    from transformers import GenerationConfig

    g = GenerationConfig.from_pretrained(str(out))
    assert (g.eos_token_id, g.temperature, g.top_p) == (2, 0.7, 0.9)
