"""The copy path (converters/copy_path: byte ranges, no torch) for dense Qwen3.5 checkpoints' Megatron directions,
against the torch path (``PMZ_COPY_PATH=0``), which test_convert_hybrid checks against transformers and real
Megatron-Bridge.

* HF -> legacy (TP2 x PP2, PP2 x VPP2), HF -> torch_dist (TP2), legacy -> HF, torch_dist -> HF, legacy ->
  torch_dist and torch_dist -> legacy reshards, fp32 and bf16, MTP block included, tied embeddings too, and a
  conditional-generation checkpoint with its vision tower (HF <-> legacy / torch_dist): both paths write the
  same files (``test_copy_targets``' comparison: every rank file's keys in order, args and
  tensors; torch_dist metadata, chunk files, common.pt and every tensor, HF and Megatron values; HF
  safetensors byte for byte), and the copy path was taken.
* The GDN output norms (Megatron holds HF - 1) are set to values whose - 1 / + 1 round in their dtype: the copy
  path's arithmetic on bytes (``layout.megatron.shift_bytes``) is the torch path's; a Megatron source's norms
  are carried to a Megatron target as stored. The byte arithmetic against torch's over every bf16 and fp16
  value, both ways, and random fp32 ones.
* What the copy path leaves to the torch path (the engine falls back, nothing wrong is written): a NaN among
  the output norms (torch's own answer depends on its kernel). The mixture-of-experts hybrids take the copy
  path too: tests/test_copy_path_moe_hybrid.py.
"""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters.engine import convert
from tests.test_convert_hybrid import _configs, add_mtp, assert_same, dist_state
from tests.test_copy_targets import _same_dist, _same_rank_file, _torch_path, _tree, run_pmz_without_torch
from tests.test_hybrid_checkpoints import conditional_generation_checkpoint

NORM = "linear_attn.norm.weight"


def _set_hf_norms(path: str, fill) -> None:
    """Every GDN output norm of an HF checkpoint set to ``fill(tensor)``."""
    f = f"{path}/model.safetensors"
    tensors = load_file(f)
    for name, t in tensors.items():
        if name.endswith(NORM):
            tensors[name] = fill(t)
    save_file(tensors, f, metadata={"format": "pt"})


def _set_legacy_norms(root: Path) -> None:
    """Every rank file's GDN output norms set to values whose + 1 rounds (Megatron's ``w - 1`` never passes
    through HF in a reshard)."""
    for f in glob.glob(f"{root}/*/mp_rank_*/model_optim_rng.pt"):
        data = torch.load(f, weights_only=False)
        for state in (v for k, v in data.items() if k.startswith("model")):
            for key in [k for k in state if k.endswith("out_norm.weight")]:
                t = state[key]
                state[key] = (1e-3 * torch.arange(1, t.numel() + 1)).to(t.dtype)
        torch.save(data, f)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """Qwen3.5 with an MTP block (transformers' own checkpoint), fp32 and bf16, its output norms where - 1
    rounds; Megatron sources written by the torch path with norms where + 1 rounds."""
    from tests.workers_qwen3_5 import write_model

    root = tmp_path_factory.mktemp("copy_hybrid")
    hf = write_model(root, "qwen3_5", _configs()["qwen3_5"], 11)
    add_mtp(hf, 0)
    gen = torch.Generator().manual_seed(3)
    _set_hf_norms(hf, lambda t: torch.randn(t.shape, generator=gen) * 1e-3)  # x - 1 rounds in fp32
    out = {"hf": hf}
    _torch_path(hf, root / "hf_bf16", to="hf", dtype="bf16", workers=1)
    out["hf_bf16"] = str(root / "hf_bf16")
    for name, src in (("legacy", hf), ("legacy_bf16", out["hf_bf16"])):
        _torch_path(src, root / name, to="megatron", tp=2, pp=2, workers=1)
        _set_legacy_norms(root / name)
        out[name] = str(root / name)
    _torch_path(out["legacy"], root / "dist", to="megatron-dist", tp=2, pp=1, workers=1)
    out["dist"] = str(root / "dist")
    tied = _configs()["qwen3_5"]
    tied.tie_word_embeddings = True  # as the small Qwen3.5 models: Megatron's last stage holds output_layer
    out["hf_tied"] = write_model(root, "qwen3_5_tied", tied, 12)
    add_mtp(out["hf_tied"], 1)
    _torch_path(out["hf_tied"], root / "legacy_tied", to="megatron", tp=2, pp=2, workers=1)
    out["legacy_tied"] = str(root / "legacy_tied")
    # a conditional-generation checkpoint (transformers' Qwen3_5ForConditionalGeneration): its vision tower
    # on the first stage, per-head qkv, stacked blocks in torch_dist; output norms near 0 (x - 1 rounds)
    out["cg"], _ = conditional_generation_checkpoint(root, "qwen3_5")
    for name, to in (("cg_legacy", "megatron"), ("cg_dist", "megatron-dist")):
        _torch_path(out["cg"], root / name, to=to, tp=2, pp=2 if to == "megatron" else 1, workers=1)
        out[name] = str(root / name)
    return out


def _same_output(slow: Path, fast: Path) -> None:
    assert _tree(fast) == _tree(slow)
    for rel in _tree(slow):
        if rel.name == "model_optim_rng.pt":
            _same_rank_file(slow / rel, fast / rel)
        elif rel.suffix not in (".distcp", ".pt") and rel.name != ".metadata":
            assert (fast / rel).read_bytes() == (slow / rel).read_bytes(), rel  # safetensors, configs, tracker
    for meta in [p for p in _tree(slow) if p.name == ".metadata"]:
        _same_dist(slow / meta.parent, fast / meta.parent)  # metadata, common.pt, the HF tensors read back
        assert_same(dist_state(str(slow)), dist_state(str(fast)))  # and the Megatron ones (DCP's own loader)


CASES = [("hf", "megatron", dict(tp=2, pp=2)), ("hf", "megatron", dict(pp=2, vpp=2)),
         ("hf", "megatron-dist", dict(tp=2)), ("legacy", "hf", {}), ("dist", "hf", {}),
         ("legacy", "megatron-dist", dict(tp=1, pp=1)), ("dist", "megatron", dict(tp=2, pp=2)),
         ("hf_bf16", "megatron", dict(tp=2)), ("legacy_bf16", "hf", {}),
         ("hf_tied", "megatron", dict(pp=2)), ("hf_tied", "megatron-dist", {}), ("legacy_tied", "hf", {}),
         ("cg", "megatron", dict(tp=2, pp=2)), ("cg", "megatron-dist", dict(tp=2)), ("cg_legacy", "hf", {}),
         ("cg_dist", "hf", {}), ("cg_dist", "megatron", dict(tp=2, pp=2))]


@pytest.mark.parametrize("source, to, kw", CASES, ids=[f"{s}-{t}-{''.join(f'{k}{v}' for k, v in kw.items())}"
                                                       for s, t, kw in CASES])
def test_copy_path_writes_what_the_torch_path_writes(sources, tmp_path, paths_taken, source, to, kw):
    src = sources[source]
    _torch_path(src, tmp_path / "slow", to=to, workers=1, **kw)
    convert(src, tmp_path / "fast", to=to, workers=2, **kw)
    assert paths_taken[-1] is True, "the copy path was not taken"
    _same_output(tmp_path / "slow", tmp_path / "fast")
    if to == "megatron" and not source.startswith("cg"):  # the MTP block is there (on the last stage)
        assert glob.glob(f"{tmp_path / 'fast'}/*/mp_rank_*/model_optim_rng.pt")
        last = sorted(glob.glob(f"{tmp_path / 'fast'}/*/mp_rank_*/model_optim_rng.pt"))[-1]
        keys = [k for v in torch.load(last, weights_only=False).values() if isinstance(v, dict) for k in v]
        assert any(k.startswith("mtp.layers.0.mtp_model_layer.") for k in keys)


def test_a_nan_output_norm_takes_the_torch_path(sources, tmp_path, paths_taken):
    """torch's ``(x.float() - 1).to(dtype)`` of a NaN depends on its kernel: the copy path leaves it to the torch
    path (HF source to a Megatron target; a Megatron source, whose HF value it computes on opening)."""
    hf = tmp_path / "nan"
    convert(sources["hf"], hf, to="hf")
    assert paths_taken[-1] is True  # HF -> HF: no arithmetic, a byte copy
    _set_hf_norms(str(hf), lambda t: t.index_fill(0, torch.tensor([1]), float("nan")))
    convert(hf, tmp_path / "legacy", to="megatron", tp=2)
    assert paths_taken[-1] is False
    convert(tmp_path / "legacy", tmp_path / "back", to="hf")
    assert paths_taken[-1] is False
    got = load_file(f"{tmp_path / 'back'}/model.safetensors")
    assert all(torch.isnan(t[1]) for n, t in got.items() if n.endswith(NORM))


@pytest.mark.parametrize("dtype, tag", [(torch.bfloat16, "BF16"), (torch.float16, "F16")])
def test_minus_one_bytes_over_every_value(dtype, tag):
    """``shift_bytes`` is torch's ``(x.float() + delta).to(dtype)`` bitwise for every non-NaN bf16 / fp16 value,
    both ways, in one vector and in norm-sized ones; a NaN is refused."""
    from converters.layout.megatron import LayoutError, shift_bytes

    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    x = every[~torch.isnan(every)].contiguous()
    for delta in (-1.0, 1.0):
        ref = (x.float() + delta).to(dtype).view(torch.int16)
        got = torch.frombuffer(bytearray(shift_bytes(x.view(torch.int16).numpy().tobytes(), tag, delta)),
                               dtype=torch.int16)
        assert torch.equal(got, ref), (got != ref).sum()
        for row in x[: 12 * 64].reshape(64, 12):  # a [linear_value_head_dim] vector each
            ref = (row.float() + delta).to(dtype).view(torch.int16)
            got = torch.frombuffer(bytearray(shift_bytes(row.view(torch.int16).numpy().tobytes(), tag, delta)),
                                   dtype=torch.int16)
            assert torch.equal(got, ref)
    nan = torch.tensor([1.0, float("nan")], dtype=dtype).view(torch.int16).numpy().tobytes()
    with pytest.raises(LayoutError, match="NaN"):
        shift_bytes(nan, tag, -1.0)


def test_minus_one_bytes_on_random_fp32():
    from converters.layout.megatron import shift_bytes

    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(50_000, generator=gen) * s for s in (1e-38, 1e-30, 1e-7, 1e-3, 1.0, 1e3, 1e30)]
                  + [torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 3.4e38, -3.4e38, float("inf"),
                                   float("-inf"), 0.5, 2.0])])
    for delta in (-1.0, 1.0):
        got = torch.frombuffer(bytearray(shift_bytes(x.numpy().tobytes(), "F32", delta)), dtype=torch.int32)
        assert torch.equal(got, (x + delta).view(torch.int32))



def test_cli_conversions_never_import_torch(sources, tmp_path):
    """``pmz convert`` of Qwen3.5 HF -> legacy and torch_dist -> HF runs without torch (the copy path's promise:
    no tensors in Python, memory bounded by its buffers)."""
    cases = [(sources["hf"], ["--to", "megatron", "--tp", "2"]), (sources["dist"], ["--to", "hf"])]
    for i, (src, to) in enumerate(cases):
        run_pmz_without_torch("convert", str(src), str(tmp_path / f"out{i}"), *to)



def test_torch_path_minus_one_runs_the_byte_rule_and_keeps_float64():
    """The torch path's ``shifted`` is ``shift_bytes`` on the tensor's bytes for bf16 / fp16 / fp32 (checked
    against torch's own arithmetic, independent of both), keeps a NaN as stored, and computes float64 (which
    the byte rule does not take) in torch's arithmetic instead of refusing it."""
    from converters.layout.megatron import shifted

    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(64, generator=gen) * 3).to(dtype)
        for delta in (-1.0, 1.0):
            assert torch.equal(shifted(x, delta).view(torch.uint8), (x.float() + delta).to(dtype).view(torch.uint8))
        nan = torch.tensor([1.0, float("nan")], dtype=dtype)
        assert torch.equal(shifted(nan, -1.0)[1:].view(torch.uint8), nan[1:].view(torch.uint8))
    x = torch.randn(64, generator=gen, dtype=torch.float64)
    assert torch.equal(shifted(x, -1.0), x - 1)
