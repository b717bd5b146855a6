"""Qwen3.5 / Qwen3.5-MoE vision-language cases, batches and rank bodies (tests/test_qwen3_5_vl.py): our model
against transformers' ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` loaded from
the same directory in the same process, fp32. Records are ``(case, layout, metric, value)``; the test file
holds the bounds.

Two tiny cases: ``dense`` (linear, full, linear, full layers; partial rotary 0.5 of head_dim 16, M-RoPE sections
[2, 1, 1] over its 4 frequencies; untied, vocab 128; tower patch 4, 4x4 position grid, tanh GELU) and ``moe``
(4 experts top-2 with the shared expert on every layer; head_dim 32 with transformers' default partial rotary
0.25 and default sections [11, 11, 10] over 4 frequencies: T, H, W, T; tied, vocab 101; tower patch 2, 6x6 grid,
GELU). Prompts and pixels are Qwen3-VL's (tests/workers_qwen3_vl.py ``SAMPLES``: two images of different sizes
and a two-frame video in one batch, a mixed batch with a text-only row, four packed samples), videos written
frame by frame behind timestamps as transformers' ``get_rope_index`` expects them.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from parallel import ParallelConfig
from tests.workers import _max_diff, _rel_diff, hf_named_grads, saved_tensors_diff
from tests.workers_moe import hf_grads
from tests.workers_qwen3_vl import _packed_reference, qwen3_vl_batch, qwen3_vl_packed_batch
from tests.workers_vl import _inputs, _unscored_padding_predictions, bf16_records, count_placed_visual_tokens

PAD_ID = 0
# SGD steps of lr 0.02, as the text hybrids' layout tests (tests/test_qwen3_5_layouts.py): after a step of lr 0.2
# these randomized hybrids amplify fp32 rounding (step-1 gradients of layer 0's Gated DeltaNet 6.5e-5 from
# transformers' in one process, 9.5e-5 under FSDP2; transformers' own fp32 against fp64 1.4e-5 there, ours 6e-5:
# a different chunked algorithm, parallel/gated_delta_chunk.py); at lr 0.02 both sit within 3e-5 of fp64
LR = 0.02
_SPECIAL = {"image_token_id": 96, "video_token_id": 97, "vision_start_token_id": 98, "vision_end_token_id": 99}
LIN, FULL = "linear_attention", "full_attention"
_TEXT = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             layer_types=[LIN, FULL, LIN, FULL], max_position_embeddings=256, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24, pad_token_id=PAD_ID)
_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, temporal_patch_size=2,
               spatial_merge_size=2, in_channels=3)

CASES = {
    "dense": {"text_config": {**_TEXT, "vocab_size": 128, "intermediate_size": 96, "head_dim": 16,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                                  "mrope_interleaved": True}},
              "vision_config": {**_VISION, "patch_size": 4, "num_position_embeddings": 16,
                                "hidden_act": "gelu_pytorch_tanh"},
              "tie_word_embeddings": False, **_SPECIAL},
    "moe": {"text_config": {**_TEXT, "vocab_size": 101, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                            "router_aux_loss_coef": 0.1},
            "vision_config": {**_VISION, "patch_size": 2, "num_position_embeddings": 36, "hidden_act": "gelu"},
            "tie_word_embeddings": True, **_SPECIAL},
}


def hf_classes(name: str):
    """transformers' (config class, model class) of a case."""
    import transformers

    prefix = "Qwen3_5Moe" if name == "moe" else "Qwen3_5"
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForConditionalGeneration")


def build_ours(name: str, source, pconfig: ParallelConfig | None = None, **kw):
    import importlib

    return importlib.import_module(f"models.qwen3_5{'_moe' if name == 'moe' else ''}").build_parallel_model(
        source, pconfig, **kw)


def load_hf(name: str, path: str):
    return hf_classes(name)[1].from_pretrained(path, dtype=torch.float32).eval()


def write_case(root, name: str, seed: int = 0, text_overrides: dict | None = None) -> str:
    """A random conditional-generation model of ``CASES[name]`` (``text_config`` fields replaced by
    ``text_overrides``) saved by transformers under ``root/name``: the hybrids' randomization (slow decays,
    zero-centred norms around 0, the gated norm around 1), the tower's LayerNorms around 1, everything else
    normal(0, 0.08)."""
    config_cls, model_cls = hf_classes(name)
    torch.manual_seed(seed)
    case = copy.deepcopy(CASES[name])
    case["text_config"].update(text_overrides or {})
    model = model_cls(config_cls(**case))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):
                p.normal_(-2.0, 0.5)
            elif pname.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
            elif "conv1d" in pname:
                p.normal_(0.0, 0.3)
            elif pname.endswith("linear_attn.norm.weight") or ("visual" in pname and "norm" in pname
                                                               and pname.endswith(".weight")):
                p.normal_(1.0, 0.1)
            elif "norm" in pname and "visual" not in pname:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    path = Path(root) / name
    model.save_pretrained(path)
    return str(path)


# ------------------------------------------------------------------ batches (Qwen3-VL's samples)
def vl_batch(name: str, kind: str, seed: int = 0, padding_side: str = "right") -> dict:
    """Qwen3-VL's padded batch of ``BATCHES[kind]`` for ``CASES[name]``; left padding: with the padding's
    predictions unscored (as the Qwen3-VL tests do before comparing)."""
    batch = qwen3_vl_batch(CASES[name], kind, seed, padding_side)
    return _unscored_padding_predictions(batch) if padding_side == "left" else batch


def vl_packed_batch(name: str, seed: int = 0) -> dict:
    """Qwen3-VL's packed batch (``PACKED`` samples, ``cu_seqlens``) for ``CASES[name]``."""
    return qwen3_vl_packed_batch(CASES[name], seed)


def short_of_one_image_token(name: str) -> dict:
    """The images-and-video batch with one image placeholder of row 0 turned into text: row 0's image tokens no
    longer add up to its images' features."""
    batch = vl_batch(name, "images_and_video")
    ids = batch["input_ids"].clone()
    ids[0, (ids[0] == CASES[name]["image_token_id"]).nonzero()[0, 0]] = 5
    return {**batch, "input_ids": ids, "mm_token_type_ids": None}


def moved_image_token(name: str) -> dict:
    """The images-and-video batch with row 0's last image placeholder moved to row 1 (totals unchanged): row 0's
    second image is short of a token."""
    batch = vl_batch(name, "images_and_video")
    ids, image = batch["input_ids"].clone(), CASES[name]["image_token_id"]
    ids[0, (ids[0] == image).nonzero()[-1, 0]] = 5
    ids[1, 0] = image
    return {**batch, "input_ids": ids, "mm_token_type_ids": None}


# ------------------------------------------------------------------ rank bodies
def _grad_rel(model, hf, prefix: str) -> float:
    """Largest relative gradient difference over the HF tensors under ``prefix`` this rank holds (inf: a name
    transformers does not have)."""
    ours, ref = hf_named_grads(model), hf_grads(hf)
    names = [n for n in ours if n.startswith(prefix)]
    if any(n not in ref for n in names):
        return float("inf")
    return max((_rel_diff(ours[n], ref[n]) for n in names), default=0.0)  # 0: this pipeline stage holds none


def _step_records(tag, model, hf, loss, ref_loss, step) -> list[tuple]:
    out = [(*tag, f"step{step}_loss", _max_diff(loss, ref_loss)),
           (*tag, f"grads_vision_step{step}", _grad_rel(model, hf, "model.visual.")),
           (*tag, f"grads_text_step{step}", _grad_rel(model, hf, "model.language_model."))]
    if not model.config.tie_word_embeddings:
        out.append((*tag, f"grads_head_step{step}", _grad_rel(model, hf, "lm_head.")))
    return out


def parity(case: str, path: str, pconfig: ParallelConfig, *, save: bool = False, steps: int = 2,
           lr: float = LR) -> list[tuple]:
    """Logits and loss on the images-and-video batch (right padding), the mixed batch (left padding) and the
    packed batch (against each sample run alone: transformers ignores packing), optionally ``save_pretrained``
    bitwise, then SGD steps on the images-and-video batch with every gradient compared."""
    tag = (case, pconfig.describe())
    hf, model = load_hf(case, path), build_ours(case, path, pconfig)
    records, placed = [], []
    if pconfig.cp > 1:  # count the visual tokens whose features land in this rank's chunk
        count_placed_visual_tokens(model, placed)
    for kind, side in (("images_and_video", "right"), ("mixed", "left")):
        batch = vl_batch(case, kind, padding_side=side)
        placed.clear()
        with torch.no_grad():
            ours, ref = model(**_inputs(batch), gather_logits=True), hf(**_inputs(batch))
        if placed and kind == "images_and_video":
            records.append((*tag, "local_visual_tokens", sum(placed)))
        valid = batch["attention_mask"].bool()
        records += [(*tag, f"logits_{kind}_{side}", _max_diff(ours.logits[valid], ref.logits[valid])),
                    (*tag, f"loss_{kind}_{side}", _max_diff(ours.loss, ref.loss))]
    packed = vl_packed_batch(case)
    with torch.no_grad():
        ours = model(**_inputs(packed), gather_logits=True)
        ref_logits, ref_loss = _packed_reference(hf, packed)
    records += [(*tag, "logits_packed", _max_diff(ours.logits[0], ref_logits)),
                (*tag, "loss_packed", _max_diff(ours.loss, ref_loss))]
    if save:
        records.append((*tag, "saved_tensors", saved_tensors_diff(model, path, pconfig)))
    batch = vl_batch(case, "images_and_video")
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(hf.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(**_inputs(batch), return_logits=False).loss
        loss.backward()
        model.finalize_grads()
        ref_loss = hf(**_inputs(batch)).loss
        ref_loss.backward()
        records += _step_records(tag, model, hf, loss, ref_loss, step)
        opt.step()
        ref_opt.step()
    return records


def training_parity(case: str, path: str, pconfig: ParallelConfig, microbatches: int = 2) -> list[tuple]:
    """``forward_backward`` (micro-batches; pipeline stages with the tower on the first) on the images-and-video
    batch, then on the packed one after an SGD step: loss and every gradient against transformers."""
    tag = (case, f"{pconfig.describe()} forward_backward({microbatches})")
    hf, model = load_hf(case, path), build_ours(case, path, pconfig)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(hf.parameters(), lr=LR)
    records = []
    for step, batch in enumerate((vl_batch(case, "images_and_video"), vl_packed_batch(case))):
        opt.zero_grad()
        ref_opt.zero_grad()
        inputs = _inputs(batch)
        ids, labels = inputs.pop("input_ids"), inputs.pop("labels")
        loss = model.forward_backward(ids, labels, num_microbatches=microbatches, **inputs)
        ref_loss = _packed_reference(hf, batch)[1] if "cu_seqlens" in batch else hf(**_inputs(batch)).loss
        ref_loss.backward()
        records += _step_records(tag, model, hf, loss, ref_loss, step)
        opt.step()
        ref_opt.step()
    return records


def bf16_parity(case: str, path: str, pconfig: ParallelConfig) -> list[tuple]:
    """Ours in bf16 against transformers in bf16 on the images-and-video batch, and both against transformers in
    fp32: the quantities of tests/workers_qwen3_vl.py ``bf16_parity`` (bounded by tests/vl_cases.py
    ``VL_BF16_BOUNDS``) for this family's classes and batches."""
    tag = (case, pconfig.describe())
    model = build_ours(case, path, pconfig, dtype=torch.bfloat16).eval()
    hf_class = hf_classes(case)[1]
    hf = hf_class.from_pretrained(path, dtype=torch.bfloat16).eval()
    exact = load_hf(case, path)
    batch = _inputs(vl_batch(case, "images_and_video"))
    return bf16_records(tag, model, hf, exact, batch)


def bad_input(case: str, path: str, pconfig: ParallelConfig) -> list[tuple]:
    """Image tokens not matching the images' features: the error on every rank, before any collective."""
    from models.common.vision.positions import VisionInputError

    model = build_ours(case, path, pconfig)
    try:
        model(**_inputs(short_of_one_image_token(case)))
        message = "no error"
    except VisionInputError as exc:
        message = str(exc)
    return [(case, pconfig.describe(), "bad_input", message)]


def suite(dirs: dict[str, str], layouts: list[tuple]) -> list[tuple]:
    """Every layout of one world size in one group of processes: ``(case, ParallelConfig kwargs[, options])``."""
    torch.set_num_threads(1)
    records = []
    for case, kwargs, *options in layouts:
        options = options[0] if options else {}
        pconfig = ParallelConfig(**kwargs)
        if options.get("bad_input"):
            records += bad_input(case, dirs[case], pconfig)
        elif options.get("bf16"):
            records += bf16_parity(case, dirs[case], pconfig)
        elif options.get("forward_backward"):
            records += training_parity(case, dirs[case], pconfig, microbatches=options.get("microbatches", 2))
        else:
            records += parity(case, dirs[case], pconfig, save=options.get("save", False))
    return records
