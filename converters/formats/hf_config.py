"""HF ``config.json`` as plain data: read, built from Megatron args, written — without transformers.

Importing transformers' config classes costs ~85 MiB and ~1.5 s (it pulls in torch._dynamo); a
converter only needs the JSON. ``HFConfig`` gives attribute access over the dict (missing keys read
as None, the architectures' defaults apply in ``models/*/config.py``), and the JSON written is what
transformers' ``save_pretrained`` writes for the fields that matter, so ``from_pretrained`` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from models.common.errors import CheckpointError
from models.common.hf_files import copy_companion_files, read_config_json

ARCHITECTURE_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                      "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                      "qwen3_next": "Qwen3NextForCausalLM"}

# Conditional-generation model types whose transformers config reads the text model only from ``text_config``
# (top-level text fields are ignored there: transformers would build the text model from its defaults)
NESTED_TEXT_CONFIG = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# ... whose transformers model (5.24) ties the LM head by the top-level ``tie_word_embeddings`` alone, where
# ``models/common/vision/config.text_and_vision_sections`` reads either place (checked for Qwen3-VL). Not
# Qwen3-VL-MoE: its ``text_config`` flag defaults to (and is saved as) true in untied checkpoints too, and its
# model config reads the top-level flag alone (``models/qwen3_vl_moe/config.py``), as transformers does
TOP_LEVEL_TIE = ("qwen3_vl",)


class HFConfig:
    """Attribute view of a config.json dict (absent keys -> None); ``source_dir``: the HF directory it
    was read from (None when built from Megatron args), whose files ``write_config_dir`` keeps."""

    def __init__(self, data: dict[str, Any], source_dir: str | None = None) -> None:
        self.__dict__["data"] = dict(data)
        self.__dict__["source_dir"] = source_dir

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.__dict__["data"].get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__["data"][name] = value

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__["data"])

    def save(self, directory: str | Path, dtype: Any = None) -> None:
        """``config.json``; ``dtype`` (a torch dtype or its name, "bfloat16") sets ``dtype`` (transformers 5's
        key; an older config's ``torch_dtype`` is updated too, never added)."""
        data = self.to_dict()
        if dtype is not None:
            data["dtype"] = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
            if "torch_dtype" in data:
                data["torch_dtype"] = data["dtype"]
        Path(directory, "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_config_dir(config: HFConfig, directory: str | Path, dtype: str | None = None) -> None:
    """``config.json`` and the files users ship beside it (``generation_config.json``, tokenizer files,
    chat template: ``models/common/hf_files.COMPANION_SUFFIXES``) into ``directory``.

    From a config read from an HF directory, the files are copied byte for byte, config.json too
    unless the tensors written are in another dtype than the one it records (``dtype``: the torch
    dtype name of the written tensors; None: not an HF model directory, e.g. the ``hf_config/``
    sidecar of a Megatron checkpoint, whose args record the dtype). So HF -> Megatron -> HF gives
    back config.json and every tokenizer file unchanged. A config built from Megatron args is
    written as transformers writes it for that model (``transformers_config``)."""
    import shutil

    source = config.source_dir
    if source is None:  # derived from Megatron args (config_from_fields: transformers' defaults filled in)
        config.save(directory, dtype)
        return
    copy_companion_files(source, directory)
    recorded = config.data.get("dtype") or config.data.get("torch_dtype") or "float32"  # transformers' default
    if dtype is None or dtype == recorded:
        shutil.copyfile(Path(source) / "config.json", Path(directory) / "config.json")  # mode from the umask
    else:
        config.save(directory, dtype)


def read_hf_config(directory: str | Path) -> HFConfig:
    """config.json of an HF directory; CheckpointError naming the file when missing or malformed."""
    path = Path(directory) / "config.json"
    data = read_config_json(directory)
    # vision-language configs of transformers 5 keep the text model's fields in text_config
    text, where = (data["text_config"], "text_config.") if isinstance(data.get("text_config"), dict) else (data, "")
    if not where and data.get("model_type") in NESTED_TEXT_CONFIG:  # top-level text fields are not read there
        found = f"text_config must be an object, found {data['text_config']!r}" if "text_config" in data \
            else "no text_config"
        raise CheckpointError(f"{path}: {found}: a {data['model_type']!r} config (conditional generation) keeps the "
                              f"text model's fields (hidden_size, num_hidden_layers, ...) there and transformers reads "
                              f"them nowhere else")
    top_tie = data.get("tie_word_embeddings")
    if data.get("model_type") in TOP_LEVEL_TIE and text.get("tie_word_embeddings") and not top_tie:
        raise CheckpointError(f"{path}: tie_word_embeddings={top_tie!r} but text_config.tie_word_embeddings=true: "
                              f"transformers 5 ties a {data['model_type']!r} model's head by the top-level flag only "
                              f"(an untied lm_head here), pmz's model config by either; refused rather than read "
                              f"another model (set both to the same value)")
    # a mixture-of-experts model may have no dense MLP width at all (Qwen3.5-MoE)
    dense = () if text.get("intermediate_size") is None and text.get("num_experts") else ("intermediate_size",)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", *dense):
        if not isinstance(text.get(key), int) or text[key] <= 0:
            raise CheckpointError(f"{path}: '{where}{key}' must be a positive integer, found {text.get(key)!r}")
    return HFConfig(data, str(directory))


def check_config_against_tensors(config_path: str | Path, cfg: Any, wmap: Any, shapes: Mapping[str, Sequence[int]],
                                 files: Mapping[str, str] | None = None) -> None:
    """The sizes of ``config.json`` against the tensors actually present, before anything sized by the
    config (per-layer shape tables, layouts) is built: a config claiming 10^9 layers or a huge hidden
    size must fail here, not run out of memory.

    ``cfg`` is the model config (``num_hidden_layers``, ``vocab_size``, ``hidden_size``), ``wmap``
    its weight map (layer name templates, embedding name), ``shapes`` the tensors of the checkpoint
    (name -> shape) and ``files`` optionally the file holding each one. CheckpointError names
    ``config_path``, the numbers and the file.
    """
    if wmap.layer_entries:
        prefix = wmap.layer_entries[0].hf[0].split("{i}")[0]  # "model.layers."
        check_block_count(config_path, "num_hidden_layers", cfg.num_hidden_layers, prefix, shapes)
    embed = wmap.first_entries[0].hf[0] if wmap.first_entries else None
    if embed in shapes and tuple(shapes[embed]) != (cfg.vocab_size, cfg.hidden_size):
        where = f" in {files[embed]}" if files and embed in files else ""
        raise CheckpointError(f"{config_path}: vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}, but "
                              f"{embed}{where} has shape {tuple(shapes[embed])}")


def check_block_count(config_path: str | Path, field: str, count: int, prefix: str,
                      shapes: Mapping[str, Sequence[int]]) -> None:
    """``count`` blocks named ``prefix<N>.*`` (N = 0 .. count - 1) must be what ``shapes`` holds."""
    found = {int(i) for i in (n[len(prefix):].split(".", 1)[0] for n in shapes if n.startswith(prefix))
             if i.isdigit()}
    if len(found) != count or (found and max(found) != count - 1):
        raise CheckpointError(f"{config_path}: {field}={count}, but the weights hold {_describe_layers(found, prefix)}")


def _describe_layers(layers: set[int], prefix: str) -> str:
    if not layers:
        return f"no {prefix}* tensors"
    ordered = sorted(layers)
    runs, start = [], ordered[0]
    for a, b in zip(ordered, ordered[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}..{a}")
            start = b
    shown = ", ".join(runs[:6]) + (", ..." if len(runs) > 6 else "")
    return f"{len(layers)} layer(s) ({prefix}{shown})"


# What transformers' save_pretrained writes for each model type beyond the fields Megatron args give
# (transformers 5's defaults and derived fields; tests/test_convert_roundtrip.py compares a config
# rebuilt from Megatron args with transformers' own, key for key, for every architecture).
_TOKEN_IDS = {"llama": (1, 2)}  # (bos, eos); the Qwen families leave them unset (None)
_WINDOW_FIELDS = {"qwen2": None, "qwen2_moe": 0, "qwen3": None, "qwen3_moe": None}  # sliding_window when unused
_LAYER_TYPES = ("qwen2", "qwen2_moe", "qwen3")  # configs that list every layer's attention (max_window_layers 28)


def config_from_fields(model_type: str, **fields: Any) -> HFConfig:
    """A complete config.json, as transformers writes it for this model type, from its fields (used for
    Megatron sources without an HF config beside them)."""
    base: dict[str, Any] = {"architectures": [ARCHITECTURE_CLASS[model_type]], "model_type": model_type,
                            "hidden_act": "silu", "initializer_range": 0.02, "use_cache": True,
                            "attention_dropout": 0.0}
    bos, eos = _TOKEN_IDS.get(model_type, (None, None))
    base.update(bos_token_id=bos, eos_token_id=eos, pad_token_id=None)
    if model_type == "llama":
        base.update(pretraining_tp=1, attention_bias=False, mlp_bias=False)
    else:
        base.update(use_sliding_window=False, sliding_window=_WINDOW_FIELDS.get(model_type))
    if model_type == "qwen3_moe":
        base.update(attention_bias=False)
    base.update(fields)
    layers = int(base["num_hidden_layers"])
    if model_type in _LAYER_TYPES:
        base.update(max_window_layers=28, layer_types=["full_attention"] * layers)
    if model_type == "qwen3_moe" and "num_experts" in base:  # transformers' attribute for it
        base["num_local_experts"] = base.pop("num_experts")
    if model_type in ("qwen2", "qwen2_moe") and base.get("head_dim") == base["hidden_size"] // base[
            "num_attention_heads"]:
        base.pop("head_dim")  # these configs derive it
    base["rope_parameters"] = base.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0}
    version = _transformers_version()
    if version:
        base["transformers_version"] = version
    return HFConfig(base)


def _transformers_version() -> str | None:
    """The installed transformers' version, read from its package metadata (transformers not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None
