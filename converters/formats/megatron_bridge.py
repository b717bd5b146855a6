"""Megatron-Bridge checkpoints: ``iter_*/run_config.yaml`` read as bounded data and written (the text models
Bridge 0.6.2 has bridges for, the Gated DeltaNet hybrids among them, and the vision-language models); the
vision tower's shapes checked against the config.

What Megatron-Bridge writes: ``<root>/latest_checkpointed_iteration.txt``, ``iter_XXXXXXX/`` with
megatron-core's torch_dist files (no Megatron args), ``run_config.yaml``, ``train_state.pt``,
``tokenizer/`` and, with ``also_save_hf_checkpoint``, an HF export in ``hf/``. The tensors are read
by ``converters/formats/megatron_dist``; this module only reads the one hint run_config.yaml gives
about the model: the local HF directory it was trained from (``model.hf_model_id``).

run_config.yaml is a Hydra config full of ``_target_`` entries naming classes: it is data here and
nothing is ever instantiated from it. It is read with a safe loader (no Python tags), at most
``MAX_RUN_CONFIG_BYTES``, refusing YAML aliases before anything is built from them (nested aliases
expand exponentially: a 438-byte file can name 10^9 items), and only bounded scalars are taken
from it. CheckpointError naming the file otherwise.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

from converters.formats.hf_config import check_block_count
from converters.formats.megatron_hybrid import FULL, LINEAR, hybrid_arg_fields
from models.common.errors import CheckpointError
from models.common.hf_files import read_bounded

MAX_RUN_CONFIG_BYTES = 4 << 20  # Bridge writes tens of KB
MAX_MODEL_ID_CHARS = 4096
RUN_CONFIG = "run_config.yaml"
TRAIN_STATE = "train_state.pt"  # iter_*/train_state.pt; latest_train_state.pt beside the iterations
COMMON_STATE = "common_state/shard_0_1"  # megatron-core >= 0.17 keeps common.pt's dict as this torch_dist item
COMMON_PT = "common.pt"
# what megatron-core 0.19 records as the checkpoint's content metadata (how sharded_state_dict was made)
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
# Megatron-Bridge 0.6.2's bridges for text models (bridge/models/llama, qwen) all build megatron-core's
# GPTModel from GPTModelProvider, each setting its own fields (``bridge_text_fields``); Qwen2-MoE has no
# bridge there
GPT_PROVIDER = "megatron.bridge.models.gpt_provider.GPTModelProvider"
# the Gated DeltaNet hybrids' bridges (qwen35_bridge.py: Qwen3.5, Qwen3.5-MoE; qwen3_next_bridge.py) build the
# same GPTModel with megatron-core's experimental-attention block spec (``hybrid_bridge_fields``)
HYBRID_BRIDGES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
TEXT_BRIDGES = ("llama", "qwen2", "qwen3", "qwen3_moe", *HYBRID_BRIDGES)
HYBRID_BLOCK_SPEC = ("megatron.core.models.gpt.experimental_attention_variant_module_specs."
                     "get_transformer_block_with_experimental_attention_variant_spec")
# the provider Bridge instantiates per architecture: Qwen2.5-VL has one; Qwen2-VL has none (see docs/formats.md)
PROVIDERS = {"qwen2_5_vl": "megatron.bridge.models.qwen_vl.qwen25_vl_provider.Qwen25VLModelProvider",
             **{arch: GPT_PROVIDER for arch in TEXT_BRIDGES}}
# a Qwen3.5 / Qwen3.5-MoE conditional-generation checkpoint (``cfg.carried``: a vision tower) is Bridge's
# Qwen35VLBridge / Qwen35VLMoEBridge, which build Qwen3VLModel from these providers (``hybrid_vision_fields``)
# Qwen3-VL / Qwen3-VL-MoE (``qwen3_vl_bridge.py``: Qwen3VLBridge / Qwen3VLMoEBridge) build the same Qwen3VLModel
# from their own providers, with a Qwen3 / Qwen3-MoE text GPT (Transformer-Engine spec) and DeepStack mergers
VL_HYBRID_PROVIDERS = {"qwen3_5": "megatron.bridge.models.qwen_vl.qwen35_vl_provider.Qwen35VLModelProvider",
                       "qwen3_5_moe": "megatron.bridge.models.qwen_vl.qwen35_vl_provider.Qwen35VLMoEModelProvider",
                       "qwen3_vl": "megatron.bridge.models.qwen_vl.qwen3_vl_provider.Qwen3VLModelProvider",
                       "qwen3_vl_moe": "megatron.bridge.models.qwen_vl.qwen3_vl_provider.Qwen3VLMoEModelProvider"}
HYBRID_VISION_CONFIGS = {
    "qwen3_5": "transformers.models.qwen3_5.configuration_qwen3_5.Qwen3_5VisionConfig",
    "qwen3_5_moe": "transformers.models.qwen3_5_moe.configuration_qwen3_5_moe.Qwen3_5MoeVisionConfig",
    "qwen3_vl": "transformers.models.qwen3_vl.configuration_qwen3_vl.Qwen3VLVisionConfig",
    "qwen3_vl_moe": "transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe.Qwen3VLMoeVisionConfig"}
# the text config Qwen3VLBridge records as ``hf_text_config`` (the Qwen3.5-VL bridges record none)
QWEN3_VL_TEXT_CONFIGS = {
    "qwen3_vl": "transformers.models.qwen3_vl.configuration_qwen3_vl.Qwen3VLTextConfig",
    "qwen3_vl_moe": "transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe.Qwen3VLMoeTextConfig"}
QWEN35_VL_MROPE_SECTION = (11, 11, 10)  # what Bridge's Qwen3.5-VL bridges set when the text config names none
QWEN3_VL_MROPE_SECTION = (24, 20, 20)  # Qwen3VLBridge's likewise
VISION_CONFIGS = {"qwen2_5_vl": "transformers.models.qwen2_5_vl.configuration_qwen2_5_vl.Qwen2_5_VLVisionConfig",
                  "qwen2_vl": "transformers.models.qwen2_vl.configuration_qwen2_vl.Qwen2VLVisionConfig"}


def _loader() -> type:
    import yaml

    class NoAliasLoader(yaml.SafeLoader):
        """``yaml.SafeLoader`` that refuses aliases (``*name``) when it meets them."""

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(None, None, f"alias *{event.anchor} (YAML aliases are not read)",
                                                  event.start_mark)
            return super().compose_node(parent, index)

    return NoAliasLoader


def read_run_config(path: Path) -> dict[str, Any]:
    """The data of a Bridge ``run_config.yaml`` (a mapping); CheckpointError naming the file when it is
    too large, not UTF-8, not YAML data, holds aliases or Python tags, or is not a mapping."""
    import yaml

    raw = read_bounded(path, MAX_RUN_CONFIG_BYTES, "a Megatron-Bridge run_config.yaml is tens of KB; pass "
                       "--hf-config DIR to convert without it")
    try:
        data = yaml.load(raw.decode("utf-8"), Loader=_loader())  # a SafeLoader subclass: data only
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text ({exc})") from exc
    except (yaml.YAMLError, RecursionError) as exc:
        raise CheckpointError(f"{path}: not read as YAML data: {' '.join(str(exc).split())}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: a YAML {type(data).__name__}, not a mapping (not a Megatron-Bridge "
                              f"run_config.yaml)")
    return data


def bridge_hf_model_id(run_config: Path) -> str | None:
    """``model.hf_model_id`` (or ``model.extra_checkpoint_metadata.hf_model_id``) of a Bridge
    run_config.yaml: a string of at most ``MAX_MODEL_ID_CHARS`` characters, or None when absent."""
    try:
        import yaml  # noqa: F401
    except ImportError:  # without PyYAML the hint is lost; --hf-config still works
        return None
    data = read_run_config(run_config)
    model = data.get("model")
    if not isinstance(model, dict):
        return None
    extra = model.get("extra_checkpoint_metadata")
    for where, value in (("model.extra_checkpoint_metadata.hf_model_id",
                          extra.get("hf_model_id") if isinstance(extra, dict) else None),
                         ("model.hf_model_id", model.get("hf_model_id"))):
        if value is None or value == "":
            continue
        if not isinstance(value, str) or len(value) > MAX_MODEL_ID_CHARS or "\0" in value:
            shown = f"a {type(value).__name__}" if not isinstance(value, str) else f"{len(value)} characters"
            raise CheckpointError(f"{run_config}: {where} is {shown}, not a model path or id (pass --hf-config DIR)")
        return value
    return None


# ------------------------------------------------------------------------------------------- checking


def check_bridge_vision(vis: Any, shapes: Mapping[str, tuple], config_path: str, metadata: str) -> None:
    """The vision tower of a Megatron-Bridge checkpoint (``visual.*``, transformers' names, whole
    tensors) against ``vision_config`` (``vis``: VisionConfig): the block count first (a config
    claiming 10^9 blocks fails before anything is listed), then every tensor's shape. One
    CheckpointError naming the file, the tensor and the numbers."""
    from models.common.vision.weights import vision_entries

    if any(k.startswith("vision_model.") for k in shapes):
        raise CheckpointError(f"{metadata}: the vision tower is stored as vision_model.* (mbridge's layout: "
                              f"megatron-core vision blocks); pmz reads Megatron-Bridge's (visual.*, transformers' "
                              f"names)")
    check_block_count(f"{config_path} (checkpoint {metadata})", "vision_config.depth", vis.depth, "visual.blocks.",
                      shapes)
    fields = (f"hidden_size={vis.embed_dim}, num_heads={vis.num_heads}, mlp width={vis.mlp_hidden}, "
              f"patch_size={vis.patch_size}, temporal_patch_size={vis.temporal_patch_size}, in_channels="
              f"{vis.in_channels}, spatial_merge_size={vis.spatial_merge_size}, out_hidden_size={vis.out_hidden_size}")
    for entry in vision_entries(vis):
        for name, shape in zip(entry.hf, entry.shapes):
            got = shapes.get(name)
            if got is None:
                raise CheckpointError(f"{metadata}: missing vision tensor {name} (vision_config.depth={vis.depth})")
            if tuple(got) != tuple(shape):
                raise CheckpointError(f"{config_path}: vision_config ({fields}) implies {name} of shape "
                                      f"{tuple(shape)}, but {metadata} has {tuple(got)}")


# ------------------------------------------------------------------------------------------- writing


def bridge_biases(cfg: Any) -> tuple[bool, bool]:
    """(``add_qkv_bias``, ``add_bias_linear``) Bridge 0.6.2's bridge of a text model sets: Llama's from
    ``attention_bias`` / ``mlp_bias``, Qwen2 qkv bias only, Qwen3 and Qwen3-MoE none."""
    if cfg.architecture == "llama":
        return cfg.qkv_bias, cfg.mlp_bias
    return cfg.architecture == "qwen2", False


def check_bridge_text_model(cfg: Any, where: str, mtp_layers: int = 0) -> None:
    """A text model Megatron-Bridge 0.6.2 builds as it is: an architecture it has a bridge for, the biases
    its bridge sets, for the MoE models every layer sparse (their bridges set no dense layers), and for the
    Gated DeltaNet hybrids what ``_check_hybrid`` lists (``mtp_layers``: the MTP layers the checkpoint
    holds). CheckpointError naming the source and what differs otherwise."""
    hint = "--to megatron-dist writes the torch_dist checkpoint megatron-core loads"
    if cfg.architecture not in TEXT_BRIDGES:
        raise CheckpointError(f"{where}: Megatron-Bridge 0.6.2 has no bridge for {cfg.architecture} (it has "
                              f"{', '.join(TEXT_BRIDGES)}, qwen2_5_vl); {hint}")
    qkv, linear = bridge_biases(cfg)
    if (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) != (qkv, linear, linear):
        raise CheckpointError(f"{where}: Megatron-Bridge 0.6.2's {cfg.architecture} bridge builds qkv bias={qkv}, "
                              f"o_proj and MLP bias={linear}; this model has qkv_bias={cfg.qkv_bias}, o_proj "
                              f"bias={cfg.o_bias}, mlp bias={cfg.mlp_bias}")
    dense = sorted(set(range(cfg.num_hidden_layers)) - cfg.sparse_layers()) if cfg.moe is not None else []
    if dense:
        raise CheckpointError(f"{where}: Megatron-Bridge 0.6.2's {cfg.architecture} bridge makes every layer sparse; "
                              f"this model has a dense MLP in layer(s) {', '.join(map(str, dense))} "
                              f"(mlp_only_layers / decoder_sparse_step); {hint}")
    if cfg.architecture in HYBRID_BRIDGES:
        _check_hybrid(cfg, where, mtp_layers, hint)


def check_bridge_qwen3_vl(cfg: Any, where: str) -> None:
    """Qwen3-VL / Qwen3-VL-MoE as Bridge 0.6.2's ``Qwen3VLBridge`` / ``Qwen3VLMoEBridge`` build them: no o_proj bias
    (``add_bias_linear`` false; transformers' ``attention_bias`` puts one there), and for the MoE one every layer
    sparse (its provider builds the Transformer-Engine MoE spec for every layer, whatever ``mlp_only_layers`` /
    ``decoder_sparse_step`` say) with the top-k weights renormalised (``moe_router_pre_softmax`` false).
    CheckpointError naming the source and what differs otherwise."""
    name = f"Megatron-Bridge 0.6.2's {cfg.architecture} bridge"
    if cfg.o_bias or cfg.mlp_bias:
        raise CheckpointError(f"{where}: {name} builds no o_proj / MLP bias (add_bias_linear false); this model has "
                              f"attention_bias=True (a bias on q/k/v and o_proj), which Megatron cannot hold")
    if cfg.moe is not None:
        dense = sorted(set(range(cfg.num_hidden_layers)) - cfg.sparse_layers())
        if dense:
            raise CheckpointError(f"{where}: {name} makes every layer sparse; this model has a dense MLP in layer(s) "
                                  f"{', '.join(map(str, dense))} (mlp_only_layers / decoder_sparse_step); --to "
                                  f"megatron-dist writes them")
        if not cfg.moe.norm_topk_prob:
            raise CheckpointError(f"{where}: {name} renormalises the top-{cfg.moe.top_k} router weights "
                                  f"(moe_router_pre_softmax=false); this model has norm_topk_prob=False")


def _check_hybrid(cfg: Any, where: str, mtp_layers: int, hint: str) -> None:
    """What Bridge 0.6.2's Qwen3.5 / Qwen3-Next bridges build besides the layer pattern (any pattern: they
    set ``linear_attention_freq`` to the per-layer list): plain RoPE (they set ``position_embedding_type``
    "rope" and read no scaling), top-k weights renormalised (``moe_router_pre_softmax`` false), and an MTP
    layer only after a full-attention last layer (megatron-core builds the MTP layer from the last decoder
    layer's spec and asserts on a linear-attention one)."""
    name = f"Megatron-Bridge 0.6.2's {cfg.architecture} bridge"
    if cfg.rope.rope_type != "default":
        raise CheckpointError(f"{where}: {name} builds plain RoPE (no scaling); this model has "
                              f"rope_type={cfg.rope.rope_type!r}; {hint}")
    if cfg.moe is not None and not cfg.moe.norm_topk_prob:
        raise CheckpointError(f"{where}: {name} renormalises the top-{cfg.moe.top_k} router weights "
                              f"(moe_router_pre_softmax=false); this model has norm_topk_prob=False; {hint}")
    last = cfg.num_hidden_layers - 1
    if mtp_layers and cfg.layer_types[last] != FULL:
        raise CheckpointError(f"{where}: the checkpoint has an MTP block and its last layer ({last}) is "
                              f"{cfg.layer_types[last]}: megatron-core builds the MTP layer from the last layer's "
                              f"spec and cannot build it from linear attention, so Megatron-Bridge 0.6.2 cannot "
                              f"build this model with its MTP block")


def bridge_common_state(iteration: int) -> dict[str, Any]:
    """common.pt of a Bridge checkpoint we write: no Megatron args (run_config.yaml describes the model)."""
    return {"checkpoint_version": 3.0, "iteration": iteration, "content_metadata": CONTENT_METADATA}


def _vocab_divisor(vocab_size: int) -> int:
    """Bridge's ``make_vocab_size_divisible_by``: the largest power of two up to 128 dividing the vocabulary."""
    base = 128
    while vocab_size % base:
        base //= 2
    return base


def bridge_text_fields(cfg: Any, mtp_layers: int = 0) -> dict[str, Any]:
    """The GPTModelProvider fields Megatron-Bridge 0.6.2 sets from a text model's HF config
    (``MegatronModelBridge.hf_config_to_provider_kwargs`` and the bridge's ``provider_bridge``) beyond
    those every model shares (``run_config_text``); the hybrids' own in ``hybrid_bridge_fields``; speed
    switches (fusions) keep the provider's defaults."""
    hybrid = cfg.architecture in HYBRID_BRIDGES
    fields: dict[str, Any] = {
        "make_vocab_size_divisible_by": _vocab_divisor(cfg.vocab_size), "position_embedding_type": "rope",
        "rotary_percent": 1.0, "qk_layernorm": cfg.qk_norm}
    if cfg.rope.rope_type == "llama3":  # megatron-core's Llama 3.1 scaling: factor only (frequencies fixed)
        fields.update(rope_scaling=True, rope_scaling_factor=cfg.rope.factor)
    elif cfg.rope.rope_type == "linear":
        fields["seq_len_interpolation_factor"] = cfg.rope.factor
    if cfg.architecture != "llama":
        fields["autocast_dtype"] = {"_target_": "torch.bfloat16", "_call_": False}
    moe = cfg.moe
    if moe is not None:
        fields.update({
            "num_moe_experts": moe.num_experts, "moe_ffn_hidden_size": moe.moe_intermediate_size,
            "moe_router_topk": moe.top_k, "moe_router_pre_softmax": not moe.norm_topk_prob,
            "moe_router_score_function": "softmax",
            "moe_router_load_balancing_type": "global_aux_loss" if hybrid else "aux_loss",
            # Qwen3-Next's bridge sets 1e-3 whatever router_aux_loss_coef says; the others take it from there
            "moe_aux_loss_coeff": 1e-3 if cfg.architecture == "qwen3_next" else moe.router_aux_loss_coef,
            "moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall", "moe_permute_fusion": True})
    if hybrid:
        fields.update(hybrid_bridge_fields(cfg, mtp_layers))
    return fields


def hybrid_bridge_fields(cfg: Any, mtp_layers: int) -> dict[str, Any]:
    """What Bridge 0.6.2's Qwen3.5 / Qwen3-Next bridges set for a Gated DeltaNet hybrid: megatron-core's
    experimental-attention block spec, the fields megatron-core needs to build it (``hybrid_arg_fields``, the
    Megatron-LM args' rule) with ``linear_attention_freq`` as Bridge keeps it (the per-layer 0/1 list from
    ``layer_types``, 1 = linear attention, never the interval), heterogeneous per-layer checkpoint keys, the
    MTP loss scale Qwen3.5's bridge sets, and the shared expert (sigmoid-gated; Qwen3-Next's router in fp32)."""
    fields = hybrid_arg_fields(cfg, mtp_layers)
    fields.update({"linear_attention_freq": [1 if t == LINEAR else 0 for t in cfg.layer_types],
                   "transformer_layer_spec": {"_target_": HYBRID_BLOCK_SPEC, "_call_": False},
                   "hetereogenous_dist_checkpoint": True})  # sic: megatron-core's spelling
    if mtp_layers and cfg.architecture != "qwen3_next":
        fields["mtp_loss_scaling_factor"] = 0.1
    if cfg.moe is not None:
        fields.update(moe_shared_expert_intermediate_size=cfg.moe.shared_expert_intermediate_size,
                      moe_shared_expert_gate=True)
        if cfg.architecture == "qwen3_next":
            fields["moe_router_dtype"] = "fp32"
    return fields


def run_config_text(hf_config: Any, cfg: Any, *, tp: int, pp: int, vpp: int, dtype: str, mtp_layers: int = 0) -> str:
    """``run_config.yaml`` in Megatron-Bridge's layout: the ``model`` section its ``load_megatron_model``
    instantiates (the provider and the fields its bridge sets from the HF config: ``Qwen25VLBridge``'s for
    the vision-language models, ``bridge_text_fields`` for the text ones; the rest keep the provider's
    defaults, the layer spec included: Transformer Engine's) and the ``checkpoint`` fields its resume path
    reads. ``dtype``: the torch dtype name of the tensors ("float32", "bfloat16", "float16"); ``mtp_layers``:
    the MTP layers written (a hybrid's; ``mtp_num_layers``). A Qwen3.5 / Qwen3.5-MoE conditional-generation
    checkpoint (``cfg.carried``) names Bridge's Qwen3.5-VL provider (``bridge_provider``): the text hybrid's fields
    and ``hybrid_vision_fields``.

    Qwen2-VL: Megatron-Bridge 0.6.2 has no provider for it, so ``model`` names none (``_target_``
    left out): the fields describe the model, but Bridge itself cannot build it."""
    vision = cfg.vision is not None
    qkv_bias, linear_bias = bridge_biases(cfg) if not vision else (cfg.qkv_bias, False)
    model: dict[str, Any] = {}
    provider = bridge_provider(cfg)
    if provider:
        model["_target_"] = provider
    model.update({
        "num_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
        # Qwen3.5-MoE's config has no intermediate_size (0 here): Bridge leaves the field to megatron-core's
        # TransformerConfig, which makes it 4 x hidden_size (no layer uses it: every MLP is MoE)
        "ffn_hidden_size": cfg.intermediate_size or 4 * cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads, "num_query_groups": cfg.num_key_value_heads,
        "kv_channels": cfg.head_dim, "init_method_std": cfg.initializer_range, "layernorm_epsilon": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size, "should_pad_vocab": False, "seq_length": cfg.max_position_embeddings,
        "normalization": "RMSNorm", "gated_linear_unit": True, "activation_func":
            {"_target_": "torch.nn.functional.silu", "_call_": False},
        "add_qkv_bias": qkv_bias, "add_bias_linear": linear_bias, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "rotary_base": cfg.rope.theta, "share_embeddings_and_output_weights": cfg.tie_word_embeddings,
        "params_dtype": {"_target_": f"torch.{dtype}", "_call_": False},
        "bf16": dtype == "bfloat16", "fp16": dtype == "float16",
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vpp if vpp > 1 else None,
    })
    qwen3_vl = cfg.architecture in QWEN3_VL_TEXT_CONFIGS
    if vision and not qwen3_vl:
        model.update(_vision_fields(hf_config, cfg))
    else:
        model.update(bridge_text_fields(cfg, mtp_layers))
    if qwen3_vl:
        model.pop("autocast_dtype")  # as the Qwen3.5-VL bridges: left to the provider
        model.update(qwen3_vl_bridge_fields(hf_config, cfg, dtype))
    if getattr(cfg, "carried", ()):
        model.pop("autocast_dtype")  # the Qwen3.5-VL bridges leave it (their text bridges set bfloat16)
        model.update(hybrid_vision_fields(hf_config, cfg, dtype))
    checkpoint = {"ckpt_format": "torch_dist", "save_optim": False, "save_rng": False, "fully_parallel_save": True}
    kind = "a vision-language model" if vision else f"a {cfg.architecture} model"
    if qwen3_vl:
        kind = f"a {cfg.architecture} model (text, vision tower, DeepStack mergers)"
    if getattr(cfg, "carried", ()):
        kind = f"a {cfg.architecture} conditional-generation model (text, vision tower, MTP)"
    head = (f"# Written by pmz (parallel model zoo): Megatron-Bridge's layout of {kind}.\n"
            "# Megatron-Bridge's load_megatron_model instantiates `model`; its resume path reads `checkpoint`.\n")
    if not provider:
        head += (f"# Megatron-Bridge has no provider for {cfg.architecture}: `model` describes it but names no "
                 f"_target_.\n")
    return head + _yaml({"checkpoint": checkpoint, "model": model})


def bridge_provider(cfg: Any) -> str | None:
    """The provider class Bridge 0.6.2 instantiates for ``cfg`` (None: it has none): Qwen3.5-VL's for a hybrid's
    conditional-generation checkpoint, else the architecture's (``PROVIDERS``)."""
    if getattr(cfg, "carried", ()) or cfg.architecture in QWEN3_VL_TEXT_CONFIGS:
        return VL_HYBRID_PROVIDERS[cfg.architecture]
    return PROVIDERS.get(cfg.architecture)


def qwen3_vl_bridge_fields(hf_config: Any, cfg: Any, dtype: str) -> dict[str, Any]:
    """What Bridge 0.6.2's ``Qwen3VLBridge`` / ``Qwen3VLMoEBridge.provider_bridge`` set beyond the Qwen3 /
    Qwen3-MoE text fields (``bridge_text_fields``): ``hybrid_vision_fields``' M-RoPE, token ids and ``vision_config``
    (their default sections [24, 20, 20]), the text config as ``hf_text_config``, and for the MoE one ``head_dim`` and
    its constants (``moe_aux_loss_coeff`` 1e-3 whatever ``router_aux_loss_coef`` says, ``decoder_sparse_step`` and
    ``mlp_only_layers`` as the config says them: every layer is sparse in what it builds)."""
    fields = hybrid_vision_fields(hf_config, cfg, dtype)
    text = hf_config.text_config if isinstance(hf_config.text_config, dict) else hf_config.text_config.to_dict()
    if cfg.architecture == "qwen3_vl":  # transformers 5.12's dense text config has no bos/eos: Bridge's defaults
        for key in ("bos_token_id", "eos_token_id"):
            if fields[key] is None:
                del fields[key]
    inner = {k: v for k, v in text.items() if k != "transformers_version"}
    if cfg.moe is not None:  # transformers 5.12's text config takes the count as num_experts (Bridge records both)
        inner["num_experts"] = cfg.moe.num_experts
    fields["hf_text_config"] = {"_target_": QWEN3_VL_TEXT_CONFIGS[cfg.architecture], **inner}
    if cfg.moe is not None:  # (``head_dim``: a field of the MoE provider only; the dense bridge sets an attribute)
        fields["head_dim"] = cfg.head_dim
        fields.update(moe_aux_loss_coeff=1e-3, decoder_sparse_step=int(text.get("decoder_sparse_step", 1) or 1),
                      mlp_only_layers=list(text.get("mlp_only_layers") or []))
    return fields


def hybrid_vision_fields(hf_config: Any, cfg: Any, dtype: str) -> dict[str, Any]:
    """What Bridge 0.6.2's ``Qwen35VLBridge`` / ``Qwen35VLMoEBridge.provider_bridge`` set beyond the text
    hybrid's fields (``bridge_text_fields``, read from ``text_config``): M-RoPE with the text config's
    ``mrope_section`` (Bridge's [11, 11, 10] when it names none), bos/eos from ``text_config``, the vision token
    ids from the top level (left to the provider's defaults, which are transformers', when absent), and
    ``vision_config``: the HF tower config as Bridge records it (``_target_`` its transformers class, its fields,
    ``dtype`` the parameters' dtype, which Bridge sets on it). ``dtype``: torch dtype name of the tensors."""
    text = hf_config.text_config if isinstance(hf_config.text_config, dict) else hf_config.text_config.to_dict()
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    default = QWEN3_VL_MROPE_SECTION if cfg.architecture in QWEN3_VL_TEXT_CONFIGS else QWEN35_VL_MROPE_SECTION
    fields: dict[str, Any] = {"position_embedding_type": "mrope",
                              "mrope_section": list(rope.get("mrope_section") or default),
                              "bos_token_id": text.get("bos_token_id"), "eos_token_id": text.get("eos_token_id")}
    for key in ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"):
        if getattr(hf_config, key, None) is not None:
            fields[key] = getattr(hf_config, key)
    vision = dict(hf_config.vision_config or {})
    vision.pop("transformers_version", None)
    fields["vision_config"] = {"_target_": HYBRID_VISION_CONFIGS[cfg.architecture], **vision,
                               "dtype": {"_target_": f"torch.{dtype}", "_call_": False}}
    return fields


def _vision_fields(hf_config: Any, cfg: Any) -> dict[str, Any]:
    """The fields ``Qwen25VLBridge.provider_bridge`` sets beyond the text model's: M-RoPE, the special
    token ids and the vision config."""
    vision = dict(hf_config.vision_config or {})
    vision.pop("transformers_version", None)
    text = hf_config.text_config if isinstance(hf_config.text_config, dict) else hf_config.to_dict()
    fields: dict[str, Any] = {"position_embedding_type": "mrope", "mrope_section": list(cfg.rope.mrope_section or ()),
                              "bos_token_id": text.get("bos_token_id"), "eos_token_id": text.get("eos_token_id")}
    for key in ("vision_start_token_id", "vision_end_token_id", "vision_token_id", "image_token_id", "video_token_id"):
        if getattr(hf_config, key) is not None:
            fields[key] = getattr(hf_config, key)
    fields["vision_config"] = {"_target_": VISION_CONFIGS[cfg.architecture], **vision}
    return fields


_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or abs(value) == float("inf"):
            return ".nan" if value != value else ".inf" if value > 0 else "-.inf"
        mantissa, e, exponent = repr(value).partition("e")
        # YAML 1.1 (PyYAML) reads a float only with a dot in the mantissa and a signed exponent
        mantissa = mantissa if "." in mantissa else mantissa + ".0"
        return mantissa + (f"e{'' if exponent[0] in '+-' else '+'}{exponent}" if e else "")
    return json.dumps(str(value))  # a double-quoted JSON string is a YAML string


def _yaml(value: Any, indent: int = 0) -> str:
    """Block-style YAML of plain data (dicts with string keys, lists, scalars): a few lines of the
    subset ``yaml.safe_load`` reads back as the same data (tests/test_convert_bridge_vl.py checks it)."""
    pad = "  " * indent
    out = []
    if isinstance(value, dict):
        for key, item in value.items():
            name = key if _PLAIN_KEY.match(str(key)) else json.dumps(str(key))
            if isinstance(item, (dict, list)) and item:
                out.append(f"{pad}{name}:\n" + _yaml(item, indent + 1))
            else:
                out.append(f"{pad}{name}: {_flow(item)}\n")
    else:
        for item in value:
            if isinstance(item, (dict, list)) and item:
                out.append(f"{pad}-\n" + _yaml(item, indent + 1))
            else:
                out.append(f"{pad}- {_flow(item)}\n")
    return "".join(out)


def _flow(value: Any) -> str:
    """A scalar, or an empty mapping / list, on one line."""
    if isinstance(value, dict):
        return "{}"
    return "[]" if isinstance(value, list) else _scalar(value)
