"""Bad input fails early with a clear error: parallel layouts (ParallelConfigError, before any
process group exists) and checkpoints (CheckpointError naming the file or tensor).

Checkpoints are written by transformers itself (tests/cases.py) and then damaged by hand.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from models.common.config import ModelConfig
from models.common.sources import CheckpointError
from parallel.config import ParallelConfig, ParallelConfigError
from tests.cases import write_hf_model


def _llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32)
    base.update(kw)
    return LlamaConfig(**base)


def _qwen2_config(**kw):
    from transformers import Qwen2Config

    base = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
    base.update(kw)
    return Qwen2Config(**base)


def _names(msg: str, *numbers: int) -> None:
    for n in numbers:
        assert re.search(rf"(?<!\d){n}(?!\d)", msg), f"message does not name {n}: {msg}"


# ------------------------------------------------------------------ parallel layout


def test_parallel_config_error_is_value_error():
    assert issubclass(ParallelConfigError, ValueError)


def test_valid_layouts_pass():
    ParallelConfig(tp=2).validate(_llama_config(), world_size=4)
    ParallelConfig(tp=4).validate(_llama_config(), world_size=4)  # kv 2 replicated over 4 ranks
    ParallelConfig(tp=2, pp=2).validate(_llama_config(), world_size=8)
    ParallelConfig(tp=1).validate(_llama_config())


def test_heads_not_divisible_by_tp():
    # kv=2 divides tp=4 and intermediate 96 is divisible: the query heads are the only problem
    cfg = _llama_config(num_attention_heads=6, num_key_value_heads=2, hidden_size=48, intermediate_size=96)
    with pytest.raises(ParallelConfigError) as exc:
        ParallelConfig(tp=4).validate(cfg)
    msg = str(exc.value)
    assert "num_attention_heads" in msg
    _names(msg, 6, 4)


def test_kv_heads_and_tp_neither_divide():
    cfg = _llama_config(num_attention_heads=12, num_key_value_heads=3, hidden_size=48, intermediate_size=96)
    with pytest.raises(ParallelConfigError) as exc:
        ParallelConfig(tp=4).validate(cfg)
    msg = str(exc.value)
    assert "key_value" in msg or "kv" in msg.lower()
    _names(msg, 3, 4)


def test_intermediate_size_not_divisible():
    cfg = _llama_config(num_attention_heads=8, num_key_value_heads=8, hidden_size=64, intermediate_size=100)
    with pytest.raises(ParallelConfigError) as exc:
        ParallelConfig(tp=8).validate(cfg)
    msg = str(exc.value)
    assert "intermediate_size" in msg
    _names(msg, 100, 8)


@pytest.mark.parametrize("kw,world,product", [(dict(tp=4), 6, 4), (dict(tp=2, pp=2, cp=2), 12, 8),
                                              (dict(tp=2, cp=3), 4, 6)])
def test_world_size_not_divisible(kw, world, product):
    cfg = _llama_config(num_attention_heads=12, num_key_value_heads=12, hidden_size=48, intermediate_size=96,
                        num_hidden_layers=4)
    with pytest.raises(ParallelConfigError) as exc:
        ParallelConfig(**kw).validate(cfg, world_size=world)
    msg = str(exc.value)
    assert "world size" in msg
    _names(msg, world, product)


def test_sequence_parallel_needs_tp():
    with pytest.raises(ParallelConfigError, match="sequence_parallel"):
        ParallelConfig(tp=1, sequence_parallel=True).validate(_llama_config())
    ParallelConfig(tp=2, sequence_parallel=True).validate(_llama_config(), world_size=2)  # control


def test_vpp_without_pp():
    with pytest.raises(ParallelConfigError) as exc:
        ParallelConfig(vpp=2).validate(_llama_config())
    assert "vpp=2" in str(exc.value) and "pp" in str(exc.value)


def test_expert_parallel_with_dense_model():
    with pytest.raises(ParallelConfigError) as exc:
        ParallelConfig(ep=2).validate(_llama_config(), world_size=2)
    assert "ep=2" in str(exc.value)


def test_validate_accepts_our_model_config():
    cfg = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=6, head_dim=8)
    ParallelConfig(tp=3).validate(cfg, world_size=3)
    with pytest.raises(ParallelConfigError) as exc:
        ParallelConfig(tp=4).validate(cfg)
    _names(str(exc.value), 6, 4)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("err_qwen2"), "qwen2", _qwen2_config())


@pytest.fixture(scope="module")
def qwen2_dir_tp3(tmp_path_factory) -> Path:
    """A model every number of which tp=3 divides: only the missing process group can object."""
    cfg = _qwen2_config(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96)
    return write_hf_model(tmp_path_factory.mktemp("err_qwen2_tp3"), "qwen2_tp3", cfg)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("err_llama"), "llama", _llama_config())


@pytest.fixture
def no_process_groups(monkeypatch):
    """Make any attempt to create a process group fail loudly."""
    import models.common.builder as builder
    import parallel.groups as groups

    def forbidden(*a, **k):
        raise AssertionError("a process group was requested")

    monkeypatch.setattr(builder, "build_groups", forbidden)
    monkeypatch.setattr(groups, "build_groups", forbidden)
    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(dist, "new_group", forbidden)
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()


@pytest.mark.parametrize("which", ["qwen2_dir", "qwen2_dir_tp3"])
def test_build_with_tp3_without_distributed_raises_parallel_config_error(which, request, no_process_groups):
    from models.qwen2 import build_parallel_model

    path = request.getfixturevalue(which)
    with pytest.raises(ParallelConfigError) as exc:
        build_parallel_model(str(path), ParallelConfig(tp=3))
    _names(str(exc.value), 3)


def test_build_with_sequence_parallel_tp1_raises(qwen2_dir, no_process_groups):
    from models.qwen2 import build_parallel_model

    with pytest.raises(ParallelConfigError, match="sequence_parallel"):
        build_parallel_model(str(qwen2_dir), ParallelConfig(tp=1, sequence_parallel=True))


@pytest.mark.parametrize("kw,numbers", [
    (dict(pp=4), (2, 4)),  # 2 layers cannot fill 4 stages
    (dict(pp=2, vpp=2), (2, 4)),  # 2 layers over pp*vpp = 4 chunks
    (dict(pp=2, num_layers_in_first_pipeline_stage=2), (2,)),  # nothing left for the last stage
    (dict(pp=3, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=1), (2, 3)),
])
def test_invalid_stage_layout_raises_before_any_process_group(qwen2_dir, no_process_groups, kw, numbers):
    from models.qwen2 import build_parallel_model

    with pytest.raises(ParallelConfigError) as exc:
        build_parallel_model(str(qwen2_dir), ParallelConfig(**kw))
    _names(str(exc.value), *numbers)


# ------------------------------------------------------------------ long-context layouts


def test_long_context_layouts_pass():
    cfg = _llama_config(num_attention_heads=8, num_key_value_heads=2, hidden_size=64)
    ParallelConfig(cp=2, ulysses=2).validate(cfg, world_size=8)
    ParallelConfig(ulysses=8).validate(cfg, world_size=8)  # 2 KV heads repeated 4 times
    ParallelConfig(tp=2, ulysses=4).validate(cfg, world_size=8)  # 4 heads and 1 KV head per TP rank
    ParallelConfig(tp=2, sequence_parallel=True, cp=2, fsdp=True, recompute="full").validate(cfg, world_size=8)


@pytest.mark.parametrize("kw,cfg_kw,numbers,needle", [
    (dict(ulysses=4), dict(num_attention_heads=6, num_key_value_heads=6, hidden_size=48), (6, 4), "ulysses"),
    (dict(tp=2, ulysses=4), dict(num_attention_heads=4, num_key_value_heads=4), (2, 4), "ulysses"),
    (dict(ulysses=2), dict(num_attention_heads=12, num_key_value_heads=3, hidden_size=48), (3, 2), "KV heads"),
    (dict(ulysses=2, cp=2), dict(), (6, 4), "world size"),
])
def test_invalid_long_context_layouts(kw, cfg_kw, numbers, needle):
    with pytest.raises(ParallelConfigError) as exc:
        ParallelConfig(**kw).validate(_llama_config(**cfg_kw), world_size=6 if needle == "world size" else None)
    msg = str(exc.value)
    assert needle in msg, msg
    _names(msg, *numbers)


@pytest.mark.parametrize("kw,needle", [(dict(cp=2, cp_comm="p2p"), "cp_comm"),
                                       (dict(recompute="selective"), "recompute"),
                                       (dict(fsdp=True, pp=2), "fsdp"), (dict(ulysses=0), "ulysses"),
                                       (dict(ep=2, ulysses=2), "ulysses=2"), (dict(fsdp="yes"), "fsdp")])
def test_invalid_long_context_options(kw, needle):
    with pytest.raises(ParallelConfigError, match=needle):
        ParallelConfig(**kw)


@pytest.mark.parametrize("kw,numbers", [(dict(cp=2), (1, 2)), (dict(ulysses=3), (3,)), (dict(cp=2, ulysses=2), (1, 4))])
def test_long_context_build_without_distributed_raises_before_any_process_group(qwen2_dir, no_process_groups, kw,
                                                                              numbers):
    from models.qwen2 import build_parallel_model

    with pytest.raises(ParallelConfigError) as exc:
        build_parallel_model(str(qwen2_dir), ParallelConfig(**kw))
    _names(str(exc.value), *numbers)


# ------------------------------------------------------------------ checkpoints
# Every damaged-checkpoint test also requests ``no_process_groups``: the builder promises to check
# config and safetensors headers (presence and shape of every tensor) before any group is created.


@pytest.fixture
def copy_of(qwen2_dir, tmp_path):
    def make() -> Path:
        dst = tmp_path / "ckpt"
        shutil.copytree(qwen2_dir, dst)
        return dst

    return make


def _build(path):
    from models.qwen2 import build_parallel_model

    return build_parallel_model(str(path))


def _raises_naming(path, *needles):
    with pytest.raises(CheckpointError) as exc:
        _build(path)
    msg = str(exc.value)
    for needle in needles:
        assert str(needle) in msg, f"{needle!r} not in message: {msg}"
    return msg


def test_checkpoint_error_is_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_clean_copy_builds(copy_of):
    _build(copy_of())  # control: the damage below is what fails, not the copying


def test_missing_directory(tmp_path, no_process_groups):
    path = tmp_path / "does_not_exist"
    _raises_naming(path, path)


def test_no_config_json(copy_of, no_process_groups):
    path = copy_of()
    (path / "config.json").unlink()
    _raises_naming(path, path, "config.json")


def test_config_json_not_json(copy_of, no_process_groups):
    path = copy_of()
    (path / "config.json").write_text('{"model_type": "qwen2", "vocab_size": ')
    _raises_naming(path, path / "config.json")


def test_no_safetensors_file(copy_of, no_process_groups):
    path = copy_of()
    (path / "model.safetensors").unlink()
    _raises_naming(path, path, "model.safetensors")


def test_truncated_safetensors(copy_of, no_process_groups):
    path = copy_of()
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    _raises_naming(path, f)


def test_corrupt_header_length(copy_of, no_process_groups):
    path = copy_of()
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[:8] = (2**62).to_bytes(8, "little")
    f.write_bytes(bytes(data))
    _raises_naming(path, f)


def test_empty_safetensors_file(copy_of, no_process_groups):
    path = copy_of()
    f = path / "model.safetensors"
    f.write_bytes(b"")
    _raises_naming(path, f)


def test_garbage_header_bytes(copy_of, no_process_groups):
    path = copy_of()
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"\xff" * 12  # header length intact, header text not UTF-8 JSON
    f.write_bytes(bytes(data))
    _raises_naming(path, f)


def _rewrite(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    state = load_file(str(f))
    edit(state)
    save_file(state, str(f), metadata={"format": "pt"})


def test_missing_tensor_named(copy_of, no_process_groups):
    path = copy_of()
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(path, lambda s: s.pop(name))
    _raises_naming(path, name, "missing")


def test_wrong_shape_tensor_named(copy_of, no_process_groups):
    path = copy_of()
    name = "model.layers.0.mlp.down_proj.weight"

    def edit(state):
        state[name] = torch.zeros(state[name].shape[0], state[name].shape[1] + 1)

    _rewrite(path, edit)
    _raises_naming(path, name, "shape")


def test_unexpected_extra_tensor_named(copy_of, no_process_groups):
    path = copy_of()
    name = "model.layers.0.self_attn.extra_proj.weight"

    def edit(state):
        state[name] = torch.zeros(4, 4)

    _rewrite(path, edit)
    _raises_naming(path, name)


def _save_sharded(src: Path, dst: Path) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.save_pretrained(str(dst), max_shard_size="20KB")
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(files) > 2 and (dst / "model.safetensors.index.json").exists(), files
    assert not (dst / "model.safetensors").exists()
    return dst


def test_sharded_checkpoint_missing_shard(qwen2_dir, tmp_path, no_process_groups):
    path = _save_sharded(qwen2_dir, tmp_path / "sharded")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    victim = sorted(set(weight_map.values()))[1]
    (path / victim).unlink()
    _raises_naming(path, victim)


def test_sharded_checkpoint_unreadable_index(qwen2_dir, tmp_path, no_process_groups):
    path = _save_sharded(qwen2_dir, tmp_path / "sharded")
    (path / "model.safetensors.index.json").write_text('{"weight_map": ')
    _raises_naming(path, "model.safetensors.index.json")


def test_sharded_index_points_to_wrong_file(qwen2_dir, tmp_path, no_process_groups):
    path = _save_sharded(qwen2_dir, tmp_path / "sharded")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = "model.layers.0.mlp.up_proj.weight"
    files = sorted(set(index["weight_map"].values()))
    wrong = next(f for f in files if f != index["weight_map"][name])
    index["weight_map"][name] = wrong
    index_file.write_text(json.dumps(index))
    _raises_naming(path, name, wrong)


def test_sharded_checkpoint_loads_like_transformers(qwen2_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    path = _save_sharded(qwen2_dir, tmp_path / "sharded")
    ours = _build(path).eval()
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = ours(ids).logits
        want = ref(ids).logits
    assert got.shape == want.shape == (2, 9, 101)
    assert (got - want).abs().max().item() <= 1e-5


def test_wrong_model_type(llama_dir, no_process_groups):
    with pytest.raises(CheckpointError) as exc:
        _build(llama_dir)
    msg = str(exc.value)
    assert "llama" in msg and "qwen2" in msg
    assert str(llama_dir) in msg


def _edit_header(path: Path, edit) -> None:
    """Rewrite model.safetensors' JSON header in place (same data bytes)."""
    import struct

    f = path / "model.safetensors"
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * max(0, n - len(new))  # keep the data offset when the header shrank
    assert len(new) == n, "test helper: edited header must not grow"
    f.write_bytes(struct.pack("<Q", n) + new + raw[8 + n:])


@pytest.mark.parametrize("damage,needle", [
    ("index_not_a_dict", "model.safetensors.index.json"),
    ("entry_without_shape", "model.norm.weight"),
    ("entry_with_unknown_dtype", "model.norm.weight"),
    ("config_without_model_type", "config.json"),
    ("config_unknown_model_type", "config.json"),
])
def test_malformed_metadata_is_a_checkpoint_error(copy_of, no_process_groups, damage, needle):
    copy_of = copy_of()
    if damage == "index_not_a_dict":
        (copy_of / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1]}))
    elif damage == "entry_without_shape":
        _edit_header(copy_of, lambda h: h["model.norm.weight"].pop("shape"))
    elif damage == "entry_with_unknown_dtype":
        _edit_header(copy_of, lambda h: h["model.norm.weight"].update(dtype="XX"))
    elif damage == "config_without_model_type":
        (copy_of / "config.json").write_text("{}")
    else:
        (copy_of / "config.json").write_text(json.dumps({"model_type": "nonexistent_arch"}))
    _raises_naming(copy_of, needle)
