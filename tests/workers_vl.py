"""Qwen2-VL and Qwen2.5-VL worker bodies (run on every rank by tests/test_qwen2_vl.py and
tests/test_qwen2_5_vl.py): our parallel model against transformers' ``Qwen2VLForConditionalGeneration``
(``Qwen2_5_VLForConditionalGeneration``) loaded from the same directory in the same process; the
directory's config.json says which.

Records are ``(case, layout, metric, value)``; the test file holds the bounds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.qwen2_vl.architecture import ARCHITECTURE
from parallel import ParallelConfig
from parallel.layers import RowParallelLinear, set_tp_reduce_in_fp32
from tests.vl_cases import vl_batch, vl_packed_batch
from tests.workers import _max_diff, _rel_diff, hf_named_grads, saved_tensors_diff

PADDED_KINDS = ("one_image", "two_images", "video", "image_video", "mixed")


def _inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if v is not None}


def _family(path: str):
    """transformers' model class and our ``build_parallel_model`` for the model saved at ``path``."""
    if json.loads((Path(path) / "config.json").read_text())["model_type"] == "qwen2_5_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration as hf_class

        from models.qwen2_5_vl import build_parallel_model
    else:
        from transformers import Qwen2VLForConditionalGeneration as hf_class

        from models.qwen2_vl import build_parallel_model
    return hf_class, build_parallel_model


def _unscored_padding_predictions(batch: dict) -> dict:
    """Left padding: the prediction of a row's first real token is made *from* a padding slot, whose
    logits are not defined by the model (each implementation masks fully padded queries its own way);
    that label is ignored so both sides score the same predictions."""
    labels = batch["labels"].clone()
    for row, mask in enumerate(batch["attention_mask"]):
        real = mask.nonzero()
        if len(real) and real[0, 0] > 0:
            labels[row, real[0, 0]] = -100
    return {**batch, "labels": labels}


def _segments(batch: dict, cfg) -> list[dict]:
    """The samples of a packed batch as batches of one, each with its own pixels and grids."""
    vis = cfg.vision_config
    merge = vis.spatial_merge_size
    bounds = batch["cu_seqlens"].tolist()
    ids = batch["input_ids"][0]
    queues = {}
    for kind, token, pixels_key, grid_key in (("image", cfg.image_token_id, "pixel_values", "image_grid_thw"),
                                              ("video", cfg.video_token_id, "pixel_values_videos", "video_grid_thw")):
        grid = batch.get(grid_key)
        queues[kind] = (token, pixels_key, grid_key, list(grid) if grid is not None else [],
                        batch.get(pixels_key))
    offsets = {"image": 0, "video": 0}
    seconds, videos = batch.get("second_per_grid_ts"), 0  # Qwen2.5-VL: one per video, in order
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        seg = {"input_ids": ids[a:b][None], "labels": batch["labels"][0, a:b][None],
               "mm_token_type_ids": batch["mm_token_type_ids"][0, a:b][None]}
        for kind, (token, pixels_key, grid_key, grids, pixels) in queues.items():
            need = int((ids[a:b] == token).sum())
            taken = []
            while need > 0:
                g = grids.pop(0)
                taken.append(g)
                need -= int(g.prod()) // merge ** 2
            if taken:
                rows = sum(int(g.prod()) for g in taken)
                seg[grid_key] = torch.stack(taken)
                seg[pixels_key] = pixels[offsets[kind]:offsets[kind] + rows]
                offsets[kind] += rows
                if kind == "video" and seconds is not None:
                    seg["second_per_grid_ts"] = seconds[videos:videos + len(taken)]
                    videos += len(taken)
        out.append(seg)
    return out


def hf_grads(hf) -> dict[str, torch.Tensor]:
    """transformers' gradients under the on-disk names (``model.language_model.*`` -> ``model.*`` ...)."""
    return {ARCHITECTURE.canonical_name(n): p.grad for n, p in hf.named_parameters() if p.grad is not None}


def _grad_diff(model, hf, prefix: str) -> float:
    ours = hf_named_grads(model)
    ref = hf_grads(hf)
    worst = 0.0
    for name, grad in ours.items():
        if not name.startswith(prefix):
            continue
        if name not in ref:
            return float("inf")
        worst = max(worst, _rel_diff(grad, ref[name]))
    return worst


def parity(case: str, path: str, pconfig: ParallelConfig, steps: int = 2, lr: float = 0.2) -> list[tuple]:
    """Logits and loss for every batch kind (right and left padding, packed), then two SGD steps
    on the mixed batch with every gradient compared (vision and text), then logits again."""
    hf_class, build_parallel_model = _family(path)
    tag = (case, pconfig.describe())
    hf = hf_class.from_pretrained(path, dtype=torch.float32).eval()
    model = build_parallel_model(path, pconfig)
    records = []
    encoded = []  # patch rows this rank's tower encodes (cp/ulysses ranks share the images)
    hook = model.visual.patch_embed.register_forward_hook(lambda mod, args, out: encoded.append(out.shape[0]))
    for kind in PADDED_KINDS:
        for side in ("right", "left"):
            batch = vl_batch(case, kind, padding_side=side)
            if side == "left":
                batch = _unscored_padding_predictions(batch)
            encoded.clear()
            with torch.no_grad():
                ours = model(**_inputs(batch), gather_logits=True)
                ref = hf(**_inputs(batch))
            if kind == "mixed" and side == "right":
                total = sum(int(g.prod()) for key in ("image_grid_thw", "video_grid_thw")
                            if batch.get(key) is not None for g in batch[key])
                records.append((*tag, "vision_share", sum(encoded) / total))
            valid = batch["attention_mask"].bool()
            records += [(*tag, f"logits_{kind}_{side}", _max_diff(ours.logits[valid], ref.logits[valid])),
                        (*tag, f"loss_{kind}_{side}", _max_diff(ours.loss, ref.loss))]
    hook.remove()
    packed = vl_packed_batch(case)
    with torch.no_grad():
        ours = model(**_inputs(packed), gather_logits=True)
        ref_logits, ref_loss_sum, ref_count = [], 0.0, 0
        for seg in _segments(packed, hf.config):
            out = hf(**seg)
            ref_logits.append(out.logits[0])
            n = int((seg["labels"][0, 1:] != -100).sum())
            ref_loss_sum, ref_count = ref_loss_sum + out.loss * n, ref_count + n
    records += [(*tag, "logits_packed", _max_diff(ours.logits[0], torch.cat(ref_logits))),
                (*tag, "loss_packed", _max_diff(ours.loss, ref_loss_sum / ref_count))]
    records.append((*tag, "saved_tensors", saved_tensors_diff(model, path, pconfig)))

    batch = vl_batch(case, "mixed")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(hf.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(**_inputs(batch), return_logits=False).loss
        loss.backward()
        model.finalize_grads()
        ref_loss = hf(**_inputs(batch)).loss
        ref_loss.backward()
        records += [(*tag, f"step{step}_loss", _max_diff(loss, ref_loss)),
                    (*tag, f"grads_vision_step{step}", _grad_diff(model, hf, "visual.")),
                    (*tag, f"grads_text_step{step}", _grad_diff(model, hf, "model.")),
                    (*tag, f"grads_head_step{step}", _grad_diff(model, hf, "lm_head."))]
        opt.step()
        ref_opt.step()
    with torch.no_grad():
        ours = model(**_inputs(batch), gather_logits=True)
        ref = hf(**_inputs(batch))
    valid = batch["attention_mask"].bool()
    records.append((*tag, "logits_after_steps", _max_diff(ours.logits[valid], ref.logits[valid])))
    return records


def training_parity(case: str, path: str, pconfig: ParallelConfig, microbatches: int = 2, steps: int = 2,
                    lr: float = 0.2) -> list[tuple]:
    """``forward_backward`` (micro-batches, pipeline stages with the tower on the first) on the mixed
    padded batch, then on the packed batch: loss and every gradient against transformers' whole batch."""
    hf_class, build_parallel_model = _family(path)
    tag = (case, f"{pconfig.describe()} forward_backward({microbatches})")
    hf = hf_class.from_pretrained(path, dtype=torch.float32).eval()
    model = build_parallel_model(path, pconfig)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(hf.parameters(), lr=lr)
    records = []
    padded, packed = vl_batch(case, "mixed"), vl_packed_batch(case)
    for step in range(steps):
        batch = padded if step % 2 == 0 else packed
        opt.zero_grad()
        ref_opt.zero_grad()
        inputs = _inputs(batch)
        ids, labels = inputs.pop("input_ids"), inputs.pop("labels")
        loss = model.forward_backward(ids, labels, num_microbatches=microbatches, **inputs)
        if "cu_seqlens" in batch:  # transformers per segment, weighted by its scored tokens
            total, count = 0.0, 0
            for seg in _segments(batch, hf.config):
                n = int((seg["labels"][0, 1:] != -100).sum())
                total, count = total + hf(**seg).loss * n, count + n
            ref_loss = total / count
        else:
            ref_loss = hf(**_inputs(batch)).loss
        ref_loss.backward()
        kind = "packed" if "cu_seqlens" in batch else "padded"
        records += [(*tag, f"step{step}_loss_{kind}", _max_diff(loss, ref_loss)),
                    (*tag, f"grads_vision_step{step}_{kind}", _grad_diff(model, hf, "visual.")),
                    (*tag, f"grads_text_step{step}_{kind}", _grad_diff(model, hf, "model."))]
        opt.step()
        ref_opt.step()
    return records


def bf16_parity(case: str, path: str, pconfig: ParallelConfig) -> list[tuple]:
    """Our model in bf16 against transformers in bf16 on the same weights (the mixed batch: images and
    a video, right padding), and both against transformers in fp32: ``bf16_records``' quantities."""
    hf_class, build_parallel_model = _family(path)
    model = build_parallel_model(path, pconfig, dtype=torch.bfloat16)
    hf = hf_class.from_pretrained(path, dtype=torch.bfloat16).eval()
    exact = hf_class.from_pretrained(path, dtype=torch.float32).eval()
    # the plain TP model's distances are not recorded: tests/test_qwen2_5_vl.py bounds every bf16_* record
    return bf16_records((case, pconfig.describe()), model, hf, exact, _inputs(vl_batch(case, "mixed")),
                        report_plain_tp=False)


def suite(dirs: dict[str, str], layouts: list[tuple]) -> list[tuple]:
    records = []
    for case, kwargs, *options in layouts:
        options = options[0] if options else {}
        if options.get("bf16"):
            records += bf16_parity(case, dirs[case], ParallelConfig(**kwargs))
        elif options.get("forward_backward"):
            records += training_parity(case, dirs[case], ParallelConfig(**kwargs),
                                       microbatches=options.get("microbatches", 2))
        else:
            records += parity(case, dirs[case], ParallelConfig(**kwargs))
    return records


def bad_input_messages(path: str, pconfig_kwargs: dict) -> list[str]:
    """Inconsistent vision inputs: the error each raises (before any collective, on every rank)."""
    from models.qwen2_vl import build_parallel_model
    from models.qwen2_vl.positions import VisionInputError

    model = build_parallel_model(path, ParallelConfig(**pconfig_kwargs))
    case = Path(path).name
    good = vl_batch(case, "one_image")
    cfg = model.config.vision
    fewer_tokens = dict(good)
    ids = good["input_ids"].clone()
    first = int((ids[0] == cfg.image_token_id).nonzero()[0, 0])
    ids[0, first] = 5  # one placeholder token fewer than the grid's
    fewer_tokens["input_ids"] = ids
    odd_grid = {**good, "image_grid_thw": torch.tensor([[1, 3, 4]])}
    short_pixels = {**good, "pixel_values": good["pixel_values"][:-1]}
    wide_pixels = {**good, "pixel_values": torch.cat([good["pixel_values"], good["pixel_values"][:, :1]], dim=1)}
    messages = []
    for bad in (fewer_tokens, odd_grid, short_pixels, wide_pixels):
        try:
            model(**_inputs(bad))
            messages.append("no error")
        except VisionInputError as exc:
            messages.append(str(exc))
    return messages


def dp_text_and_image_ranks(path: str) -> list[tuple]:
    """Two DP ranks, one with an image batch and one text-only: the averaged gradients (tower
    included, which only one rank used) against transformers' two losses averaged."""
    import torch.distributed as dist
    from transformers import Qwen2VLForConditionalGeneration

    from models.qwen2_vl import build_parallel_model

    case = Path(path).name
    hf = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model = build_parallel_model(path, ParallelConfig())  # dp = world size
    image, text = vl_batch(case, "one_image"), vl_batch(case, "mixed")
    text = {k: v for k, v in text.items() if k in ("input_ids", "attention_mask", "labels")}
    vis = model.config.vision
    placeholders = (text["input_ids"] == vis.image_token_id) | (text["input_ids"] == vis.video_token_id)
    text["input_ids"] = text["input_ids"].masked_fill(placeholders, 5)  # plain text tokens instead
    mine = image if dist.get_rank() == 0 else text
    model(**_inputs(mine), return_logits=False).loss.backward()
    model.finalize_grads()
    ((hf(**_inputs(image)).loss + hf(**_inputs(text)).loss) / 2).backward()
    tag = (case, "dp=2 image rank + text rank")
    return [(*tag, "grads_vision", _grad_diff(model, hf, "visual.")),
            (*tag, "grads_text", _grad_diff(model, hf, "model."))]


def vllm_outputs(case: str, path: str, out: str, layout: dict | None = None) -> list[tuple]:
    """Train a TP2xPP2 (or ``layout``) Qwen2-VL / Qwen2.5-VL two SGD steps (vision tower and one layer on
    stage 0, Fused(3) qkv shards; vLLM splits the layers 2+1 instead), then write
    what tests/test_vllm_vl.py checks with vLLM itself:
      hf/                              save_pretrained
      export-tp{N}.rank{r}.safetensors iter_export("vllm", target_tp=N, target_rank=r) (rank 0 writes)
      sharded-tp{N}-pp{M}/             save_vllm_sharded_state(tp=N, pp=M)
    and returns per rank whether the shared-memory export equals the collective one bitwise (HF, and
    vLLM's shards for TP 1 and 2)."""
    import torch.distributed as dist

    from tests.workers_vllm import write_vllm_exports

    build_parallel_model = _family(path)[1]
    layout = layout or {"tp": 2, "pp": 2, "num_layers_in_first_pipeline_stage": 1}
    model = build_parallel_model(path, ParallelConfig(**layout))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    batch = _inputs(vl_batch(case, "mixed"))
    ids, labels = batch.pop("input_ids"), batch.pop("labels")
    for _ in range(2):
        opt.zero_grad()
        model.forward_backward(ids, labels, num_microbatches=2, **batch)
        opt.step()
    root, rank = Path(out), dist.get_rank()
    model.save_pretrained(root / "hf")
    write_vllm_exports(model, root, (1, 2))
    for n, pp in ((1, 1), (2, 1), (1, 2)):
        model.save_vllm_sharded_state(root / f"sharded-tp{n}-pp{pp}", tp=n, pp=pp, max_shard_size=100_000)
    collective = {n: t.clone() for b in model.iter_export("hf", bucket_bytes=20000) for n, t in b.tensors()}
    shared = {n: t.clone() for b in model.iter_export("hf", bucket_bytes=20000, transport="shm")
              for n, t in b.tensors()}
    same = collective.keys() == shared.keys() and all(torch.equal(collective[k], shared[k]) for k in collective)
    records = [(rank, "shm_equals_collective", same)]
    for n in (1, 2):  # vLLM's shards (vision qkv re-cut from our per-block Fused shards), every target rank
        for r in range(n):
            kw = {"target_tp": n, "target_rank": r, "bucket_bytes": 20000}
            collective = {k: t.clone() for b in model.iter_export("vllm", **kw) for k, t in b.tensors()}
            shared = {k: t.clone() for b in model.iter_export("vllm", transport="shm", **kw) for k, t in b.tensors()}
            same = collective.keys() == shared.keys() and all(torch.equal(collective[k], shared[k])
                                                               for k in collective)
            records.append((rank, f"shm_equals_collective_vllm_tp{n}_rank{r}", same))
    return records


def count_placed_visual_tokens(model, placed: list) -> None:
    """From now on, each placement of visual features on this rank's part of the sequence (cp chunks, Ulysses
    shards) appends to ``placed`` how many tokens it changed; ``del model._place_local_features`` ends it."""
    place = model._place_local_features

    def counting(h, *args):
        out = place(h, *args)
        placed.append(int((out != h).any(-1).sum()))
        return out
    model._place_local_features = counting


def bf16_records(tag: tuple, model, hf, exact, batch: dict, report_plain_tp: bool = True) -> list[tuple]:
    """Ours in bf16 (``model``) against transformers in bf16 (``hf``) on ``batch``, and both against transformers in
    fp32 (``exact``): the VL models' bf16 quantities, bounded by tests/vl_cases.py ``VL_BF16_BOUNDS``.

    At tp > 1 ``bf16_logits_rel`` and ``bf16_loss`` are those of the model run with ``ParallelConfig.tp_reduce_in_fp32``
    (set on the built model by ``parallel.layers.set_tp_reduce_in_fp32``, what ``build_model`` calls with the flag:
    row-parallel partial sums in fp32, rounded once; on the development CPU bitwise transformers'), the ratio the
    plain model's;
    the plain model's distance to transformers' bf16 is ``bf16_tp_logits_rel`` / ``bf16_tp_loss`` (not bounded:
    it is both sides' bf16 error against fp32, which here reaches 6% of max |logit| for transformers alone, and the
    ratio bounds ours). Under cp / ulysses each rank records the visual tokens placed in its own part of the
    sequence (``bf16_local_visual_tokens``)."""
    low = {k: v.to(torch.bfloat16) if k.startswith("pixel_values") else v for k, v in batch.items()}
    groups, placed = model.groups, []
    if groups.cp_size > 1 or groups.ulysses_size > 1:
        count_placed_visual_tokens(model, placed)
    with torch.no_grad():
        ours, ref, truth = model(**low, gather_logits=True), hf(**low), exact(**batch)
    if placed:
        del model._place_local_features
        records = [(*tag, "bf16_local_visual_tokens", sum(placed))]
    else:
        records = []
    valid = batch["attention_mask"].bool()
    ours_l, ref_l, truth_l = (x.logits[valid].float() for x in (ours, ref, truth))
    scale = truth_l.abs().max().item()
    records.append((*tag, "bf16_vs_fp32_ratio", _max_diff(ours_l, truth_l) / max(_max_diff(ref_l, truth_l), 1e-6)))
    close = [(*tag, "bf16_logits_rel", _max_diff(ours_l, ref_l) / scale),
             (*tag, "bf16_loss", _max_diff(ours.loss.float(), ref.loss.float()))]
    if groups.tp_size > 1:
        if report_plain_tp:
            records += [(tag[0], tag[1], name.replace("bf16_", "bf16_tp_"), value) for *_, name, value in close]
        assert not any(m.reduce_in_fp32 for m in model.modules() if isinstance(m, RowParallelLinear))
        assert set_tp_reduce_in_fp32(model, True) > 0
        with torch.no_grad():
            ours = model(**low, gather_logits=True)
        set_tp_reduce_in_fp32(model, False)
        ours_l = ours.logits[valid].float()
        close = [(*tag, "bf16_logits_rel", _max_diff(ours_l, ref_l) / scale),
                 (*tag, "bf16_loss", _max_diff(ours.loss.float(), ref.loss.float()))]
    return close + records
