"""``pmz`` tells the truth (issue 34): ``verify`` never passes garbage FP8, no conversion narrows a
value silently, ``inspect`` says what the files hold, one reader gives one message naming the file,
written files take the umask, and the newcomer's messages speak of checkpoints.

Every refusal here: exit 1 (verify: non-zero), one line on stderr naming the file and the tensor,
nothing written (the destination and no temp dir beside it), the source untouched (hashed before
and after). The property test at the end holds ``pmz verify`` against an oracle written here (a
brute-force nearest-e4m3 search over all 254 finite e4m3 values), not against the verifier's own
``rounding_bound``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from converters import convert
from converters.verify import verify
from models.common.errors import CheckpointError
from tests.cases import snapshot
from tests.test_pmz_newcomer import pmz
from tests.workers_fp8 import write_model

LAYER0_Q = "model.layers.0.self_attn.q_proj.weight"
DOWN1 = "model.layers.1.mlp.down_proj.weight"


def _config():
    from transformers import Qwen2Config

    # intermediate 160: gate/up have two block rows, down_proj two block columns (one partial)
    return Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("truth")
    src = Path(write_model(root, "src", _config(), seed=3))
    convert(src, root / "fp8", to="hf", quantization="fp8", workers=1)
    convert(src, root / "vllm2", to="vllm", tp=2, workers=1)
    assert sorted(p.name for p in (root / "fp8").glob("*.safetensors")) == ["model.safetensors"]
    return {"root": root, "src": src, "fp8": root / "fp8", "vllm2": root / "vllm2"}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(path: Path, fn) -> None:
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _refused(*args, names: tuple[str, ...], sources: tuple[Path, ...], copy_path: bool = True,
             dst: Path | None = None) -> str:
    """``pmz ARGS``: exit 1, one stderr line holding every name, nothing on stdout, the sources
    byte for byte as before, ``dst`` (if any) not created and nothing left beside it."""
    before = {s: snapshot(s) for s in sources}
    beside = sorted(p.name for p in dst.parent.iterdir()) if dst is not None else None
    res = pmz(*args, *(("--quiet",) if args[0] != "inspect" else ()), copy_path=copy_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert all(n in lines[0] for n in names), (names, lines[0])
    if args[0] != "verify":
        assert res.stdout == "", res.stdout
    assert {s: snapshot(s) for s in sources} == before
    if dst is not None:
        assert not dst.exists() and sorted(p.name for p in dst.parent.iterdir()) == beside
    return lines[0]


# ------------------------------------------------------------------------------------ 1. garbage FP8

SCALE_DAMAGE = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf, "zero": 0.0, "negative": -0.01}


@pytest.mark.parametrize("damage", [*SCALE_DAMAGE, "f8-nan-bytes"])
def test_verify_and_inspect_refuse_garbage_fp8(dirs, tmp_path, damage):
    """Each of these passed ``pmz verify`` with "OK: 27 tensors match" before (negative was caught
    as a mismatch only): now the reader refuses, naming the file and the tensor."""
    bad = _copy(dirs["fp8"], tmp_path / "bad")
    if damage == "f8-nan-bytes":
        def fn(t):
            t[LAYER0_Q] = torch.full(t[LAYER0_Q].shape, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
        names = (str(bad / "model.safetensors"), LAYER0_Q, "NaN encoding")
    else:
        def fn(t):
            t[LAYER0_Q + "_scale_inv"][0, 0] = SCALE_DAMAGE[damage]
        names = (str(bad / "model.safetensors"), LAYER0_Q + "_scale_inv", "positive finite")
    _edit(bad / "model.safetensors", fn)
    _refused("verify", dirs["src"], bad, names=names, sources=(dirs["src"], bad))
    _refused("verify", bad, dirs["src"], names=names, sources=(dirs["src"], bad))
    if damage != "f8-nan-bytes":  # inspect reads the scales (small), not the weights
        _refused("inspect", bad, names=names, sources=(bad,))


def test_verify_fails_nan_and_inf_in_unquantized_tensors(dirs, tmp_path):
    """NaN or inf in a kept tensor (or an unquantized side) is a mismatch, whatever --atol says;
    an infinite tolerance is refused as an argument."""
    for value in (math.nan, math.inf):
        bad = _copy(dirs["src"], tmp_path / f"bad-{value}")
        _edit(bad / "model.safetensors", lambda t, v=value: t["model.norm.weight"].__setitem__(3, v))
        res = pmz("verify", dirs["src"], bad, "--atol", "1e30", "--quiet")
        assert res.returncode == 1 and "model.norm.weight" in res.stderr and "non-finite" in res.stderr, res
        assert "OK" not in res.stdout
    res = pmz("verify", dirs["src"], dirs["src"], "--atol", "inf")
    assert res.returncode == 2 and "finite" in res.stderr


def test_report_cannot_say_ok_with_a_non_finite_figure():
    from converters.verify import VerifyReport, _diffs, fp8_elements_off

    report = VerifyReport(rows=[("a", 0.0, 0.0), ("b", math.nan, math.nan)])
    assert not report.ok and report.worst()[0] == "b"
    assert not VerifyReport(rows=[("a", math.inf, 1.0)]).ok
    assert not VerifyReport(rows=[("a", 0.0, 0.0)], logits_diff=math.nan).ok
    assert VerifyReport(rows=[("a", 0.0, 0.0)]).ok
    assert math.isnan(_diffs(torch.tensor([1.0, math.nan]), torch.tensor([1.0, 2.0]))[0])
    assert _diffs(torch.tensor([0.5]), torch.zeros(1)) == (0.5, 1.0)  # relative to the larger side: finite
    w = torch.randn(4, 4)
    for scale in (math.nan, math.inf, 0.0, -1.0):  # a bound that is not finite (or is NaN) never passes
        assert fp8_elements_off(w, w, torch.full((4, 4), scale)) == 16


# ----------------------------------------------------------------------------------- 2. mixed dtypes

@pytest.mark.parametrize("copy_path", [True, False])
def test_mixed_dtype_vllm_ranks_are_refused(dirs, tmp_path, copy_path):
    mixed = _copy(dirs["vllm2"], tmp_path / "mixed")
    r0, r1 = mixed / "model-rank-0-part-0.safetensors", mixed / "model-rank-1-part-0.safetensors"
    _edit(r0, lambda t: t.update({k: v.bfloat16() for k, v in t.items() if ".attn._" not in k}))
    _edit(r1, lambda t: t.update({k: v.float() for k, v in t.items()}))
    out = tmp_path / "out"
    out.mkdir()
    for args in (("--to", "hf"), ("--to", "vllm", "--tp", "1"), ("--to", "megatron")):
        _refused("convert", mixed, out / "x", *args, names=(str(r0), str(r1), "BF16", "F32"), sources=(mixed,),
                 copy_path=copy_path, dst=out / "x")


@pytest.mark.parametrize("copy_path", [True, False])
def test_mixed_dtype_hf_files_are_refused_without_dtype(dirs, tmp_path, copy_path):
    """Tensors of one HF directory in two dtypes: narrowing some to the other was silent; now one
    line naming a tensor and file of each dtype and the --dtype that keeps every value, which works."""
    mixed = _copy(dirs["src"], tmp_path / "mixed")
    _edit(mixed / "model.safetensors",
          lambda t: t.update({k: v.bfloat16() for k, v in t.items() if k.startswith("model.layers.1.")}))
    out = tmp_path / "out"
    out.mkdir()
    for args in (("--to", "hf"), ("--to", "hf", "--quantize", "fp8"), ("--to", "vllm"), ("--to", "megatron")):
        _refused("convert", mixed, out / "x", *args, names=(str(mixed / "model.safetensors"), "BF16", "F32",
                                                             "--dtype fp32"),
                 sources=(mixed,), copy_path=copy_path, dst=out / "x")
    res = pmz("convert", mixed, out / "kept", "--to", "hf", "--dtype", "fp32", "--quiet", copy_path=copy_path)
    assert res.returncode == 0, res.stderr
    want, got = load_file(str(mixed / "model.safetensors")), load_file(str(out / "kept" / "model.safetensors"))
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k].float()) for k in want)
    info = pmz("inspect", mixed)
    assert info.returncode == 0 and "mixed" in info.stdout and "BF16" in info.stdout, info


# --------------------------------------------------------------------- 3. plain tensors, FP8 config

def test_inspect_refuses_plain_weights_under_an_fp8_config(dirs, tmp_path):
    plain = _copy(dirs["src"], tmp_path / "plain")
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (plain / "config.json").write_text(json.dumps(config))
    names = (str(plain / "config.json"), "no tensor is stored as F8_E4M3", "F32")
    _refused("inspect", plain, names=names, sources=(plain,))
    _refused("verify", dirs["src"], plain, names=names, sources=(plain, dirs["src"]))
    out = tmp_path / "out"
    out.mkdir()
    _refused("convert", plain, out / "x", "--to", "hf", names=(str(plain / "config.json"), "quantization_config"),
             sources=(plain,), dst=out / "x")


# -------------------------------------------------------------------------------------- 4. messages

def test_f8_tensors_without_config_one_message_everywhere(dirs, tmp_path):
    """Convert said "14 unexpected tensor(s): ..._scale_inv"; inspect/verify "stored as F8_E4M3".
    Now all of them give the reader's one line, naming the file."""
    f8 = _copy(dirs["fp8"], tmp_path / "f8")
    config = json.loads((f8 / "config.json").read_text())
    del config["quantization_config"]
    (f8 / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    out.mkdir()
    names = (str(f8 / "model.safetensors"), "is stored as F8_E4M3", "FP8-quantized checkpoint")
    lines = {_refused("convert", f8, out / "x", "--to", "hf", names=names, sources=(f8,), copy_path=cp,
                      dst=out / "x") for cp in (True, False)}
    lines.add(_refused("convert", f8, out / "x", "--to", "megatron", names=names, sources=(f8,), dst=out / "x"))
    lines.add(_refused("inspect", f8, names=names, sources=(f8,)))
    lines.add(_refused("verify", dirs["src"], f8, names=names, sources=(f8,)))
    assert len({line.split("error: ", 1)[1] for line in lines}) == 1, lines


def test_fp8_vllm_ranks_without_config_named_as_fp8(dirs, tmp_path):
    vllm8 = tmp_path / "vllm8"
    src = dirs["root"] / "aligned"
    if not src.exists():
        from tests.workers_fp8 import aligned_configs

        write_model(dirs["root"], "aligned", aligned_configs()["qwen2"], seed=1)
    convert(src, vllm8, to="vllm", quantization="fp8", workers=1)
    config = json.loads((vllm8 / "config.json").read_text())
    del config["quantization_config"]
    (vllm8 / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    out.mkdir()
    _refused("convert", vllm8, out / "x", "--to", "hf", dst=out / "x", sources=(vllm8,),
             names=(str(vllm8 / "model-rank-0-part-0.safetensors"), "stored as F8_E4M3"))


def test_stray_vllm_rank_file_is_named(dirs, tmp_path):
    stray = _copy(dirs["vllm2"], tmp_path / "stray")
    shutil.copyfile(stray / "model-rank-1-part-0.safetensors", stray / "model-rank-2-part-0.safetensors")
    out = tmp_path / "out"
    out.mkdir()
    for cp in (True, False):
        _refused("convert", stray, out / "x", "--to", "hf", copy_path=cp, dst=out / "x", sources=(stray,),
                 names=(str(stray / "model-rank-2-part-0.safetensors"), "tp=2", "stray"))
    _refused("inspect", stray, sources=(stray,), names=(str(stray / "model-rank-2-part-0.safetensors"),))


# ------------------------------------------------------------------------------------ 5. file modes

@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_take_the_umask(dirs, tmp_path, umask):
    """safetensors' save_file left 0600 files (vLLM ranks, live-export shards) beside 0644 configs;
    copied config/tokenizer files kept the source's mode. Every output now: 0666 & ~umask (files),
    0777 & ~umask (directories)."""
    from models.common.hf_files import save_safetensors

    previous = os.umask(umask)
    try:
        outs = []
        for name, args, cp in [("hf", ("--to", "hf"), True), ("hf-bf16", ("--to", "hf", "--dtype", "bf16"), False),
                               ("fp8", ("--to", "hf", "--quantize", "fp8"), False),
                               ("vllm", ("--to", "vllm", "--tp", "2"), False),
                               ("meg", ("--to", "megatron", "--tp", "2"), True),
                               ("dist", ("--to", "megatron-dist"), False)]:
            res = pmz("convert", dirs["src"], tmp_path / name, *args, "--quiet", copy_path=cp)
            assert res.returncode == 0, res.stderr
            outs.append(tmp_path / name)
        save_safetensors({"x": torch.zeros(2)}, tmp_path / "direct.safetensors")
    finally:
        os.umask(previous)
    modes = {}
    for out in outs:
        for p in [out, *out.rglob("*")]:
            modes[p] = p.stat().st_mode & 0o777
    modes[tmp_path / "direct.safetensors"] = (tmp_path / "direct.safetensors").stat().st_mode & 0o777
    wrong = {str(p): oct(m) for p, m in modes.items() if m != (0o777 if p.is_dir() else 0o666) & ~umask}
    assert not wrong, wrong
    assert any(str(p).endswith("model-rank-1-part-0.safetensors") for p in modes)


# ------------------------------------------------------------------------------- 6. newcomer lines

def test_layout_errors_speak_of_checkpoints(dirs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for cp in (True, False):
        line = _refused("convert", dirs["src"], out / "x", "--to", "megatron", "--tp", "3", copy_path=cp,
                        dst=out / "x", sources=(dirs["src"],), names=("Megatron legacy torch", "tp=3",
                                                                       "num_attention_heads=4"))
        assert "sp=" not in line


def test_wrote_line_names_the_layout(dirs, tmp_path):
    megatron = "(Megatron legacy torch, tp=2 pp=2 vpp=1 ep=1)"
    for args, want in ((("--to", "megatron", "--tp", "2", "--pp", "2"), megatron),
                       (("--to", "megatron-dist", "--tp", "2"), "(megatron-core torch_dist, tp=2 pp=1 vpp=1 ep=1)"),
                       (("--to", "vllm", "--tp", "2"), "(vLLM sharded_state, tp=2 pp=1)"),
                       (("--to", "hf", "--max-shard-size", "20KB"), "(HF safetensors, ")):
        dst = tmp_path / args[1]
        res = pmz("convert", dirs["src"], dst, *args, "--quiet")
        assert res.returncode == 0 and res.stdout.startswith(f"wrote {args[1]} checkpoint {want}"), res.stdout
    res = pmz("convert", tmp_path / "megatron", tmp_path / "back", "--to", "hf", "--quiet")
    assert res.stdout == f"wrote hf checkpoint (HF safetensors, 1 file) to {(tmp_path / 'back').resolve()}\n"


@pytest.fixture(scope="module")
def all_moe(tmp_path_factory) -> Path:
    from transformers import Qwen3MoeConfig

    root = tmp_path_factory.mktemp("all_moe")
    return Path(write_model(root, "moe", Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=128, moe_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=32, tie_word_embeddings=False), seed=2))


def test_inspect_all_moe_shows_expert_ffn(all_moe):
    res = pmz("inspect", all_moe)
    model = next(line for line in res.stdout.splitlines() if line.startswith("model "))
    assert res.returncode == 0 and "expert ffn 48" in model and "ffn 128" not in model, model


def test_verify_names_differing_config_fields(dirs, all_moe):
    res = pmz("verify", dirs["src"], all_moe, "--quiet")
    line = res.stderr.strip()
    assert res.returncode == 1 and len(line.splitlines()) == 1, res.stderr
    assert "MoeConfig(" not in line and "moe none (dense) vs 4 experts x ffn 48, top-2" in line, line


# ------------------------------------------------------------------------- 7. the verify property

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # 254 finite + 2 NaN


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return 8 + n, json.loads(raw[8:8 + n])


@pytest.fixture(scope="module")
def fp8_case(dirs) -> dict:
    """One working copy of the FP8 directory, patched in place and restored by each example."""
    work = _copy(dirs["fp8"], dirs["root"] / "fp8-work")
    base, header = _header(work / "model.safetensors")
    quantized = sorted(n for n, e in header.items() if n != "__metadata__" and e["dtype"] == "F8_E4M3")
    source = load_file(str(dirs["src"] / "model.safetensors"))
    stored = load_file(str(work / "model.safetensors"))
    return {"work": work, "file": work / "model.safetensors", "base": base, "header": header, "quantized": quantized,
            "source": source, "stored": stored}


def _nearest_ok(w: float, s: float, v: float) -> bool:
    """Is ``v * s`` (the flipped element dequantized) one of the e4m3 points nearest ``w`` under
    scale ``s`` (brute force over every finite e4m3 value; fp32-level slack for ties)?"""
    if not math.isfinite(v):
        return False
    finite = E4M3_VALUES[torch.isfinite(E4M3_VALUES)]
    best = float((finite * s - w).abs().min())
    return abs(v * s - w) <= best + 1e-6 * max(abs(w), s)


def test_every_single_byte_change_fails_the_bound(fp8_case):
    """Exhaustive, element by element: each of the 255 other bytes of every F8 element of the
    directory, dequantized as the reader does (fp32), against ``rounding_bound`` (what verify
    compares with) and against the brute-force oracle: they agree on every change, and the only
    changes within the bound are +0 <-> -0 (the same value; none in the random blocks here, all of
    an all-zero block's elements)."""
    from converters.torch_path.hf_fp8_reader import rounding_bound

    values32 = E4M3_VALUES.float()
    finite = E4M3_VALUES[torch.isfinite(E4M3_VALUES)]
    within_zero = 0
    for name in fp8_case["quantized"]:
        w = fp8_case["source"][name].double().flatten()
        rows, cols = fp8_case["stored"][name].shape
        s = fp8_case["stored"][name + "_scale_inv"]
        s = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols].flatten()
        stored = fp8_case["stored"][name].view(torch.uint8).flatten().long()
        dequantized = (values32[None, :] * s[:, None]).double()  # [elements, 256 bytes]
        diff = (dequantized - w[:, None]).abs()
        passes = diff <= rounding_bound(w[:, None].expand(-1, 256), s[:, None].expand(-1, 256))
        best = (finite[None, :] * s.double()[:, None] - w[:, None]).abs().min(1).values
        nearest = (diff <= best[:, None] + 1e-6 * torch.maximum(w.abs(), s.double())[:, None]) & dequantized.isfinite()
        assert bool(passes[torch.arange(len(w)), stored].all()), name  # what the writer stored passes
        assert torch.equal(passes, nearest), name
        changed = passes.clone()
        changed[torch.arange(len(w)), stored] = False
        assert bool((values32[None, :].expand_as(changed)[changed] == 0).all()), name
        within_zero += int(changed.sum())
    assert within_zero == int(sum((fp8_case["stored"][n].view(torch.uint8) & 0x7F == 0).sum()
                                  for n in fp8_case["quantized"]))


corruptions = st.one_of(
    st.tuples(st.just("scale"), st.sampled_from(sorted(SCALE_DAMAGE)), st.integers(0, 10**6)),
    st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1,
                                        max_size=3), st.integers(0, 10**6)))


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(tensor_pick=st.integers(0, 10**6), corruption=corruptions)
def test_verify_never_passes_a_corrupted_fp8_block(fp8_case, dirs, tensor_pick, corruption):
    """The property: take one FP8 tensor and one of its 128x128 blocks (random); either set that
    block's scale_inv to NaN, +inf, -inf, 0 or a negative number, or XOR 1-3 random F8 bytes of that
    block with random non-zero masks. Then ``pmz verify SRC FP8`` fails naming the tensor (called in
process: ``converters.verify.verify`` raises CheckpointError, ``pmz``'s exit 1, or its report is not
``ok``, ``pmz``'s exit 1 with the MISMATCH line),
    unless every flipped byte decodes to an e4m3 value that is (still) one of the nearest to the
    source element under the block's scale (the brute-force oracle ``_nearest_ok``): in practice the
    sign flip of a zero (+0 <-> -0, same value) or a flip to the other neighbour of an exact tie,
    which are not corruption of the values (test_every_single_byte_change_fails_the_bound: for a
    single byte, only +0 <-> -0). A scale corruption is always refused."""
    case = fp8_case
    name = case["quantized"][tensor_pick % len(case["quantized"])]
    entry = case["header"][name]
    rows, cols = entry["shape"]
    scale_name = name + "_scale_inv"
    scale = case["stored"][scale_name]
    kind, what, block_pick = corruption
    br, bc = divmod(block_pick % scale.numel(), scale.shape[1])
    path = case["file"]
    patches: list[tuple[int, bytes]] = []
    exempt = True
    if kind == "scale":
        offset = case["base"] + case["header"][scale_name]["data_offsets"][0] + 4 * (br * scale.shape[1] + bc)
        patches.append((offset, struct.pack("<f", SCALE_DAMAGE[what])))
        exempt = False
    else:
        r0, c0 = br * 128, bc * 128
        h, w = min(128, rows - r0), min(128, cols - c0)
        flips: dict[tuple[int, int], int] = {}
        for pos, mask in what:
            i, j = r0 + (pos % (h * w)) // w, c0 + pos % w
            flips[(i, j)] = flips.get((i, j), 0) ^ mask
        flips = {k: m for k, m in flips.items() if m}
        if not flips:
            return
        fp8_bits = case["stored"][name].view(torch.uint8)
        s = float(scale[br, bc])
        for (i, j), mask in flips.items():
            new = int(fp8_bits[i, j]) ^ mask
            offset = case["base"] + entry["data_offsets"][0] + i * cols + j
            patches.append((offset, bytes([new])))
            exempt &= _nearest_ok(float(case["source"][name][i, j]), s, float(E4M3_VALUES[new]))
    originals = []
    try:
        with open(path, "r+b") as f:
            for offset, data in patches:
                f.seek(offset)
                originals.append((offset, f.read(len(data))))
                f.seek(offset)
                f.write(data)
        try:  # in process, as `pmz verify` runs it: CheckpointError is its exit 1, a report not ok too
            report = verify(str(dirs["src"]), str(case["work"]))
            failed, said = not report.ok, " ".join(report.mismatched)
        except CheckpointError as exc:
            failed, said = True, str(exc)
    finally:
        with open(path, "r+b") as f:
            for offset, data in reversed(originals):
                f.seek(offset)
                f.write(data)
    if not exempt:
        assert failed and name in said, (corruption, said)
