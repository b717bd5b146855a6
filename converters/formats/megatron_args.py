"""Megatron checkpoint directories and ``args``: trackers, iterations, rank folders, model configs.

Shared by the legacy (``torch``) and ``torch_dist`` readers and writers (reading and writing side
by side: ``read_tracker`` / ``iteration_folder``, ``hf_config_from_args`` / ``target_arg_fields``):

  <root>/latest_checkpointed_iteration.txt   an integer, or "release"
  <root>/iter_{it:07d}/  or  <root>/release/
      legacy:     mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt
      torch_dist: metadata.json, .metadata, __*_*.distcp, common.pt

``args`` (Megatron-LM's argparse namespace) becomes a transformers config for the architecture
(``llama``: no qkv bias; ``qwen2``: ``add_qkv_bias``), or ``--hf-config`` supplies it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from converters.formats.hf_config import HFConfig, config_from_fields, read_hf_config
from converters.formats.megatron_hybrid import (
    MODEL_TYPES,
    hybrid_arg_fields,
    hybrid_hf_config,
    hybrid_mismatches,
    hybrid_model_type,
    is_hybrid_args,
)
from converters.formats.megatron_moe import (
    arg_value,
    check_hf_against_args,
    moe_arg_fields,
    moe_hf_fields,
    num_experts_of,
)
from models.common.config import UnsupportedConfigError
from models.common.errors import CheckpointError
from models.common.hf_files import read_bounded

TRACKER = "latest_checkpointed_iteration.txt"
MAX_TRACKER_BYTES = 4096  # a tracker holds one number or "release"
HF_CONFIG_DIR = "hf_config"  # written by our converters beside the iterations; read back when present
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def resolve_iteration_dir(path: Path) -> Path:
    """The folder holding one iteration: ``path`` itself, or what its tracker file names."""
    tracker = path / TRACKER
    if not tracker.exists():
        return path
    text = read_tracker(tracker)
    if text == "release":
        it_dir = path / "release"
    else:
        it_dir = path / f"iter_{tracker_step(tracker, text):07d}"
    if not it_dir.is_dir():
        raise CheckpointError(f"{tracker} names {it_dir.name}, but {it_dir} does not exist")
    return it_dir


def read_tracker(tracker: Path) -> str:
    """The stripped text of a ``latest_checkpointed_iteration.txt``; CheckpointError naming the file
    when it cannot be read or is not text (a binary or truncated file, another encoding)."""
    raw = read_bounded(tracker, MAX_TRACKER_BYTES, "expected an iteration number or 'release'")
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{tracker}: not a text file (byte 0x{raw[exc.start]:02x} at offset {exc.start} is not "
                              f"UTF-8); expected an iteration number or 'release'") from exc


def tracker_step(tracker: Path, text: str) -> int:
    """The iteration / step number a tracker's text names (CheckpointError naming the file otherwise)."""
    try:
        step = int(text)
    except ValueError:
        step = -1
    if step < 0:
        shown = repr(text[:40]) + ("..." if len(text) > 40 else "")
        raise CheckpointError(f"{tracker}: expected an iteration number or 'release', found {shown}")
    return step


def iteration_folder(root: Path, iteration: int | None) -> Path:
    """Writing: ``iter_XXXXXXX`` for a known iteration, ``release`` otherwise, created under ``root``
    with the tracker file naming it."""
    name = f"iter_{iteration:07d}" if iteration is not None else "release"
    (root / TRACKER).write_text(str(iteration) if iteration is not None else "release")
    folder = root / name
    folder.mkdir()
    return folder


# Args read as integers (None: unset) and as numbers; the rest is read as switches and names only.
INT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "expert_model_parallel_size", "expert_tensor_parallel_size", "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "num_query_groups", "kv_channels", "vocab_size", "padded_vocab_size", "max_position_embeddings",
            "seq_length", "iteration", "num_experts", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
            "moe_shared_expert_intermediate_size", "make_vocab_size_divisible_by")
FLOAT_ARGS = ("norm_epsilon", "rotary_base", "rope_scaling_factor", "moe_aux_loss_coeff")
REQUIRED_ARGS = ("num_layers", "hidden_size", "num_attention_heads")


def describe(value: Any) -> str:
    """A short description of an untrusted value: a scalar's repr (cut short), else its type only
    (never the repr of a container, which a pickle's shared references can make exponentially long)."""
    if value is None or isinstance(value, (bool, int, float)):
        text = repr(value)
        return text if len(text) <= 40 else text[:40] + "..."
    if isinstance(value, str):
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    return f"a {getattr(value, '_qualname', None) or type(value).__name__} object"


def check_args(args: Any, where: str) -> None:
    """Megatron args as data: Megatron-LM's ``argparse.Namespace`` whose sizes and layout fields are
    integers and numeric fields numbers (or unset); CheckpointError naming ``where`` (the file) and
    the field otherwise. A payload pickled in place of the args is refused here instead of being
    read as an empty namespace (every field at its default)."""
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{where}: 'args' is {describe(args)}, not Megatron-LM's argparse.Namespace")
    for name in REQUIRED_ARGS:
        value = getattr(args, name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            shown = "missing" if value is None else describe(value)
            raise CheckpointError(f"{where}: args.{name} is {shown}, not a positive integer (Megatron-LM always "
                                  f"records it)")
    for name in INT_ARGS:
        value = getattr(args, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise CheckpointError(f"{where}: args.{name} is {describe(value)}, not a non-negative integer")
    for name in FLOAT_ARGS:
        value = getattr(args, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise CheckpointError(f"{where}: args.{name} is {describe(value)}, not a number")


def legacy_rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    name = f"mp_rank_{tp_rank:02d}"
    if pp > 1:
        name += f"_{pp_rank:03d}"
    if ep > 1:
        name += f"_{ep_rank:03d}"
    return name


def args_layout(args: Any) -> dict[str, int]:
    """tp/pp/vpp/ep and uneven-stage counts recorded in Megatron args."""
    return {
        "tp": int(arg_value(args, "tensor_model_parallel_size", 1)),
        "pp": int(arg_value(args, "pipeline_model_parallel_size", 1)),
        "vpp": int(arg_value(args, "virtual_pipeline_model_parallel_size", 1) or 1),
        "ep": int(arg_value(args, "expert_model_parallel_size", 1)),
        "first": arg_value(args, "decoder_first_pipeline_num_layers"),
        "last": arg_value(args, "decoder_last_pipeline_num_layers"),
    }


def detect_arch(args: Any, where: str) -> str:
    """llama, qwen2, qwen2_moe, qwen3 or qwen3_moe from the args' switches (``qk_layernorm``: Qwen3's
    per-head q/k RMSNorm); UnsupportedConfigError for anything else."""
    problems = []
    if arg_value(args, "normalization", "LayerNorm") != "RMSNorm":
        problems.append(f"normalization={arg_value(args, 'normalization', 'LayerNorm')}")
    if not arg_value(args, "swiglu", False):
        problems.append("swiglu=False")
    if arg_value(args, "position_embedding_type", "learned_absolute") != "rope":
        problems.append(f"position_embedding_type={arg_value(args, 'position_embedding_type')}")
    if problems:
        raise UnsupportedConfigError(f"{where}: unknown architecture: Megatron args with {', '.join(problems)} "
                                     f"match neither llama nor qwen2 (pass --arch to force)")
    qkv_bias, all_bias = arg_value(args, "add_qkv_bias", False), arg_value(args, "add_bias_linear", False)
    if arg_value(args, "qk_layernorm", False):  # Qwen3 / Qwen3-MoE: q/k norms, no linear biases
        if qkv_bias or all_bias:
            raise UnsupportedConfigError(f"{where}: Megatron args with qk_layernorm and add_qkv_bias={bool(qkv_bias)}, "
                                         f"add_bias_linear={bool(all_bias)}: not a Qwen3 model Megatron can hold "
                                         f"(Qwen3's attention_bias puts a bias on q/k/v and o_proj only)")
        return "qwen3_moe" if num_experts_of(args) else "qwen3"
    if num_experts_of(args):
        # Qwen2-MoE (Qwen3-MoE above); router options are checked when read
        if not arg_value(args, "add_qkv_bias", False):
            raise UnsupportedConfigError(f"{where}: Megatron MoE args without add_qkv_bias: not a Qwen2-MoE model "
                                         f"(the only mixture-of-experts architecture supported)")
        return "qwen2_moe"
    # add_bias_linear puts a bias on every linear layer: Llama with attention_bias and mlp_bias.
    if arg_value(args, "add_qkv_bias", False) and not arg_value(args, "add_bias_linear", False):
        return "qwen2"
    return "llama"


def sidecar_config_dir(where: str) -> str | None:
    """The ``hf_config/`` folder our converters write beside a Megatron checkpoint's iterations
    (config.json, generation config, tokenizer files), None when there is none."""
    root = Path(where)
    for candidate in (root / HF_CONFIG_DIR, root.parent / HF_CONFIG_DIR):
        if (candidate / "config.json").is_file():
            return str(candidate)
    return None


def hf_config_from_args(args: Any, *, arch: str | None, hf_config_dir: str | None, vocab_size: int | None,
                        where: str) -> Any:
    """The transformers config of a Megatron checkpoint (``--hf-config`` wins over args)."""
    if not hf_config_dir and not arch and not vocab_size:
        hf_config_dir = sidecar_config_dir(where)
    if hf_config_dir:
        config = read_hf_config(hf_config_dir)
        _check_against_args(config, args, where, hf_config_dir)
        return config
    arch = arch or (None if is_hybrid_args(args) else detect_arch(args, where))
    vocab = vocab_size or arg_value(args, "vocab_size")
    if not vocab:
        raise CheckpointError(f"{where}: the checkpoint records only the padded vocab "
                              f"({arg_value(args, 'padded_vocab_size')}); pass --hf-config DIR or --vocab-size N")
    heads = int(args.num_attention_heads)
    grouped = arg_value(args, "group_query_attention", False)
    groups = int(arg_value(args, "num_query_groups", heads)) if grouped else heads
    common = dict(
        vocab_size=int(vocab),
        hidden_size=int(args.hidden_size),
        intermediate_size=int(arg_value(args, "ffn_hidden_size", 4 * args.hidden_size)),
        num_hidden_layers=int(args.num_layers),
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=int(arg_value(args, "kv_channels", args.hidden_size // heads)),
        max_position_embeddings=int(arg_value(args, "max_position_embeddings", arg_value(args, "seq_length", 4096))),
        rms_norm_eps=float(arg_value(args, "norm_epsilon", 1e-5)),
        tie_word_embeddings=not arg_value(args, "untie_embeddings_and_output_weights", False),
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(arg_value(args, "rotary_base", 10000))}
    if arg_value(args, "use_rope_scaling", False):
        rope = {"rope_type": "llama3", "rope_theta": rope["rope_theta"],
                "factor": float(arg_value(args, "rope_scaling_factor", 8.0)), "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if is_hybrid_args(args) or arch in MODEL_TYPES:  # Gated DeltaNet hybrids (converters/formats/megatron_hybrid)
        if not is_hybrid_args(args):
            variant = arg_value(args, "experimental_attention_variant")
            raise CheckpointError(f"{where}: --arch {arch}, but the Megatron args have no Gated DeltaNet layers "
                                  f"(experimental_attention_variant={variant!r})")
        return conditional_generation_config(args, hybrid_hf_config(args, common, hybrid_model_type(args, arch, where),
                                                                    where))
    if arch == "qwen2":
        return config_from_fields("qwen2", **common, rope_parameters=rope)
    if arch in ("qwen2_moe", "qwen3_moe"):
        if not num_experts_of(args):
            raise CheckpointError(f"{where}: --arch {arch}, but the Megatron args have no num_experts")
        moe = moe_hf_fields(args, common["num_hidden_layers"], common["intermediate_size"], where, arch=arch)
        return conditional_generation_config(args, config_from_fields(arch, **common, **moe, rope_parameters=rope))
    if arch == "qwen3":  # (Qwen3-VL: its text model, inside the conditional-generation config the args record)
        return conditional_generation_config(args, config_from_fields("qwen3", **common, rope_parameters=rope,
                                                                      attention_bias=False))
    if arch == "llama":
        all_bias = bool(arg_value(args, "add_bias_linear", False))
        if arg_value(args, "add_qkv_bias", False) and not all_bias:
            raise UnsupportedConfigError(f"{where}: --arch llama cannot hold a bias on q/k/v only (that is qwen2)")
        return config_from_fields("llama", **common, rope_parameters=rope, attention_bias=all_bias, mlp_bias=all_bias)
    raise CheckpointError(f"{where}: unknown architecture {arch!r} (supported: llama, qwen2, qwen2_moe, qwen3, "
                          f"qwen3_moe)")


def _check_against_args(config: Any, args: Any, where: str, hf_dir: str) -> None:
    """An HF config (``--hf-config`` or the ``hf_config/`` sidecar) must describe the model the args do (a
    conditional-generation config through its ``text_config``)."""
    recorded = arg_value(args, CONDITIONAL_GENERATION)
    if (recorded is not None) != (getattr(config, "text_config", None) is not None) and is_hybrid_args(args):
        kinds = ("conditional-generation", "text") if recorded else ("text", "conditional-generation")
        raise CheckpointError(f"{where}: the Megatron args describe a {kinds[0]} model, the HF config at {hf_dir} a "
                              f"{kinds[1]} one (text_config, vision_config)")
    top, config = config, _text_view(config)
    hybrid = getattr(config, "model_type", None) in MODEL_TYPES.values()
    if is_hybrid_args(args) and not hybrid:
        raise CheckpointError(f"{where}: the Megatron args describe a Gated DeltaNet hybrid (experimental_attention_"
                              f"variant='gated_delta_net'), the HF config at {hf_dir} a "
                              f"{getattr(config, 'model_type', None)} model")
    detected = None if hybrid else detect_arch(args, where)
    if not hybrid and detected != QWEN3_VL_TEXT.get(getattr(config, "model_type", None),
                                                    getattr(config, "model_type", None)):
        raise CheckpointError(f"{where}: the Megatron args describe a {detected} model, the HF config at {hf_dir} "
                              f"a {getattr(config, 'model_type', None)} model")
    heads = getattr(args, "num_attention_heads", None)
    groups = arg_value(args, "num_query_groups", heads) if arg_value(args, "group_query_attention", False) else heads
    pairs = [("num_hidden_layers", arg_value(args, "num_layers"), "num_layers"),
             ("hidden_size", arg_value(args, "hidden_size"), "hidden_size"),
             ("num_attention_heads", heads, "num_attention_heads"),
             ("intermediate_size", arg_value(args, "ffn_hidden_size"), "ffn_hidden_size"),
             ("num_key_value_heads", groups, "num_query_groups"),
             ("head_dim", arg_value(args, "kv_channels"), "kv_channels"),
             ("vocab_size", arg_value(args, "vocab_size"), "vocab_size")]
    bad = []
    for h, value, m in pairs:
        ours = getattr(config, h, None)
        if h == "head_dim" and ours is None and heads:
            ours = config.hidden_size // config.num_attention_heads
        if value is not None and ours is not None and ours != value:
            bad.append(f"{h}={ours} vs {m}={value}")
    if detected in ("qwen2_moe", "qwen3_moe"):
        bad += check_hf_against_args(config, args, where, hf_dir, arch=detected)
    if hybrid:
        from converters.layout.model import architecture_for

        cfg = architecture_for(config.model_type, hf_dir).model_config(config)
        bad += hybrid_mismatches(config, cfg, args, where, hf_dir)
        if top is not config and getattr(top, "tie_word_embeddings", False) == arg_value(
                args, "untie_embeddings_and_output_weights"):
            bad.append(f"tie_word_embeddings={getattr(top, 'tie_word_embeddings', False)} vs untie_embeddings_and_"
                       f"output_weights={arg_value(args, 'untie_embeddings_and_output_weights')}")
    padded = arg_value(args, "padded_vocab_size")
    if padded is not None and getattr(config, "vocab_size", 0) > padded:
        bad.append(f"vocab_size={config.vocab_size} exceeds the checkpoint's padded vocab {padded}")
    if bad:
        raise CheckpointError(f"{where}: HF config {hf_dir} does not match the checkpoint: {'; '.join(bad)}")


def args_for_target(hf_config: Any, cfg, *, tp: int, pp: int, vpp: int, padded_vocab: int, dtype, fmt: str,
                    divisible_by: int, first: int | None = None, last: int | None = None,
                    ep: int = 1, grouped_gemm: bool = False, mtp_layers: int = 0) -> argparse.Namespace:
    """Megatron-LM-style args for a checkpoint we write (what our readers and Megatron-LM read back)."""
    import torch

    fields = target_arg_fields(hf_config, cfg, tp=tp, pp=pp, vpp=vpp, padded_vocab=padded_vocab,
                               dtype_name=str(dtype).removeprefix("torch."), fmt=fmt, divisible_by=divisible_by,
                               first=first, last=last, ep=ep, grouped_gemm=grouped_gemm, mtp_layers=mtp_layers)
    return argparse.Namespace(**{**fields, "params_dtype": getattr(torch, fields["params_dtype"])})


def target_arg_fields(hf_config: Any, cfg, *, tp: int, pp: int, vpp: int, padded_vocab: int, dtype_name: str,
                      fmt: str, divisible_by: int, first: int | None = None, last: int | None = None,
                      ep: int = 1, grouped_gemm: bool = False, mtp_layers: int = 0) -> dict:
    """The fields of ``args_for_target`` without torch: ``params_dtype`` is the dtype's name
    (``"bfloat16"``); the torch-free writers pickle it as ``torch.bfloat16``. A Gated DeltaNet hybrid's
    add ``megatron_hybrid.hybrid_arg_fields`` (``mtp_layers``: the MTP layers written)."""
    if not (cfg.o_bias == cfg.mlp_bias and (cfg.qkv_bias or not cfg.o_bias)):
        raise UnsupportedConfigError(
            f"Megatron has one switch for all linear biases (add_bias_linear) plus add_qkv_bias; this model has "
            f"qkv_bias={cfg.qkv_bias}, o_proj bias={cfg.o_bias}, mlp bias={cfg.mlp_bias}, which it cannot express")
    fields = dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
        group_query_attention=cfg.num_key_value_heads != cfg.num_attention_heads, kv_channels=cfg.head_dim,
        padded_vocab_size=padded_vocab, vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=divisible_by,
        max_position_embeddings=cfg.max_position_embeddings, seq_length=min(cfg.max_position_embeddings, 4096),
        norm_epsilon=cfg.rms_norm_eps, normalization="RMSNorm", rotary_base=cfg.rope.theta, rotary_percent=1.0,
        use_rope_scaling=cfg.rope.rope_type == "llama3", rope_scaling_factor=cfg.rope.factor,
        position_embedding_type="rope", swiglu=True, add_bias_linear=cfg.o_bias, add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_norm,
        untie_embeddings_and_output_weights=not cfg.tie_word_embeddings,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, expert_model_parallel_size=1,
        decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
        num_experts=None, params_dtype=dtype_name, bf16=dtype_name == "bfloat16", fp16=dtype_name == "float16",
        ckpt_format=fmt, use_dist_ckpt=fmt != "torch", transformer_impl="local",
        hf_model_type=getattr(hf_config, "model_type", None),
    )
    if cfg.moe is not None:
        fields.update(moe_arg_fields(cfg, tp=tp, ep=ep, grouped_gemm=grouped_gemm))
    if getattr(cfg, "linear_num_key_heads", 0) or getattr(hf_config, "model_type", None) in MODEL_TYPES.values():
        fields.update(hybrid_arg_fields(cfg, mtp_layers))
    qwen3_vl = getattr(_text_view(hf_config), "model_type", None) in QWEN3_VL_TEXT
    if qwen3_vl and fmt == "torch_dist":  # the only model that loads it, Bridge's Qwen3VLModel, is TE-only
        fields["transformer_impl"] = "transformer_engine"
    if (getattr(cfg, "carried", ()) or qwen3_vl) and getattr(hf_config, "text_config", None) is not None:
        top = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
        text = _text_view(hf_config)
        fields["hf_model_type"] = getattr(text, "model_type", None)
        # Qwen3-VL keeps its text_config too: M-RoPE sections and the text model type, which no Megatron arg holds
        fields[CONDITIONAL_GENERATION] = {k: v for k, v in top.items() if k != "text_config" or qwen3_vl}
    return fields


# Qwen3-VL's text model types and the Megatron text model their args describe (``detect_arch``)
QWEN3_VL_TEXT = {"qwen3_vl_text": "qwen3", "qwen3_vl_moe_text": "qwen3_moe"}


# Megatron args of a conditional-generation checkpoint (Qwen3.5's ``Qwen3VLModel`` in Megatron-Bridge): the HF
# config's top level without ``text_config`` (model_type, architectures, vision_config, token ids, tying), which
# the args' text model completes into the config.json transformers reads (``conditional_generation_config``)
CONDITIONAL_GENERATION = "hf_conditional_generation"


def _text_view(config: Any) -> Any:
    """The text config of a conditional-generation config (``text_config``, a dict in config.json views), else
    the config itself."""
    text = getattr(config, "text_config", None)
    if text is None:
        return config
    return HFConfig(text) if isinstance(text, dict) else text


def conditional_generation_config(args: Any, text: HFConfig) -> HFConfig:
    """``text`` (a text model's config from the args) inside the conditional-generation config the args record
    (``CONDITIONAL_GENERATION``), or ``text`` itself when they record none."""
    top = arg_value(args, CONDITIONAL_GENERATION)
    if top is None:
        return text
    inner = text.to_dict()
    inner.pop("architectures", None)
    inner.pop("transformers_version", None)
    recorded = top.get("text_config")  # Qwen3-VL: the text config as recorded (M-RoPE, model type) over the args'
    return HFConfig({**top, "text_config": {**inner, **recorded} if isinstance(recorded, dict) else inner})
