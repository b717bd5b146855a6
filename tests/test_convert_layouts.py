"""Megatron checkpoints as frameworks write them, converted by ``pmz`` (real megatron-core writes them).

One spawned group of 4 ranks (tests/megatron_oracle.save_framework_checkpoints) writes, with
megatron-core's own ``dist_checkpointing.save``: a model-only TP2 x PP2 torch_dist checkpoint (no
Megatron args), the same model as verl's actor checkpoint (model + optimizer-like sharded state + RNG
ShardedObject + lr_scheduler), a model with a LoRA-adapter tensor, and a verl actor with virtual
pipeline stages (model0/model1). This module then lays out verl's and Megatron-Bridge's folders around
them (huggingface/, transformer_config.json, trackers, run_config.yaml) and checks that transformers'
logits on our HF output equal megatron-core's, that optimizer/RNG bytes are never read (they are
overwritten with garbage before any conversion), and that mismatching configs and damaged trackers
end in one clear line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from converters import convert, open_reader  # noqa: E402
from models.common.errors import CheckpointError  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.megatron_oracle import OracleSpec  # noqa: E402
from tests.test_convert_megatron import LOGITS_TOL, hf_config_for, hf_logits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# GQA, untied, vocab padded (100 -> 128 rows at TP2 with divisible-by 16*2)
SPEC = OracleSpec(arch="llama", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_query_groups=2, kv_channels=16, vocab_size=100, make_vocab_size_divisible_by=16,
                  tie_embeddings=False, seed=21)
# qkv bias, tied; 8 layers so each of the 2 x 2 virtual chunks holds 2
VPP_SPEC = OracleSpec(arch="qwen2", num_layers=8, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                      num_query_groups=2, kv_channels=16, vocab_size=90, make_vocab_size_divisible_by=16,
                      tie_embeddings=True, seed=22)
COMPANIONS = {"tokenizer_config.json": {"model_max_length": 64, "tokenizer_class": "PreTrainedTokenizerFast"},
              "generation_config.json": {"do_sample": False, "eos_token_id": 2}}


def _hf_dir(path: Path, spec: OracleSpec, companions: bool = True) -> Path:
    """What verl's rank 0 writes to huggingface/: the HF config (save_pretrained) and tokenizer files."""
    hf_config_for(spec).save_pretrained(str(path))
    if companions:
        for name, data in COMPANIONS.items():
            (path / name).write_text(json.dumps(data))
    return path


def _corrupt_non_model_bytes(dist_ckpt: Path) -> int:
    """Overwrite the stored bytes of every optimizer / RNG entry with 0xff; returns how many."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(dist_ckpt)).read_metadata()
    n = 0
    for index, info in md.storage_data.items():
        if index.fqn.startswith(("optimizer.", "rng_state")):
            with open(dist_ckpt / info.relative_path, "r+b") as f:
                f.seek(info.offset)
                f.write(b"\xff" * info.length)
            n += 1
    return n


def _verl_actor(step_dir: Path, spec: OracleSpec, step: int) -> Path:
    """verl's files around the dist_ckpt/ megatron-core wrote: huggingface/, transformer_config.json,
    the tracker two levels above actor/, and a critic/ beside it (never to be read: its metadata is junk)."""
    actor = step_dir / "actor"
    _hf_dir(actor / "huggingface", spec)
    (actor / "transformer_config.json").write_text(json.dumps(
        {"num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "params_dtype": "torch.float32"}))
    (step_dir.parent / "latest_checkpointed_iteration.txt").write_text(str(step))
    (step_dir / "critic" / "dist_ckpt").mkdir(parents=True)
    (step_dir / "critic" / "dist_ckpt" / "metadata.json").write_text("not json")
    return actor


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("framework_ckpts")
    results = run_distributed(4, _save_all, str(root))
    verl = _verl_actor(root / "verl" / "global_step_5", SPEC, 5)
    vpp = _verl_actor(root / "verl_vpp" / "global_step_7", VPP_SPEC, 7)
    corrupted = {p: _corrupt_non_model_bytes(p / "dist_ckpt") for p in (verl, vpp)}
    _hf_dir(root / "hf_config", SPEC, companions=False)
    return {"root": root, "logits": results[0]["logits"], "vpp_logits": results[0]["vpp_logits"],
            "actor": verl, "vpp_actor": vpp, "corrupted": corrupted}


def _save_all(root: str) -> dict:
    from tests.megatron_oracle import save_framework_checkpoints

    return save_framework_checkpoints(root, SPEC, VPP_SPEC)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _pmz(*args: str, cwd: Path, check_torch: bool = False) -> subprocess.CompletedProcess:
    """``pmz`` in a fresh process; with ``check_torch`` the last stdout line says whether torch was imported."""
    code = ("import sys\nfrom converters.cli import main\n"
            f"rc = main({list(args)!r})\n"
            + ("print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)\n" if check_torch else "sys.exit(rc)\n"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(cwd),
                          timeout=300)


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


# ---------------------------------------------------------------------------------- model-only torch_dist


def test_model_only_checkpoint_has_no_args(ckpts):
    """What megatron-core wrote: a torch_dist folder whose common state holds no args."""
    it_dir = ckpts["root"] / "model_only"
    assert (it_dir / "metadata.json").is_file() and (it_dir / ".metadata").is_file()
    common = it_dir / "common.pt"
    assert not common.exists() or "args" not in (torch.load(common, weights_only=False) or {})
    with pytest.raises(CheckpointError, match=r"no Megatron args .*pass --hf-config DIR"):
        convert(it_dir, ckpts["root"] / "never", to="hf")
    assert not (ckpts["root"] / "never").exists()


@pytest.mark.parametrize("copy_path", [True, False], ids=["copy-path", "torch-path"])
def test_model_only_tp2pp2_with_hf_config(ckpts, tmp_path, monkeypatch, copy_path):
    if not copy_path:
        monkeypatch.setenv("PMZ_COPY_PATH", "0")
    out = convert(ckpts["root"] / "model_only", tmp_path / "hf", to="hf", hf_config=str(ckpts["root"] / "hf_config"))
    logits = hf_logits(out, SPEC)
    assert logits.std().item() > 0.05
    assert _diff(logits, ckpts["logits"]) <= LOGITS_TOL


def test_model_only_paths_write_the_same_bytes(ckpts, tmp_path, monkeypatch):
    src, cfg = ckpts["root"] / "model_only", str(ckpts["root"] / "hf_config")
    convert(src, tmp_path / "copy", to="hf", hf_config=cfg)
    monkeypatch.setenv("PMZ_COPY_PATH", "0")
    convert(src, tmp_path / "torch", to="hf", hf_config=cfg)
    assert _files(tmp_path / "copy") == _files(tmp_path / "torch")


def test_model_only_layout_unknown_and_megatron_target_defaults_to_tp1(ckpts, tmp_path):
    cfg = str(ckpts["root"] / "hf_config")
    reader = open_reader(ckpts["root"] / "model_only", hf_config=cfg)
    assert reader.args is None and reader.padded_vocab == 128  # padded vocab from the embedding rows
    assert {reader.info.layout[k] for k in ("saved_with_tp", "saved_with_pp", "saved_with_vpp")} == {None}
    out = convert(ckpts["root"] / "model_only", tmp_path / "mcore", to="megatron", hf_config=cfg)
    assert sorted(p.name for p in (out / "release").iterdir()) == ["mp_rank_00"]  # no iteration recorded
    back = convert(out, tmp_path / "hf", to="hf")
    assert _diff(hf_logits(back, SPEC), ckpts["logits"]) <= LOGITS_TOL


@pytest.mark.parametrize("field,value,message", [
    ("num_hidden_layers", 10**9, r"num_hidden_layers=1000000000, but decoder\.layers\.self_attention\.linear_qkv"
                                 r"\.weight has shape \(4, 128, 64\) \(4 stacked layers\)"),
    ("hidden_size", 96, r"hidden_size=96.*embedding\.word_embeddings\.weight has shape \(128, 64\)"),
    ("vocab_size", 200, r"vocab_size=200, but embedding\.word_embeddings\.weight has shape \(128, 64\) \(128 rows"),
    ("intermediate_size", 96, r"intermediate_size=96 implies 192 gate\+up rows, but decoder\.layers\.mlp\.linear_fc1"
                              r"\.weight has shape \(4, 256, 64\)"),
    ("num_key_value_heads", 4, r"num_key_value_heads=4, head_dim=16, hidden_size=64 imply 192 qkv rows"),
])
def test_config_against_tensors(ckpts, tmp_path, monkeypatch, field, value, message):
    """A config that does not describe the tensors fails before anything sized by it is built, naming
    the config file, its value and the tensor's shape; copy path, torch path and CLI alike."""
    bad = tmp_path / "bad_config"
    shutil.copytree(ckpts["root"] / "hf_config", bad)
    data = json.loads((bad / "config.json").read_text())
    data[field] = value
    (bad / "config.json").write_text(json.dumps(data))
    src = ckpts["root"] / "model_only"
    with pytest.raises(CheckpointError, match=rf"bad_config/config\.json does not describe .*{message}"):
        convert(src, tmp_path / "out", to="hf", hf_config=str(bad))
    with pytest.raises(CheckpointError, match=message):
        open_reader(src, hf_config=str(bad))
    monkeypatch.setenv("PMZ_COPY_PATH", "0")
    with pytest.raises(CheckpointError, match=message):
        convert(src, tmp_path / "out", to="megatron", hf_config=str(bad))
    res = _pmz("convert", str(src), str(tmp_path / "out"), "--to", "hf", "--hf-config", str(bad), cwd=tmp_path)
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "does not describe the checkpoint" in res.stderr and not (tmp_path / "out").exists()


def test_lora_adapter_tensors_are_refused(ckpts, tmp_path):
    with pytest.raises(CheckpointError, match=r"LoRA adapter tensors \(decoder\.layers\.self_attention\.linear_qkv"
                                              r"\.adapter\.linear_in\.weight.*merge the adapters first"):
        convert(ckpts["root"] / "lora", tmp_path / "out", to="hf", hf_config=str(ckpts["root"] / "hf_config"))


# ------------------------------------------------------------------------------------------------- verl


def test_verl_checkpoint_as_written(ckpts):
    """verl's dist_ckpt holds the model without any prefix, optimizer tensors under
    ``optimizer.state.exp_avg.<model key>``, the RNG state as ShardedObject shards, no args; VPP chunks
    (model0/model1) leave no trace in the keys."""
    from torch.distributed.checkpoint import FileSystemReader

    for actor, layers in ((ckpts["actor"], 4), (ckpts["vpp_actor"], 8)):
        md = FileSystemReader(str(actor / "dist_ckpt")).read_metadata()
        keys = set(md.state_dict_metadata)
        model = {k for k in keys if not k.startswith(("optimizer.", "rng_state"))}
        assert "embedding.word_embeddings.weight" in model
        assert all(k.startswith(("embedding.", "decoder.", "output_layer.")) for k in model), sorted(model)
        assert md.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"].size[0] == layers
        assert "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight" in keys
        assert any(k.startswith("rng_state/shard_") for k in keys)
        assert ckpts["corrupted"][actor] > 10
    common = torch.load(ckpts["actor"] / "dist_ckpt" / "common.pt", weights_only=False)
    assert "args" not in common and common["lr_scheduler"]["num_steps"] == 5


def test_corrupted_optimizer_bytes_would_fail_a_reader(ckpts):
    """The control for the tests below: the optimizer chunks really are unreadable now."""
    from torch.distributed.checkpoint import FileSystemReader

    dist_ckpt = ckpts["actor"] / "dist_ckpt"
    md = FileSystemReader(str(dist_ckpt)).read_metadata()
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn.startswith("optimizer."))
    with open(dist_ckpt / info.relative_path, "rb") as f:
        f.seek(info.offset)
        raw = f.read(info.length)
    assert raw == b"\xff" * info.length
    import io
    import pickle
    import zipfile

    with pytest.raises((RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile)):
        torch.load(io.BytesIO(raw), weights_only=True)


def test_verl_actor_with_no_flags_takes_the_copy_path(ckpts, tmp_path):
    """``pmz convert global_step_N/actor out --to hf``: config and tokenizer files from huggingface/,
    the copy path (torch never imported), optimizer/RNG bytes (garbage) never read."""
    res = _pmz("convert", str(ckpts["actor"]), str(tmp_path / "out"), "--to", "hf", "--quiet", cwd=tmp_path,
               check_torch=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "NO-TORCH 0", res.stdout + res.stderr
    out = tmp_path / "out"
    assert _diff(hf_logits(out, SPEC), ckpts["logits"]) <= LOGITS_TOL
    for name, data in COMPANIONS.items():
        assert json.loads((out / name).read_text()) == data
    assert not (out / "transformer_config.json").exists()
    assert json.loads((out / "config.json").read_text())["vocab_size"] == SPEC.vocab_size


def test_verl_root_step_dir_and_torch_path_agree(ckpts, tmp_path, monkeypatch):
    """The verl root (tracker -> global_step_5 -> actor, critic ignored), the step folder, and the
    torch path all give the actor conversion's bytes."""
    actor = ckpts["actor"]
    convert(actor, tmp_path / "actor", to="hf")
    convert(actor.parent.parent, tmp_path / "root", to="hf")
    convert(actor.parent, tmp_path / "step", to="hf")
    monkeypatch.setenv("PMZ_COPY_PATH", "0")
    convert(actor, tmp_path / "torch", to="hf")
    expected = _files(tmp_path / "actor")
    assert "tokenizer_config.json" in expected
    for name in ("root", "step", "torch"):
        assert _files(tmp_path / name) == expected, name


def test_verl_dist_ckpt_alone_needs_hf_config(ckpts, tmp_path):
    alone = tmp_path / "dist_ckpt"
    shutil.copytree(ckpts["actor"] / "dist_ckpt", alone)
    with pytest.raises(CheckpointError, match=r"no Megatron args .*pass --hf-config DIR"):
        convert(alone, tmp_path / "x", to="hf")
    out = convert(alone, tmp_path / "out", to="hf", hf_config=str(ckpts["actor"] / "huggingface"))
    assert _diff(hf_logits(out, SPEC), ckpts["logits"]) <= LOGITS_TOL
    assert (out / "tokenizer_config.json").is_file()
    # in place, dist_ckpt/ finds the huggingface/ folder beside it
    out2 = convert(ckpts["actor"] / "dist_ckpt", tmp_path / "out2", to="hf")
    assert _files(out2) == _files(out)


def test_verl_vpp_actor(ckpts, tmp_path):
    out = convert(ckpts["vpp_actor"].parent.parent, tmp_path / "out", to="hf")
    logits = hf_logits(out, VPP_SPEC)
    assert logits.std().item() > 0.05
    assert _diff(logits, ckpts["vpp_logits"]) <= LOGITS_TOL


def test_verl_actor_to_megatron_reads_no_optimizer_bytes(ckpts, tmp_path):
    """The torch path (a Megatron target): the source layout is unknown, so tp=1, pp=1 by default."""
    out = convert(ckpts["actor"], tmp_path / "mcore", to="megatron-dist")
    reader = open_reader(out)
    assert (reader.info.layout["saved_with_tp"], reader.info.layout["saved_with_pp"]) == (1, 1)
    back = convert(out, tmp_path / "hf", to="hf")
    assert _diff(hf_logits(back, SPEC), ckpts["logits"]) <= LOGITS_TOL


def test_verl_inspect(ckpts, tmp_path):
    res = _pmz("inspect", str(ckpts["actor"].parent.parent), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert "verl actor" in text and "huggingface" in text
    assert "saved with: unknown (no Megatron args" in text
    assert "critic/ beside it not converted" in text
    line = next(s for s in text.splitlines() if s.startswith("skipped"))
    assert "optimizer: " in line and " tensors" in line and "rng_state: 4 objects" in line
    assert "lr_scheduler" in line
    res = _pmz("inspect", str(ckpts["root"] / "model_only"), "--hf-config", str(ckpts["root"] / "hf_config"),
               cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "--hf-config" in next(s for s in res.stdout.splitlines() if s.startswith("model_description"))


def test_verl_critic_only_and_missing_step(ckpts, tmp_path):
    step = tmp_path / "ckpt" / "global_step_3"
    shutil.copytree(ckpts["actor"].parent / "critic", step / "critic")
    with pytest.raises(CheckpointError, match=r"global_step_3: only critic/; pmz converts the actor"):
        convert(step, tmp_path / "out", to="hf")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("4")
    with pytest.raises(CheckpointError, match=r"latest_checkpointed_iteration\.txt names step 4, but .*global_step_4 "
                                              r"does not exist"):
        convert(tmp_path / "ckpt", tmp_path / "out", to="hf")


def test_verl_hf_weights_when_dist_ckpt_has_no_model(ckpts, tmp_path):
    """verl with the bridge's HF checkpoint: dist_ckpt/ holds only optimizer/RNG state and the weights
    are in huggingface/ (an HF source then)."""
    converted = convert(ckpts["actor"], tmp_path / "hf", to="hf")
    actor = tmp_path / "global_step_1" / "actor"
    shutil.copytree(converted, actor / "huggingface")
    (actor / "transformer_config.json").write_text("{}")
    (actor / "dist_ckpt").mkdir()
    (actor / "dist_ckpt" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    # a .metadata listing only non-model entries
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    md = Metadata(state_dict_metadata={"rng_state/shard_0.0_1.1": BytesStorageMetadata()})
    (actor / "dist_ckpt" / ".metadata").write_bytes(pickle.dumps(md))
    out = convert(actor, tmp_path / "out", to="hf")
    assert _files(out) == _files(converted)


# ------------------------------------------------------------------------------------- Megatron-Bridge


def _bridge_root(tmp_path: Path, ckpts, *, hf_export: bool, model_id: str) -> Path:
    """Megatron-Bridge's save layout (megatron/bridge/training/checkpointing.py) around the model-only
    torch_dist megatron-core wrote: trackers, iter_0000010/ with run_config.yaml, train_state.pt,
    tokenizer/, and with ``also_save_hf_checkpoint`` an HF export in hf/ (here its config only)."""
    root = tmp_path / "bridge"
    it_dir = root / "iter_0000010"
    shutil.copytree(ckpts["root"] / "model_only", it_dir)
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    torch.save({"iteration": 10}, root / "latest_train_state.pt")
    torch.save({"iteration": 10}, it_dir / "train_state.pt")
    (it_dir / "run_config.yaml").write_text(f"model:\n  _target_: megatron.bridge.models.llama.LlamaModelProvider\n"
                                            f"  num_layers: 4\n  hf_model_id: {model_id}\n")
    (it_dir / "tokenizer").mkdir()
    (it_dir / "tokenizer" / "tokenizer_config.json").write_text("{}")
    if hf_export:
        _hf_dir(it_dir / "hf", SPEC)
    return root


@pytest.mark.parametrize("hf_export", [True, False], ids=["hf-export", "hf-model-id"])
def test_megatron_bridge_root(ckpts, tmp_path, hf_export):
    model_id = str(ckpts["root"] / "hf_config") if not hf_export else "meta-llama/Llama-3.2-1B"
    root = _bridge_root(tmp_path, ckpts, hf_export=hf_export, model_id=model_id)
    out = convert(root, tmp_path / "out", to="hf")
    assert _diff(hf_logits(out, SPEC), ckpts["logits"]) <= LOGITS_TOL


def test_megatron_bridge_remote_model_id_asks_for_hf_config(ckpts, tmp_path):
    root = _bridge_root(tmp_path, ckpts, hf_export=False, model_id="meta-llama/Llama-3.2-1B")
    with pytest.raises(CheckpointError, match=r"no Megatron args .*pass --hf-config DIR"):
        convert(root, tmp_path / "out", to="hf")
    res = _pmz("inspect", str(root), "--hf-config", str(ckpts["root"] / "hf_config"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "Megatron-Bridge" in res.stdout and "hf_model_id=meta-llama/Llama-3.2-1B" in res.stdout


# ------------------------------------------------------------------------------------------- trackers


@pytest.mark.parametrize("kind", ["megatron", "verl"])
@pytest.mark.parametrize("content", [b"\x80\x81\xfe\x00binary", b"12\xff"], ids=["binary", "truncated-utf8"])
def test_undecodable_tracker_names_the_file(ckpts, tmp_path, kind, content):
    root = tmp_path / "ckpt"
    if kind == "megatron":
        shutil.copytree(ckpts["root"] / "model_only", root / "iter_0000010")
    else:
        (root / "global_step_5" / "actor").mkdir(parents=True)
        os.symlink(ckpts["actor"] / "dist_ckpt", root / "global_step_5" / "actor" / "dist_ckpt")
    tracker = root / "latest_checkpointed_iteration.txt"
    tracker.write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"{tracker}: not a text file \(byte 0x.. at offset \d+ is not UTF-8\)"):
        convert(root, tmp_path / "out", to="hf", hf_config=str(ckpts["root"] / "hf_config"))
    for command in (["inspect", str(root)], ["convert", str(root), str(tmp_path / "o"), "--to", "hf"]):
        res = _pmz(*command, cwd=tmp_path)
        assert res.returncode == 1 and res.stderr.strip().splitlines() == [res.stderr.strip()], res.stderr
        assert str(tracker) in res.stderr and "Traceback" not in res.stderr


def test_verl_nested_layout(ckpts, tmp_path):
    """Newer verl: actor/model/{dist_ckpt,huggingface}/, optimizer/dist_ckpt/, extra/dist_ckpt/,
    ckpt_contents.json (the same megatron-core write, moved into that layout)."""
    actor = tmp_path / "ckpts" / "global_step_5" / "actor"
    (actor / "model").mkdir(parents=True)
    os.symlink(ckpts["actor"] / "dist_ckpt", actor / "model" / "dist_ckpt")
    shutil.copytree(ckpts["actor"] / "huggingface", actor / "model" / "huggingface")
    for extra in ("optimizer", "extra"):
        (actor / extra / "dist_ckpt").mkdir(parents=True)
    (actor / "ckpt_contents.json").write_text("{}")
    (tmp_path / "ckpts" / "latest_checkpointed_iteration.txt").write_text("5")
    out = convert(tmp_path / "ckpts", tmp_path / "out", to="hf")
    assert _diff(hf_logits(out, SPEC), ckpts["logits"]) <= LOGITS_TOL
    assert (out / "tokenizer_config.json").is_file()
    from converters.formats.locate import locate_source

    loc = locate_source(actor)
    assert loc.path == str(actor / "model" / "dist_ckpt") and loc.hf_config_dir == str(actor / "model" / "huggingface")
    assert any("optimizer/ not read" in n for n in loc.notes)


def test_value_head_is_named():
    """A verl critic's output layer has one row: refused as a value head, not as a vocab mismatch."""
    from types import SimpleNamespace

    from converters.formats.megatron_dist import check_config_against_dist

    cfg = SimpleNamespace(num_hidden_layers=2, hidden_size=8, vocab_size=10, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=4, intermediate_size=16)
    shapes = {"embedding.word_embeddings.weight": (16, 8), "output_layer.weight": (1, 8),
              "decoder.layers.self_attention.linear_qkv.weight": (2, 16, 8)}
    with pytest.raises(CheckpointError, match=r"cfg/config\.json does not describe the checkpoint ck: output_layer"
                                              r"\.weight has shape \(1, 8\): a value head"):
        check_config_against_dist(cfg, shapes, "cfg/config.json", "ck")
    check_config_against_dist(cfg, {**shapes, "output_layer.weight": (16, 8)}, "cfg/config.json", "ck")
