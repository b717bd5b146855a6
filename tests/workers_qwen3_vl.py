"""Qwen3-VL cases, batches and worker bodies (run on every rank by tests/test_qwen3_vl.py): our parallel
model against transformers' ``Qwen3VLForConditionalGeneration`` loaded from the same directory in the
same process. Records are ``(case, layout, metric, value)``; the test file holds the bounds.

The two tiny cases differ in tying, vocabulary (101 divides by neither 2 nor 4), attention bias, M-RoPE
sections, vision patch size, depth, activation, learned position grid (4x4 and 6x6: images are
interpolated up and down) and DeepStack indexes (``[0, 2]``; ``[1, 0]``: block 1's merger 0 feeds
layer 1, block 0's merger 1 feeds layer 0, as transformers orders them by block).

Prompts are shaped like Qwen3-VL's processor output: an image is ``<vision_start>``, ``h*w/merge^2``
placeholders, ``<vision_end>``; a video is written frame by frame, each frame behind a timestamp token
(``<t> <vision_start> frame <vision_end>``), which is how transformers' ``get_rope_index`` expects them.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from parallel import ParallelConfig
from tests.cases import save_randomized
from tests.workers import _max_diff, _rel_diff, hf_named_grads, saved_tensors_diff
from tests.workers_vl import _inputs, _segments, _unscored_padding_predictions, bf16_records

PAD_ID = 0
_SPECIAL = {"image_token_id": 96, "video_token_id": 97, "vision_start_token_id": 98, "vision_end_token_id": 99}
_TEXT_IDS = (2, 96)
TIMESTAMP_ID = 95  # a plain text token standing for a frame's "<t seconds>" text


def _case(*, vocab, layers, mrope_section, bias, tied, theta, patch_size, depth, act, positions, deepstack):
    return {
        "text_config": {
            "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6, "attention_bias": bias, "pad_token_id": PAD_ID,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta, "mrope_section": mrope_section,
                                "mrope_interleaved": True},
        },
        "vision_config": {
            "depth": depth, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "out_hidden_size": 64,
            "patch_size": patch_size, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
            "hidden_act": act, "num_position_embeddings": positions, "deepstack_visual_indexes": deepstack,
        },
        "tie_word_embeddings": tied,
        **_SPECIAL,
    }


QWEN3_VL_CASES = {
    "q3_untied": _case(vocab=128, layers=3, mrope_section=[2, 3, 3], bias=False, tied=False, theta=10000.0,
                       patch_size=4, depth=3, act="gelu_pytorch_tanh", positions=16, deepstack=[0, 2]),
    "q3_tied": _case(vocab=101, layers=4, mrope_section=[4, 2, 2], bias=True, tied=True, theta=1000000.0,
                     patch_size=2, depth=2, act="gelu", positions=36, deepstack=[1, 0]),
}


def qwen3_vl_config(name_or_kwargs):
    from transformers import Qwen3VLConfig

    kwargs = QWEN3_VL_CASES[name_or_kwargs] if isinstance(name_or_kwargs, str) else name_or_kwargs
    return Qwen3VLConfig(**copy.deepcopy(kwargs))


def write_qwen3_vl_model(root, name: str, seed: int = 0) -> str:
    """Random ``Qwen3VLForConditionalGeneration`` of ``QWEN3_VL_CASES[name]`` saved by transformers under
    ``root/name``: norm weights uniform(0.5, 1.5), everything else (biases, position table) normal(0, 0.08)."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(qwen3_vl_config(name))
    return save_randomized(model, Path(root) / name)


# Samples: ("text", n) text tokens, ("image" | "video", (t, h, w)) grids in patches.
SAMPLES = {
    "two_images": [("text", 2), ("image", (1, 4, 6)), ("text", 3), ("image", (1, 2, 4)), ("text", 2)],
    "video": [("text", 2), ("video", (2, 4, 4)), ("text", 3)],
    "image_video": [("text", 1), ("image", (1, 6, 4)), ("text", 2), ("video", (3, 2, 4)), ("text", 3)],
    "text_only": [("text", 7)],
}
BATCHES = {
    "images_and_video": ["two_images", "video"],  # two images of different sizes and a video in one batch
    "mixed": ["image_video", "text_only", "two_images"],
}
PACKED = ["two_images", "video", "text_only", "image_video"]


def _sample(spec, cfg: dict, gen: torch.Generator):
    merge = cfg["vision_config"]["spatial_merge_size"]
    start, end = cfg["vision_start_token_id"], cfg["vision_end_token_id"]
    ids, vision = [], []
    for kind, arg in spec:
        if kind == "text":
            ids += torch.randint(_TEXT_IDS[0], TIMESTAMP_ID, (arg,), generator=gen).tolist()
            continue
        t, h, w = arg
        frame = [cfg[f"{kind}_token_id"]] * (h * w // merge ** 2)
        if kind == "image":
            ids += [start, *frame, end]
        else:
            for _ in range(t):
                ids += [TIMESTAMP_ID, start, *frame, end]
        vision.append((kind, arg))
    return ids, vision


def _pixels_and_grids(vision, cfg: dict, gen: torch.Generator) -> dict:
    v = cfg["vision_config"]
    patch_dim = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    out = {}
    for kind, pixel_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                      ("video", "pixel_values_videos", "video_grid_thw")):
        grids = [g for k, g in vision if k == kind]
        out[grid_key] = torch.tensor(grids, dtype=torch.long) if grids else None
        out[pixel_key] = torch.randn(sum(t * h * w for t, h, w in grids), patch_dim, generator=gen) if grids else None
    return out


def _types_and_labels(input_ids, cfg: dict, pad):
    types = torch.zeros_like(input_ids)
    types[input_ids == cfg["image_token_id"]] = 1
    types[input_ids == cfg["video_token_id"]] = 2
    return types, input_ids.masked_fill((types != 0) | pad, -100)


def qwen3_vl_batch(name, kind: str, seed: int = 0, padding_side: str = "right") -> dict:
    """A padded batch of ``BATCHES[kind]`` (input_ids, attention_mask, labels, pixels, grids, mm_token_type_ids);
    ``name``: a case of ``QWEN3_VL_CASES`` or a case dict of the same form (the multimodal Qwen3.5 tests')."""
    cfg = QWEN3_VL_CASES[name] if isinstance(name, str) else name
    gen = torch.Generator().manual_seed(seed)
    rows, vision = [], []
    for spec in BATCHES[kind]:
        ids, vis = _sample(SAMPLES[spec], cfg, gen)
        rows.append(ids)
        vision += vis
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if padding_side == "right" else slice(width - len(r), width)
        input_ids[i, sl], mask[i, sl] = torch.tensor(r), 1
    types, labels = _types_and_labels(input_ids, cfg, mask == 0)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, **_pixels_and_grids(vision, cfg, gen),
            "mm_token_type_ids": types}


def qwen3_vl_packed_batch(name, seed: int = 0) -> dict:
    """``PACKED`` samples in one row with ``cu_seqlens`` (each segment's first label -100); ``name`` as in
    ``qwen3_vl_batch``."""
    cfg = QWEN3_VL_CASES[name] if isinstance(name, str) else name
    gen = torch.Generator().manual_seed(seed)
    ids, vision, bounds = [], [], [0]
    for spec in PACKED:
        sample_ids, vis = _sample(SAMPLES[spec], cfg, gen)
        ids += sample_ids
        vision += vis
        bounds.append(len(ids))
    input_ids = torch.tensor([ids], dtype=torch.long)
    types, labels = _types_and_labels(input_ids, cfg, torch.zeros_like(input_ids, dtype=torch.bool))
    labels[0, bounds[:-1]] = -100
    return {"input_ids": input_ids, "attention_mask": None, "labels": labels, **_pixels_and_grids(vision, cfg, gen),
            "mm_token_type_ids": types, "cu_seqlens": torch.tensor(bounds, dtype=torch.int32)}


# ------------------------------------------------------------------ workers
def _grad_diff(model, hf, prefix: str) -> float:
    ours = hf_named_grads(model)
    ref = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    names = [n for n in ours if n.startswith(prefix)]
    if any(n not in ref for n in names):
        return float("inf")
    return max((_rel_diff(ours[n], ref[n]) for n in names), default=0.0)  # 0: this pipeline stage holds none


def _packed_reference(hf, packed: dict):
    logits, loss_sum, count = [], 0.0, 0
    for seg in _segments(packed, hf.config):
        out = hf(**seg)
        logits.append(out.logits[0])
        n = int((seg["labels"][0, 1:] != -100).sum())
        loss_sum, count = loss_sum + out.loss * n, count + n
    return torch.cat(logits), loss_sum / count


def parity(case: str, path: str, pconfig: ParallelConfig, steps: int = 2, lr: float = 0.2) -> list[tuple]:
    """Logits and loss for each padded batch (right and left padding) and the packed one, ``save_pretrained``
    bitwise, then two SGD steps on the images-and-video batch with every gradient compared."""
    from transformers import Qwen3VLForConditionalGeneration

    from models.qwen3_vl import build_parallel_model

    tag = (case, pconfig.describe())
    hf = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model = build_parallel_model(path, pconfig)
    records = []
    encoded = []  # patch rows this rank's tower encodes (cp/ulysses ranks share the images)
    hook = model.visual.patch_embed.register_forward_hook(lambda mod, args, out: encoded.append(out.shape[0]))
    for kind in BATCHES:
        for side in ("right", "left"):
            batch = qwen3_vl_batch(case, kind, padding_side=side)
            if side == "left":
                batch = _unscored_padding_predictions(batch)
            encoded.clear()
            with torch.no_grad():
                ours = model(**_inputs(batch), gather_logits=True)
                ref = hf(**_inputs(batch))
            if kind == "images_and_video" and side == "right":
                total = sum(int(g.prod()) for key in ("image_grid_thw", "video_grid_thw") for g in batch[key])
                records.append((*tag, "vision_share", sum(encoded) / total))
            valid = batch["attention_mask"].bool()
            records += [(*tag, f"logits_{kind}_{side}", _max_diff(ours.logits[valid], ref.logits[valid])),
                        (*tag, f"loss_{kind}_{side}", _max_diff(ours.loss, ref.loss))]
    hook.remove()
    packed = qwen3_vl_packed_batch(case)
    with torch.no_grad():
        ours = model(**_inputs(packed), gather_logits=True)
        ref_logits, ref_loss = _packed_reference(hf, packed)
    records += [(*tag, "logits_packed", _max_diff(ours.logits[0], ref_logits)),
                (*tag, "loss_packed", _max_diff(ours.loss, ref_loss)),
                (*tag, "saved_tensors", saved_tensors_diff(model, path, pconfig))]
    batch = qwen3_vl_batch(case, "images_and_video")
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(hf.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(**_inputs(batch), return_logits=False).loss
        loss.backward()
        model.finalize_grads()
        ref_loss = hf(**_inputs(batch)).loss
        ref_loss.backward()
        records += [(*tag, f"step{step}_loss", _max_diff(loss, ref_loss)),
                    (*tag, f"grads_vision_step{step}", _grad_diff(model, hf, "model.visual.")),
                    (*tag, f"grads_text_step{step}", _grad_diff(model, hf, "model.language_model."))]
        if not model.config.tie_word_embeddings:
            records.append((*tag, f"grads_head_step{step}", _grad_diff(model, hf, "lm_head.")))
        opt.step()
        ref_opt.step()
    return records


def training_parity(case: str, path: str, pconfig: ParallelConfig, microbatches: int = 2, steps: int = 2,
                    lr: float = 0.2) -> list[tuple]:
    """``forward_backward`` (micro-batches; pipeline stages with the tower and the DeepStack layers on the
    first) on the images-and-video batch, then the packed one: loss and every gradient against transformers."""
    from transformers import Qwen3VLForConditionalGeneration

    from models.qwen3_vl import build_parallel_model

    tag = (case, f"{pconfig.describe()} forward_backward({microbatches})")
    hf = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model = build_parallel_model(path, pconfig)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(hf.parameters(), lr=lr)
    records = []
    for step, batch in enumerate((qwen3_vl_batch(case, "images_and_video"), qwen3_vl_packed_batch(case))[:steps]):
        opt.zero_grad()
        ref_opt.zero_grad()
        inputs = _inputs(batch)
        ids, labels = inputs.pop("input_ids"), inputs.pop("labels")
        loss = model.forward_backward(ids, labels, num_microbatches=microbatches, **inputs)
        ref_loss = _packed_reference(hf, batch)[1] if "cu_seqlens" in batch else hf(**_inputs(batch)).loss
        ref_loss.backward()
        kind = "packed" if "cu_seqlens" in batch else "padded"
        records += [(*tag, f"step{step}_loss_{kind}", _max_diff(loss, ref_loss)),
                    (*tag, f"grads_vision_step{step}_{kind}", _grad_diff(model, hf, "model.visual.")),
                    (*tag, f"grads_text_step{step}_{kind}", _grad_diff(model, hf, "model.language_model."))]
        opt.step()
        ref_opt.step()
    return records


def bf16_parity(case: str, path: str, pconfig: ParallelConfig, *, moe: bool = False, base: str | None = None
                ) -> list[tuple]:
    """Ours in bf16 against transformers in bf16 on the images-and-video batch, and both against transformers
    in fp32 (the VL models' bf16 quantities, tests/vl_cases.py ``VL_BF16_BOUNDS``). ``moe``: Qwen3-VL-MoE, whose
    batches are those of the Qwen3-VL case ``base``."""
    if moe:
        from transformers import Qwen3VLMoeForConditionalGeneration as hf_class

        from models.qwen3_vl_moe import build_parallel_model
    else:
        from transformers import Qwen3VLForConditionalGeneration as hf_class

        from models.qwen3_vl import build_parallel_model

    tag = (case, pconfig.describe())
    model = build_parallel_model(path, pconfig, dtype=torch.bfloat16)
    hf = hf_class.from_pretrained(path, dtype=torch.bfloat16).eval()
    exact = hf_class.from_pretrained(path, dtype=torch.float32).eval()
    batch = _inputs(qwen3_vl_batch(base or case, "images_and_video"))
    return bf16_records(tag, model, hf, exact, batch)


def misplaced_placeholders(name: str) -> dict:
    """The mixed batch with one image placeholder moved from row 0 to the text-only row 1 (totals unchanged)."""
    batch = qwen3_vl_batch(name, "mixed")
    ids = batch["input_ids"].clone()
    image = QWEN3_VL_CASES[name]["image_token_id"]
    ids[0, (ids[0] == image).nonzero()[0, 0]] = 5
    ids[1, 3] = image
    return {**batch, "input_ids": ids, "mm_token_type_ids": None}


def bad_input(case: str, path: str, pconfig: ParallelConfig) -> list[tuple]:
    """Placeholders not matching a sample's images: the error on every rank, before any collective (a rank
    that entered the tower's or the layers' collectives alone would hang the group instead)."""
    from models.qwen3_vl import build_parallel_model
    from models.qwen3_vl.positions import VisionInputError

    model = build_parallel_model(path, pconfig)
    try:
        model(**_inputs(misplaced_placeholders(case)))
        message = "no error"
    except VisionInputError as exc:
        message = str(exc)
    return [(case, pconfig.describe(), "bad_input", message)]


def suite(dirs: dict[str, str], layouts: list[tuple]) -> list[tuple]:
    records = []
    for case, kwargs, *options in layouts:
        options = options[0] if options else {}
        if options.get("bad_input"):
            records += bad_input(case, dirs[case], ParallelConfig(**kwargs))
        elif options.get("bf16"):
            records += bf16_parity(case, dirs[case], ParallelConfig(**kwargs))
        elif options.get("forward_backward"):
            records += training_parity(case, dirs[case], ParallelConfig(**kwargs),
                                       microbatches=options.get("microbatches", 2))
        else:
            records += parity(case, dirs[case], ParallelConfig(**kwargs))
    return records
