"""``pmz`` as a newcomer meets it: it reads the vLLM ``sharded_state`` directories it writes, round trips
keep the files users ship (config.json byte for byte, generation config, tokenizer, chat template),
a config rebuilt from Megatron args reads like transformers' own, messages name what exists (valid
``--pp`` values, the uneven-split flags), ``inspect`` validates what it lists, ``verify`` summarizes.

References: transformers writes the source checkpoints and its own config.json; the vLLM writer the
reader inverts is checked against vLLM's own loaders in tests/test_vllm.py (bitwise).
"""

from __future__ import annotations

import contextlib
import filecmp
import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.cases import write_hf_model

COMPANIONS = {"tokenizer.json": '{"version": "1.0", "model": {"type": "BPE", "vocab": {}}}',
              "tokenizer_config.json": '{"model_max_length": 64, "chat_template": null}',
              "chat_template.jinja": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"}


def pmz(*args, copy_path: bool = True) -> subprocess.CompletedProcess:
    """``pmz ARGS`` in this process (``converters.cli.main``: the same exit codes and stderr lines as the
    command, without a second interpreter's start-up); ``copy_path`` False forces the torch path."""
    from converters.cli import main

    out, err = io.StringIO(), io.StringIO()
    previous = os.environ.get("PMZ_COPY_PATH")
    os.environ["PMZ_COPY_PATH"] = "1" if copy_path else "0"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main([str(a) for a in args])
            except SystemExit as exc:  # argparse: --help (0), bad arguments (2)
                rc = exc.code
    finally:
        if previous is None:
            os.environ.pop("PMZ_COPY_PATH")
        else:
            os.environ["PMZ_COPY_PATH"] = previous
    return subprocess.CompletedProcess(["pmz", *args], rc, out.getvalue(), err.getvalue())


def _configs() -> dict:
    from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    small = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2)
    return {
        "llama": LlamaConfig(**small),
        "qwen2": Qwen2Config(**small, tie_word_embeddings=False),
        "qwen2_moe": Qwen2MoeConfig(**small, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                    num_experts=4, num_experts_per_tok=2),
        "qwen3": Qwen3Config(**small, head_dim=24),
        "qwen3_moe": Qwen3MoeConfig(**small, head_dim=24, moe_intermediate_size=32, num_experts=4,
                                    num_experts_per_tok=2),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("newcomer")
    out = {name: write_hf_model(root, name, cfg, seed=i) for i, (name, cfg) in enumerate(_configs().items())}
    for name, text in COMPANIONS.items():
        (out["qwen2"] / name).write_text(text)
    return out


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert set(ta) == set(tb), sorted(set(ta) ^ set(tb))[:4]
    assert all(torch.equal(ta[k], tb[k]) for k in ta), [k for k in ta if not torch.equal(ta[k], tb[k])][:4]


# ------------------------------------------------------------------------------------- vLLM as a source


@pytest.mark.parametrize("name,tp,pp", [("qwen2", 2, 1), ("qwen2", 4, 2), ("qwen2_moe", 2, 1), ("qwen3_moe", 2, 2),
                                        ("llama", 2, 2)])
def test_vllm_sharded_state_back_to_hf_bitwise(models, tmp_path, name, tp, pp):
    vllm_dir, back = tmp_path / "vllm", tmp_path / "back"
    assert pmz("convert", models[name], vllm_dir, "--to", "vllm", "--tp", tp, "--pp", pp, "--quiet").returncode == 0
    res = pmz("inspect", vllm_dir)
    assert res.returncode == 0, res.stderr
    assert "format             vllm" in res.stdout and f"tp={tp}, pp={pp}" in res.stdout, res.stdout
    res = pmz("convert", vllm_dir, back, "--to", "hf", "--quiet")
    assert res.returncode == 0, res.stderr
    _assert_same_tensors(models[name], back)  # the HF tensors transformers saved, bitwise
    res = pmz("verify", models[name], vllm_dir)
    assert res.returncode == 0 and "all bitwise equal" in res.stdout, res.stdout + res.stderr
    mcore = tmp_path / "mcore"  # a Megatron target takes no layout from a vLLM source: TP 1, PP 1 unless asked
    assert pmz("convert", vllm_dir, mcore, "--to", "megatron", "--quiet").returncode == 0
    assert "tp=1, pp=1" in pmz("inspect", mcore).stdout
    other = tmp_path / "vllm-tp1"  # and reshards to another vLLM layout
    assert pmz("convert", vllm_dir, other, "--to", "vllm", "--tp", 1, "--quiet").returncode == 0
    assert pmz("verify", other, models[name]).returncode == 0


@pytest.mark.parametrize("case", ["tied", "v25_tied"])  # Qwen2-VL, Qwen2.5-VL: the tower on every vLLM stage
def test_vision_language_vllm_sharded_state_back_to_hf_bitwise(tmp_path, case):
    from tests.vl_cases import write_vl_model

    src = Path(write_vl_model(tmp_path / "src", case, seed=1))
    for tp, pp in ((2, 1), (1, 2)):
        vllm_dir, back = tmp_path / f"vllm{tp}{pp}", tmp_path / f"back{tp}{pp}"
        assert pmz("convert", src, vllm_dir, "--to", "vllm", "--tp", tp, "--pp", pp, "--quiet").returncode == 0
        res = pmz("convert", vllm_dir, back, "--to", "hf", "--quiet")
        assert res.returncode == 0, res.stderr
        _assert_same_tensors(src, back)


def test_vllm_source_damage_is_one_line(models, tmp_path):
    vllm_dir = tmp_path / "vllm"
    assert pmz("convert", models["qwen2"], vllm_dir, "--to", "vllm", "--tp", 2, "--quiet").returncode == 0

    def damaged(name: str, change) -> Path:
        d = tmp_path / name
        subprocess.run(["cp", "-r", str(vllm_dir), str(d)], check=True)
        change(d)
        return d

    def edit(d: Path, fn) -> None:
        f = d / "model-rank-1-part-0.safetensors"
        tensors = load_file(str(f))
        fn(tensors)
        save_file(tensors, str(f), metadata={"format": "pt"})

    cases = [
        (damaged("missing", lambda d: (d / "model-rank-1-part-0.safetensors").unlink()),
         "model-rank-1-part-0.safetensors: missing"),
        (damaged("shape", lambda d: edit(d, lambda t: t.__setitem__(
            "model.layers.0.mlp.down_proj.weight", t["model.layers.0.mlp.down_proj.weight"][:, :-1].contiguous()))),
         "model.layers.0.mlp.down_proj.weight has shape"),
        (damaged("extra", lambda d: edit(d, lambda t: t.__setitem__("model.layers.9.mlp.up.weight", torch.zeros(2)))),
         "unexpected tensor model.layers.9.mlp.up.weight"),
        (damaged("dropped", lambda d: edit(d, lambda t: t.pop("model.norm.weight"))),
         "tensor model.norm.weight missing"),
        (damaged("mixed", lambda d: (d / "model-rank-0-part-0.safetensors").rename(
            d / "model-pp-0-tp-0-part-0.safetensors")), "two checkpoints mixed"),
    ]
    for src, words in cases:  # (vLLM sources take the torch path: the copy path has no vLLM source)
        res = pmz("convert", src, tmp_path / "out", "--to", "hf")
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 1 and len(lines) == 1 and words in lines[0], (src.name, res.stderr)
        assert not (tmp_path / "out").exists()
        res = pmz("inspect", src)
        assert res.returncode == 1 and words in res.stderr, (src.name, res.stderr)


# ------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("fmt", ["megatron", "megatron-dist"])
@pytest.mark.parametrize("copy_path", [True, False])
def test_hf_megatron_hf_keeps_config_and_companion_files_byte_for_byte(models, tmp_path, fmt, copy_path):
    src, mid, back = models["qwen2"], tmp_path / "mid", tmp_path / "back"
    for args in ((src, mid, "--to", fmt, "--tp", 2, "--pp", 2), (mid, back, "--to", "hf")):
        res = pmz("convert", *args, "--quiet", copy_path=copy_path)
        assert res.returncode == 0 and "note:" not in res.stderr, res.stderr
    shipped = sorted(p.name for p in src.iterdir() if not p.name.endswith(".safetensors"))
    assert {"config.json", "generation_config.json", *COMPANIONS} <= set(shipped)
    assert sorted(p.name for p in (mid / "hf_config").iterdir()) == shipped  # kept on the Megatron side
    assert sorted(p.name for p in back.iterdir() if not p.name.endswith(".safetensors")) == shipped
    assert all(filecmp.cmp(src / n, back / n, shallow=False) for n in shipped), \
        [n for n in shipped if not filecmp.cmp(src / n, back / n, shallow=False)]
    _assert_same_tensors(src, back)


@pytest.mark.parametrize("name", list(_configs()))
def test_config_rebuilt_from_megatron_args_is_transformers_own(models, tmp_path, name):
    """Without hf_config/ the config comes from the Megatron args: it equals, key for key, the
    config.json transformers' save_pretrained wrote for the model, and pmz says what it cannot know."""
    import shutil

    src, mid, back = models[name], tmp_path / "mid", tmp_path / "back"
    res = pmz("convert", src, mid, "--to", "megatron", "--tp", 2, "--quiet")
    assert res.returncode == 0, res.stderr
    shutil.rmtree(mid / "hf_config")
    res = pmz("convert", mid, back, "--to", "hf", "--quiet")
    assert res.returncode == 0, res.stderr
    assert "note:" in res.stderr and "--hf-config" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    _assert_same_tensors(src, back)


# ------------------------------------------------------------------------------------ messages, inspect


def test_pp_message_names_valid_values_and_existing_flags(models, tmp_path):
    res = pmz("convert", models["qwen2"], tmp_path / "out", "--to", "megatron", "--pp", 3)
    line = res.stderr.strip()
    assert res.returncode == 1 and len(line.splitlines()) == 1, res.stderr
    assert "even splits of 4 layers: --pp 1, 2, 4" in line and "--decoder-first-pipeline-num-layers" in line, line
    assert "num_layers_in_first" not in line  # a ParallelConfig field, not a pmz flag
    flags = pmz("convert", "--help").stdout
    assert "--decoder-first-pipeline-num-layers" in flags and "--decoder-last-pipeline-num-layers" in flags
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("copy_path", [True, False])
def test_uneven_pipeline_split_written_and_read_back(models, tmp_path, copy_path):
    legacy, dist = tmp_path / "legacy", tmp_path / "dist"
    res = pmz("convert", models["qwen2"], legacy, "--to", "megatron", "--pp", 3, "--decoder-first-pipeline-num-layers",
              2, "--quiet", copy_path=copy_path)
    assert res.returncode == 0, res.stderr
    assert "first stage 2 layers" in pmz("inspect", legacy).stdout
    assert pmz("convert", legacy, dist, "--to", "megatron-dist", "--quiet", copy_path=copy_path).returncode == 0
    res = pmz("inspect", dist)
    assert "saved_with_pp=3" in res.stdout and "first stage 2 layers" in res.stdout, res.stdout
    res = pmz("verify", dist, models["qwen2"])
    assert res.returncode == 0 and "all bitwise equal" in res.stdout, res.stdout + res.stderr


def test_inspect_refuses_a_truncated_rank_file(models, tmp_path):
    ckpt = tmp_path / "tp2"
    assert pmz("convert", models["qwen2"], ckpt, "--to", "megatron", "--tp", 2, "--quiet").returncode == 0
    rank1 = next(ckpt.glob("*/mp_rank_01/model_optim_rng.pt"))
    with open(rank1, "r+b") as f:
        f.truncate(rank1.stat().st_size // 2)
    res = pmz("inspect", ckpt)
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stdout + res.stderr
    assert "mp_rank_01/model_optim_rng.pt" in res.stderr and res.stdout == ""


def test_verify_prints_a_summary_and_every_tensor_only_when_verbose(models, tmp_path):
    changed = tmp_path / "changed"
    subprocess.run(["cp", "-r", str(models["qwen2"]), str(changed)], check=True)
    tensors = load_file(str(changed / "model.safetensors"))
    tensors["model.layers.2.mlp.up_proj.weight"][0, 0] += 0.5
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    res = pmz("verify", models["qwen2"], changed)
    assert res.returncode == 1
    assert len(res.stdout.strip().splitlines()) == 1, res.stdout  # the summary, not one line per tensor
    assert f"compared {len(tensors)} tensors" in res.stdout and "model.layers.2.mlp.up_proj.weight" in res.stdout
    assert "max abs 0.5" in res.stdout and "MISMATCH: 1 difference" in res.stderr
    verbose = pmz("verify", models["qwen2"], changed, "--verbose")
    assert all(name in verbose.stdout for name in tensors)
