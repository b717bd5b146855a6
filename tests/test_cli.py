"""``pmz inspect`` / ``pmz verify`` / ``pmz convert`` as a user runs them.

References are transformers (parameter counts, models loaded from the original directories) and
safetensors' own reader; the CLI is called in-process (``converters.cli.main``) except once through
the installed console script.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters import convert
from converters.cli import main
from tests.cases import _case_configs, write_hf_model


def _llama4():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=90, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=False, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Per model: the transformers original and its legacy (tp2 pp2) and torch_dist (tp2) conversions."""
    root = tmp_path_factory.mktemp("cli")
    out = {}
    for name, cfg in (("llama", _llama4()), ("qwen2", _case_configs()["qwen2_tied_kv1"])):
        hf = write_hf_model(root, f"{name}_hf", cfg, seed=5)
        legacy, dist = root / f"{name}_legacy", root / f"{name}_dist"
        convert(hf, legacy, to="megatron", tp=2, pp=2, workers=2)
        convert(hf, dist, to="megatron-dist", tp=2, workers=2)
        out[name] = {"hf": hf, "megatron": legacy, "megatron-dist": dist}
    return out


def cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def parse_inspect(text: str) -> dict[str, str]:
    fields = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+)\s{2,}(.*)$", line)
        if m:
            fields[m.group(1)] = m.group(2).strip()
    return fields


def hf_param_count(path) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_inspect_all_formats(capsys, ckpts, model):
    expected_params = hf_param_count(ckpts[model]["hf"])
    layouts = {"hf": ("tp=1", "pp=1"), "megatron": ("tp=2", "pp=2"), "megatron-dist": ("tp=2",)}
    for fmt, path in ckpts[model].items():
        rc, out, err = cli(capsys, "inspect", path)
        assert rc == 0, err
        info = parse_inspect(out)
        assert info["format"] == fmt, out
        assert info["architecture"] == model, out
        for part in layouts[fmt]:
            assert part in info["parallel_layout"], out
        assert int(info["parameters"].replace(",", "")) == expected_params, (fmt, out, expected_params)
        assert info["dtype"] == "float32"


@pytest.mark.parametrize("a,b", [("hf", "megatron"), ("hf", "megatron-dist"), ("megatron", "megatron-dist")])
def test_verify_identical_checkpoints_in_different_formats(capsys, ckpts, a, b):
    rc, out, err = cli(capsys, "verify", ckpts["llama"][a], ckpts["llama"][b])
    assert rc == 0, err
    assert "OK:" in out and "MISMATCH" not in out + err
    n_tensors = len(load_file(str(Path(ckpts["llama"]["hf"]) / "model.safetensors")))
    assert f"OK: {n_tensors} tensors match" in out


def _modified_copy(src: Path, dst: Path, name: str, change) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    assert name in tensors
    tensors[name] = change(tensors[name].clone())
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_verify_reports_one_changed_tensor(capsys, ckpts, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"

    def bump(t):
        t[3, 5] += 1e-3
        return t

    changed = _modified_copy(Path(ckpts["llama"]["hf"]), tmp_path / "changed", name, bump)
    for other in ("hf", "megatron", "megatron-dist"):
        rc, out, err = cli(capsys, "verify", ckpts["llama"][other], changed)
        assert rc == 1, (other, out, err)
        lines = [line for line in err.splitlines() if line.startswith("MISMATCH")]
        assert len(lines) == 1, err
        assert name in lines[0] and "1 difference" in lines[0], lines[0]
        others = [n for n in load_file(str(changed / "model.safetensors")) if n != name]
        assert not any(f"{n}:" in lines[0] for n in others), lines[0]
    # a tolerance above the change accepts it
    rc, out, err = cli(capsys, "verify", ckpts["llama"]["megatron"], changed, "--atol", "0.01")
    assert rc == 0, err


def test_verify_logits(capsys, ckpts, tmp_path):
    for fmt in ("megatron", "megatron-dist"):
        rc, out, err = cli(capsys, "verify", ckpts["qwen2"][fmt], ckpts["qwen2"]["hf"], "--logits")
        assert rc == 0, err
        m = re.search(r"logits \(transformers, fixed prompt\): max abs diff (\S+)", out)
        assert m and float(m.group(1)) <= 1e-6, out

    # the logits check can fail: a change within --atol that still changes the outputs
    changed = _modified_copy(Path(ckpts["qwen2"]["hf"]), tmp_path / "changed", "model.norm.weight",
                             lambda t: t * 1.5)
    rc, out, err = cli(capsys, "verify", ckpts["qwen2"]["megatron"], changed, "--logits", "--atol", "2")
    assert rc == 1, out
    assert "MISMATCH" in err and "logits" in err, err


def test_pmz_console_script_converts(ckpts, tmp_path):
    exe = shutil.which("pmz") or str(Path(sys.executable).parent / "pmz")
    assert Path(exe).exists(), "the pmz console script is not installed"
    out = tmp_path / "hf_from_cli"
    proc = subprocess.run([exe, "convert", str(ckpts["llama"]["megatron"]), str(out), "--to", "hf", "--quiet",
                           "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"wrote hf checkpoint to {out}\n"  # --quiet silences progress only
    assert proc.stderr == ""
    original = load_file(str(Path(ckpts["llama"]["hf"]) / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == original.keys()
    assert all(torch.equal(got[k], original[k]) for k in original)
