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
    assert proc.stdout == f"wrote hf checkpoint (HF safetensors, 1 file) to {out}\n"  # --quiet: no progress only
    assert proc.stderr == ""
    original = load_file(str(Path(ckpts["llama"]["hf"]) / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == original.keys()
    assert all(torch.equal(got[k], original[k]) for k in original)


# ---------------------------------------------------------------------------------------------- layouts


def _layout(capsys, path) -> str:
    rc, out, err = cli(capsys, "inspect", path)
    assert rc == 0, err
    return parse_inspect(out)["parallel_layout"]


def test_megatron_to_megatron_keeps_the_source_layout(capsys, ckpts, tmp_path):
    """Without --tp/--pp/--vpp a Megatron target takes the source's layout (it used to reshard to
    TP=1 silently); each given option overrides only itself."""
    legacy = ckpts["llama"]["megatron"]  # tp=2 pp=2
    dist = tmp_path / "dist"
    rc, _, err = cli(capsys, "convert", legacy, dist, "--to", "megatron-dist", "--quiet")
    assert rc == 0, err
    assert "saved_with_tp=2, saved_with_pp=2" in _layout(capsys, dist)
    back = tmp_path / "legacy"
    rc, _, err = cli(capsys, "convert", dist, back, "--to", "megatron", "--quiet")
    assert rc == 0, err
    assert _layout(capsys, back).startswith("tp=2, pp=2, vpp=1")
    tp4 = tmp_path / "tp4"
    rc, _, err = cli(capsys, "convert", dist, tp4, "--to", "megatron", "--tp", "4", "--quiet")
    assert rc == 0, err
    assert _layout(capsys, tp4).startswith("tp=4, pp=2, vpp=1")
    for path in (dist, back, tp4):
        rc, out, err = cli(capsys, "verify", path, ckpts["llama"]["hf"])
        assert rc == 0 and "OK:" in out, err


def test_megatron_layout_with_virtual_and_uneven_stages_is_kept(capsys, tmp_path):
    from converters import open_reader
    from converters.torch_path.megatron import plan_megatron_target, write_megatron

    cfg = _llama4()
    cfg.num_hidden_layers = 5
    hf = write_hf_model(tmp_path, "hf5", cfg, seed=2)
    reader = open_reader(hf)
    uneven = tmp_path / "uneven"
    uneven.mkdir()
    target = plan_megatron_target(reader, tp=1, pp=2, vpp=1, dtype=reader.info.dtype, first=2, last=3)
    write_megatron(reader, target, str(uneven), fmt="megatron", workers=1, progress=False)
    out = tmp_path / "uneven_dist"
    rc, _, err = cli(capsys, "convert", uneven, out, "--to", "megatron-dist", "--quiet")
    assert rc == 0, err  # an even split of 5 layers over 2 stages does not exist
    dist = open_reader(out)
    assert (dist.args.decoder_first_pipeline_num_layers, dist.args.decoder_last_pipeline_num_layers) == (2, 3)

    vpp = tmp_path / "vpp"
    convert(write_hf_model(tmp_path, "hf4", _llama4(), seed=3), vpp, to="megatron", pp=2, vpp=2, workers=1)
    out = tmp_path / "vpp_dist"
    rc, _, err = cli(capsys, "convert", vpp, out, "--to", "megatron-dist", "--quiet")
    assert rc == 0, err
    assert "saved_with_tp=1, saved_with_pp=2, saved_with_vpp=2" in _layout(capsys, out)
    rc, out_text, err = cli(capsys, "verify", out, tmp_path / "hf4")
    assert rc == 0, err


# ---------------------------------------------------------------------------------------------- CLI habits


def _pmz(*argv, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "converters.cli", *map(str, argv)],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent,
                          **kwargs)


def _imported(stderr: str) -> list[str]:
    return [line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")]


def _messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("import time:")]


def test_version_and_argument_errors_never_import_torch():
    from importlib.metadata import version

    proc = _pmz("--version")
    assert proc.returncode == 0 and proc.stdout == f"pmz {version('parallel-model-zoo')}\n", proc.stdout
    assert not any(m == "torch" or m.startswith("torch.") for m in _imported(proc.stderr))
    for argv, named in ((["convert", "a", "b", "--to", "hf", "--tp", "0"], "--tp"),
                        (["convert", "a", "b", "--to", "megatron", "--workers", "-2"], "--workers"),
                        (["convert", "a", "b", "--to", "megatron", "--max-shard-size", "big"], "--max-shard-size"),
                        (["convert", "a", "b", "--to", "hf", "--pp", "2"], "--pp"),
                        (["convert", "a", "b"], "--to"),
                        (["verify", "a", "b", "--atol", "-1"], "--atol")):
        proc = _pmz(*argv)
        assert proc.returncode == 2, (argv, proc.stderr)
        lines = _messages(proc.stderr)
        assert len(lines) == 1 and lines[0].startswith(f"pmz {argv[0]}: error:") and named in lines[0], lines
        assert not any(m == "torch" or m.startswith("torch.") for m in _imported(proc.stderr)), argv


def test_version_without_distribution_metadata(monkeypatch, capsys):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(SystemExit) as ex:
        main(["--version"])
    assert ex.value.code == 0 and capsys.readouterr().out == "pmz unknown\n"


def test_every_argument_has_help():
    import argparse

    from converters.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"pmz {' '.join(o for o in a.option_strings) or a.dest}" for a in parser._actions
               if not a.help and not isinstance(a, argparse._SubParsersAction)]
    for name, sub in subparsers.choices.items():
        missing += [f"pmz {name} {a.option_strings[0] if a.option_strings else a.dest}" for a in sub._actions
                    if not a.help or a.help == argparse.SUPPRESS]
    assert missing == [], f"arguments without help text: {missing}"


def test_closed_stdout_ends_quietly(ckpts):
    """``pmz inspect X | head -1``: the reader goes away before the output is written."""
    for argv in (["inspect", ckpts["llama"]["megatron"]], ["verify", ckpts["llama"]["hf"], ckpts["llama"]["hf"]]):
        proc = subprocess.Popen([sys.executable, "-m", "converters.cli", *map(str, argv)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        proc.stdout.close()  # before the child has written anything: its writes fail with EPIPE
        err = proc.stderr.read()
        proc.wait(timeout=120)
        assert err == "", err
        assert proc.returncode != 0  # nothing reached the reader


def test_os_errors_are_one_line(capsys, monkeypatch, ckpts, tmp_path):
    import converters.engine as engine

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied", "/somewhere/secret")

    monkeypatch.setattr(engine, "convert", denied)
    rc, out, err = cli(capsys, "convert", ckpts["llama"]["hf"], tmp_path / "x", "--to", "megatron", "--quiet")
    assert rc == 1 and err.strip().splitlines() == [
        "pmz convert: error: [Errno 13] Permission denied: '/somewhere/secret'"], err
    monkeypatch.undo()
    unreadable = tmp_path / "unreadable"
    shutil.copytree(ckpts["llama"]["hf"], unreadable)
    (unreadable / "config.json").unlink()
    (unreadable / "config.json").mkdir()  # reading it fails with IsADirectoryError on any user
    rc, out, err = cli(capsys, "inspect", unreadable)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "config.json" in err, err
