"""Tiny Qwen2-VL models and batches for the vision-language tests (fixtures only, no tests here).

``VL_CASES`` holds ``Qwen2VLConfig`` keyword arguments sized so that tensor parallel 1, 2 and 4
divide every sharded dimension (vision: 4 heads of 16, whose 2D rotary needs head_dim % 4 == 0;
text: 4 query and 2 KV heads of 16, M-RoPE sections summing to 16 / 2). The two cases differ in
tied/untied embeddings, patch size, MLP ratio, depth, M-RoPE sections and vocab size (101 is not
divisible by 2 or 4).

``write_vl_model`` saves a random ``Qwen2VLForConditionalGeneration`` with transformers' own
``save_pretrained``. In transformers 5.23 the file on disk keeps the original Qwen2-VL checkpoint
layout, not the in-memory module names: ``visual.*`` (vision tower and merger), ``model.*`` (the
language model: ``model.embed_tokens``, ``model.layers.N``, ``model.norm``) and ``lm_head.weight``
(absent when tied), whereas ``named_parameters()`` says ``model.visual.*`` and
``model.language_model.*``. tests/test_vl_positions.py checks this.

The batch builders make prompts shaped like Qwen2-VL's processor output: text, then per image or
video ``<|vision_start|>``, ``t*h*w/merge**2`` placeholder tokens, ``<|vision_end|>``, more text;
random patch rows ``[sum t*h*w, in_channels*temporal_patch_size*patch_size**2]``; and
``mm_token_type_ids``, which transformers' forward requires whenever a grid is given.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from tests.cases import save_randomized

PAD_ID = 0
# bf16 bounds of the VL models (ours-bf16 against transformers-bf16 on the mixed image + video batch; docs/numerics.md).
# VL_BF16_BOUNDS: the layouts that round differently from one process, CP2 (its attention rounds each block's output
# in bf16 before the fp32 merge; measured 1.0-1.3% / 1.7e-3, ratio 1.0-1.1): both sides sit ~1% from the fp32
# logits in different directions, and transformers' own bf16 loss error here is 1.3e-4..1.8e-3. The ratio (our
# error against fp32 over transformers' error against fp32; at TP2 of the plain model: 0.66-1.57) measured 1.57 at
# TP2 on an AMD EPYC CPU (2026-11-26: bf16 GEMM roundings differ by CPU): bound 2, every layout.
VL_BF16_BOUNDS = {"bf16_logits_rel": 0.03, "bf16_loss": 4e-3, "bf16_vs_fp32_ratio": 2.0}
# The layouts that compute what one process computes (one process, Ulysses2, EP2, TP2 with
# ParallelConfig.tp_reduce_in_fp32): logits bitwise transformers' bf16 on the development CPU (2026-11-29, every
# case; |dloss| <= 3.8e-5, the fp32 loss summed in another order). 0.5% of max |logit| leaves room for one-bit
# flips where another CPU's bf16 GEMM sums in another order, and catches RMSNorm in bf16 (1.65% on Qwen3-VL), which
# the 3% bound does not.
VL_BF16_EXACT_BOUNDS = {"bf16_logits_rel": 0.005, "bf16_loss": 1e-3, "bf16_vs_fp32_ratio": 2.0}


def vl_bf16_bound(name: str, layout: str) -> float:
    """The bound of bf16 quantity ``name`` for a layout (``ParallelConfig.describe()``): CP's the wide ones."""
    return (VL_BF16_BOUNDS if "cp=" in layout else VL_BF16_EXACT_BOUNDS)[name]


# Recorded by tests/workers_vl.py ``bf16_records`` beside the bounded ones, not bounded: at tp > 1 the plain TP model's
# distance to transformers' bf16 (its partial products rounded to bf16 before the TP sum; the bounded
# bf16_logits_rel / bf16_loss are then those of ParallelConfig.tp_reduce_in_fp32, and the ratio the plain model's),
# and under cp / ulysses the visual tokens placed on each rank (asserted > 0: images in every part).
VL_BF16_REPORTED = ("bf16_tp_logits_rel", "bf16_tp_loss", "bf16_local_visual_tokens")
_SPECIAL = {"image_token_id": 96, "video_token_id": 97, "vision_start_token_id": 98, "vision_end_token_id": 99}
_TEXT_IDS = (2, 96)  # ordinary text tokens are drawn from [2, 96): never padding, bos/eos or a vision token


def _case(*, vocab, layers, mrope_section, patch_size, mlp_ratio, tied, theta):
    return {
        "text_config": {
            "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 1, "pad_token_id": PAD_ID,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta, "mrope_section": mrope_section},
        },
        "vision_config": {
            "depth": 2, "embed_dim": 64, "hidden_size": 64, "num_heads": 4, "mlp_ratio": mlp_ratio,
            "patch_size": patch_size, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
        },
        "tie_word_embeddings": tied,
        **_SPECIAL,
    }


VL_CASES = {
    "untied": _case(vocab=128, layers=2, mrope_section=[2, 3, 3], patch_size=4, mlp_ratio=2, tied=False,
                    theta=10000.0),
    "tied": _case(vocab=101, layers=3, mrope_section=[4, 2, 2], patch_size=2, mlp_ratio=4, tied=True,
                  theta=1000000.0),
}


def _case25(*, vocab, layers, mrope_section, patch_size, depth, intermediate, fullatt, tokens_per_second, tied,
            theta):
    """Qwen2.5-VL: the same text model; a vision tower of width 64 (4 heads of 16) with RMSNorm, a gated
    MLP of ``intermediate``, windows of 2x2 merged patches (``window_size = 2 * merge * patch``: grids of
    more than 2 merged patches a side get several windows, the last ones cut short) and full attention
    only in the ``fullatt`` blocks; ``out_hidden_size`` 64 (the text width)."""
    case = _case(vocab=vocab, layers=layers, mrope_section=mrope_section, patch_size=patch_size, mlp_ratio=1,
                 tied=tied, theta=theta)
    case["vision_config"] = {
        "depth": depth, "hidden_size": 64, "intermediate_size": intermediate, "num_heads": 4, "out_hidden_size": 64,
        "patch_size": patch_size, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
        "window_size": 2 * 2 * patch_size, "fullatt_block_indexes": fullatt, "tokens_per_second": tokens_per_second,
    }
    return case


# Qwen2.5-VL cases (``Qwen2_5_VLConfig``): window and full-attention blocks mixed, video positions
# scaled by tokens_per_second (the batches add ``second_per_grid_ts``).
VL25_CASES = {
    "v25_untied": _case25(vocab=128, layers=2, mrope_section=[2, 3, 3], patch_size=4, depth=3, intermediate=96,
                          fullatt=[1], tokens_per_second=2, tied=False, theta=10000.0),
    "v25_tied": _case25(vocab=101, layers=3, mrope_section=[4, 2, 2], patch_size=2, depth=2, intermediate=48,
                        fullatt=[0], tokens_per_second=25, tied=True, theta=1000000.0),
}
_SECONDS = (1.3, 0.75, 0.5)  # second_per_grid_ts of video 0, 1, 2, ... (cycled): intervals that truncate


def _kwargs(name_or_kwargs) -> dict:
    if not isinstance(name_or_kwargs, str):
        return name_or_kwargs
    return VL_CASES[name_or_kwargs] if name_or_kwargs in VL_CASES else VL25_CASES[name_or_kwargs]


def _is25(cfg: dict) -> bool:
    return "window_size" in cfg["vision_config"]


def vl_config(name_or_kwargs):
    """A ``Qwen2VLConfig`` (``Qwen2_5_VLConfig`` for a ``VL25_CASES`` entry) from a case name or a kwargs
    dict like the entries."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    kwargs = _kwargs(name_or_kwargs)
    return (Qwen2_5_VLConfig if _is25(kwargs) else Qwen2VLConfig)(**copy.deepcopy(kwargs))


def write_vl_model(root, name: str, seed: int = 0) -> str:
    """Random ``Qwen2VLForConditionalGeneration`` of ``VL_CASES[name]`` (``Qwen2_5_VLForConditionalGeneration``
    of ``VL25_CASES[name]``) saved under ``root/name``.

    Every parameter is drawn anew: RMSNorm and LayerNorm weights uniform(0.5, 1.5), everything else
    (LayerNorm and linear biases included) normal(0, 0.08), so a mishandled norm or bias cannot
    hide behind transformers' 1/0 initialization. Returns the directory.
    """
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    config = vl_config(name)
    model = (Qwen2_5_VLForConditionalGeneration if _is25(_kwargs(name)) else Qwen2VLForConditionalGeneration)(config)
    return save_randomized(model, Path(root) / name, norm_marks=("norm", ".ln_q."))


# Samples: ("text", n) runs of text tokens, ("image" | "video", (t, h, w)) grids in patches.
_SAMPLES = {
    "one_image": [("text", 3), ("image", (1, 4, 4)), ("text", 4)],
    "two_images": [("text", 2), ("image", (1, 4, 6)), ("text", 3), ("image", (1, 2, 4)), ("text", 2)],
    "video": [("text", 2), ("video", (2, 4, 4)), ("text", 3)],
    "image_video": [("text", 2), ("image", (1, 6, 4)), ("text", 2), ("video", (2, 2, 4)), ("text", 3)],
    # t = 4 > max(h, w) / merge = 1: the positions of the text after it overlap the video's temporal ones
    "long_video": [("text", 1), ("video", (4, 2, 2)), ("text", 5)],
    "text_only": [("text", 7)],
    # (1, 4, 6): 2x3 merged patches, whose Qwen2.5-VL windows of 2x2 ([0, 1, 3, 4], [2, 5]) reorder them
    "image_video_2": [("text", 1), ("image", (1, 4, 6)), ("text", 1), ("video", (2, 4, 2)), ("text", 2)],
}
_BATCHES = {
    "one_image": ["one_image"],
    "two_images": ["two_images"],
    "video": ["video"],
    "image_video": ["image_video"],
    "mixed": ["one_image", "long_video", "text_only", "image_video_2"],
}
_PACKED = ["one_image", "video", "text_only", "image_video"]
VL_BATCH_KINDS = tuple(_BATCHES)


def _sample(spec, cfg: dict, gen: torch.Generator):
    """Token ids and the (kind, grid) list of one sample."""
    merge = cfg["vision_config"]["spatial_merge_size"]
    ids, vision = [], []
    for kind, arg in spec:
        if kind == "text":
            ids += torch.randint(*_TEXT_IDS, (arg,), generator=gen).tolist()
            continue
        t, h, w = arg
        ids += [cfg["vision_start_token_id"]] + [cfg[f"{kind}_token_id"]] * (t * h * w // merge**2)
        ids += [cfg["vision_end_token_id"]]
        vision.append((kind, arg))
    return ids, vision


def _pixels_and_grids(vision, cfg: dict, gen: torch.Generator) -> dict:
    v = cfg["vision_config"]
    patch_dim = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    out = {}
    videos = sum(kind == "video" for kind, _ in vision)
    if _is25(cfg) and videos:  # Qwen2.5-VL's processor gives one per video (temporal_patch_size / fps)
        out["second_per_grid_ts"] = torch.tensor([_SECONDS[i % len(_SECONDS)] for i in range(videos)])
    for kind, pixel_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                      ("video", "pixel_values_videos", "video_grid_thw")):
        grids = [g for k, g in vision if k == kind]
        if not grids:
            out[pixel_key] = out[grid_key] = None
            continue
        out[grid_key] = torch.tensor(grids, dtype=torch.long)
        out[pixel_key] = torch.randn(sum(t * h * w for t, h, w in grids), patch_dim, generator=gen)
    return out


def _types_and_labels(input_ids: torch.Tensor, cfg: dict, pad: torch.Tensor):
    types = torch.zeros_like(input_ids)
    types[input_ids == cfg["image_token_id"]] = 1
    types[input_ids == cfg["video_token_id"]] = 2
    labels = input_ids.masked_fill((types != 0) | pad, -100)
    return types, labels


def vl_batch(config_kwargs_or_name, kind: str, seed: int = 0, padding_side: str = "right") -> dict:
    """A padded batch of ``kind`` (one of ``VL_BATCH_KINDS``) for ``Qwen2VLForConditionalGeneration``.

    Keys: input_ids, attention_mask, labels (-100 on vision placeholders and padding), pixel_values,
    image_grid_thw, pixel_values_videos, video_grid_thw, mm_token_type_ids; None where absent; for a
    Qwen2.5-VL case with videos also second_per_grid_ts (one per video).
    Grids and pixel rows follow the images/videos in reading order, row after row.
    """
    cfg = _kwargs(config_kwargs_or_name)
    gen = torch.Generator().manual_seed(seed)
    rows, vision = [], []
    for spec in _BATCHES[kind]:
        ids, vis = _sample(_SAMPLES[spec], cfg, gen)
        rows.append(ids)
        vision += vis
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if padding_side == "right" else slice(width - len(r), width)
        input_ids[i, sl] = torch.tensor(r)
        attention_mask[i, sl] = 1
    types, labels = _types_and_labels(input_ids, cfg, attention_mask == 0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
            **_pixels_and_grids(vision, cfg, gen), "mm_token_type_ids": types}


def vl_packed_batch(name, seed: int = 0) -> dict:
    """Samples (image, video, text-only, image+video) packed into one row ``[1, T]`` without padding.

    Adds ``cu_seqlens`` (int32 segment boundaries); attention_mask is None. The first label of each
    segment is -100, as transformers' ``DataCollatorWithFlattening`` sets it, so that no segment is
    trained to predict the next one's first token and the packed loss is the per-segment loss.
    """
    cfg = _kwargs(name)
    gen = torch.Generator().manual_seed(seed)
    ids, vision, bounds = [], [], [0]
    for spec in _PACKED:
        sample_ids, vis = _sample(_SAMPLES[spec], cfg, gen)
        ids += sample_ids
        vision += vis
        bounds.append(len(ids))
    input_ids = torch.tensor([ids], dtype=torch.long)
    types, labels = _types_and_labels(input_ids, cfg, torch.zeros_like(input_ids, dtype=torch.bool))
    labels[0, bounds[:-1]] = -100
    return {"input_ids": input_ids, "attention_mask": None, "labels": labels,
            **_pixels_and_grids(vision, cfg, gen), "mm_token_type_ids": types,
            "cu_seqlens": torch.tensor(bounds, dtype=torch.int32)}
