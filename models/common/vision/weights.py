"""Weight map of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL): the Qwen2 decoder table plus the vision
tower, under the HF names transformers' ``save_pretrained`` writes on disk (``model.*``, ``visual.*``,
``lm_head.*``; verified against transformers 5.23 in tests/test_qwen2_vl.py and
tests/test_qwen2_5_vl.py). Checkpoints in transformers' in-memory layout (``model.language_model.*``,
``model.visual.*``) are read through ``HF_KEY_ALIASES``.

Vision tensors (``{j}`` = block) and their tensor-parallel rules (``models/common/blocks/vision.py``):
  ``visual.patch_embed.proj.weight [E, C, T, P, P]``   replicated
  ``visual.blocks.{j}.norm{1,2}.weight`` (+ ``.bias``)  replicated (Qwen2.5-VL: RMSNorm, no bias)
  ``visual.blocks.{j}.attn.qkv.{weight,bias}``         Fused(3): per q/k/v block, then per head
  ``visual.blocks.{j}.attn.proj.weight`` / ``.bias``   row / replicated
  Qwen2-VL:
  ``visual.blocks.{j}.mlp.fc1.{weight,bias}``          column
  ``visual.blocks.{j}.mlp.fc2.weight`` / ``.bias``     row / replicated
  Qwen2.5-VL (one parameter ``mlp.gate_up_proj`` = this rank's ``[gate_r | up_r]``, vLLM's packing):
  ``visual.blocks.{j}.mlp.{gate,up}_proj.{weight,bias}`` column, packed
  ``visual.blocks.{j}.mlp.down_proj.weight`` / ``.bias`` row / replicated
  ``visual.merger.ln_q.weight`` (+ ``.bias``)           replicated (Qwen2.5-VL: RMSNorm, no bias)
  ``visual.merger.mlp.0.{weight,bias}``                column
  ``visual.merger.mlp.2.weight`` / ``.bias``           row / replicated
No Megatron names: Megatron formats for these models are not supported yet (docs/formats.md).
"""

from __future__ import annotations

from models.common.config import ModelConfig, VisionConfig
from models.common.weight_map import WeightEntry, WeightMap, dense_decoder_weight_map
from parallel.sharding import Fused, Replicated, Split

# transformers' in-memory names -> the on-disk names used here (prefix rewrites, first match wins)
HF_KEY_ALIASES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def counted_blocks(cfg: ModelConfig) -> tuple[tuple[str, int, str], ...]:
    """The vision blocks, listed one by one in the weight map (``Architecture.counted_blocks``)."""
    return (("vision_config.depth", cfg.vision.depth, "visual.blocks."),)


def vision_entries(vis: VisionConfig) -> tuple[WeightEntry, ...]:
    col, row, rep, fused = Split(0), Split(1), Replicated(), Fused(3)
    e, m, d, out = vis.embed_dim, vis.mlp_hidden, vis.merged_dim, vis.out_hidden_size
    p, t = vis.patch_size, vis.temporal_patch_size

    def entry(name: str, rule, shape) -> WeightEntry:
        return WeightEntry(name, (name,), (rule,), shapes=(tuple(shape),))

    def norm(name: str) -> list[WeightEntry]:
        weight = [entry(name + ".weight", rep, (e,))]
        return weight if vis.rms_norm else weight + [entry(name + ".bias", rep, (e,))]

    entries = [entry("visual.patch_embed.proj.weight", rep, (e, vis.in_channels, t, p, p))]
    for j in range(vis.depth):
        b = f"visual.blocks.{j}."
        entries += norm(b + "norm1") + [
            entry(b + "attn.qkv.weight", fused, (3 * e, e)), entry(b + "attn.qkv.bias", fused, (3 * e,)),
            entry(b + "attn.proj.weight", row, (e, e)), entry(b + "attn.proj.bias", rep, (e,))] + norm(b + "norm2")
        if vis.gated_mlp:
            entries += [WeightEntry(f"{b}mlp.gate_up_proj.{k}", (f"{b}mlp.gate_proj.{k}", f"{b}mlp.up_proj.{k}"),
                                    (col, col), shapes=(shape, shape))
                        for k, shape in (("weight", (m, e)), ("bias", (m,)))]
            entries += [entry(b + "mlp.down_proj.weight", row, (e, m)), entry(b + "mlp.down_proj.bias", rep, (e,))]
        else:
            entries += [entry(b + "mlp.fc1.weight", col, (m, e)), entry(b + "mlp.fc1.bias", col, (m,)),
                        entry(b + "mlp.fc2.weight", row, (e, m)), entry(b + "mlp.fc2.bias", rep, (e,))]
    entries += norm("visual.merger.ln_q") + [
        entry("visual.merger.mlp.0.weight", col, (d, d)), entry("visual.merger.mlp.0.bias", col, (d,)),
        entry("visual.merger.mlp.2.weight", row, (out, d)), entry("visual.merger.mlp.2.bias", rep, (out,))]
    return tuple(entries)


def weight_map(cfg: ModelConfig, padded_vocab_size: int) -> WeightMap:
    assert cfg.vision is not None, f"{cfg.architecture} needs cfg.vision"
    dense = dense_decoder_weight_map(cfg, padded_vocab_size, hf_prefix="model.", hf_lm_head="lm_head.weight")
    return WeightMap(dense.layer_entries, dense.first_entries + vision_entries(cfg.vision), dense.last_entries)
