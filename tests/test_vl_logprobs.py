"""RL log-probs with images (issue 41 item 3): Qwen3-VL's ``forward_backward(..., forward_only=True)``
(the fused head, no full logits) on the images-and-video batch and the packed batch, against
transformers' ``log_softmax(logits).gather(labels)`` (the packed batch: each sequence alone), fp32,
at TP1 and TP2+SP; ``return_entropy=True`` against the entropy of transformers' distribution.
~20 s on 2 cores."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed import run_distributed
from tests.workers_qwen3_vl import qwen3_vl_batch, qwen3_vl_packed_batch, write_qwen3_vl_model
from tests.workers_vl import _inputs, _segments

TOL = 1e-5


def _reference(hf, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the labels and entropies, laid out like ``input_ids`` (0 at first tokens,
    padding and ignored labels), from transformers' full logits."""
    def score(logits, labels):
        lp = torch.log_softmax(logits.float(), -1)
        tgt = labels[:, 1:]
        got = lp[:, :-1].gather(-1, tgt.clamp(min=0)[..., None])[..., 0] * (tgt != -100)
        ent = -(lp.exp() * lp).sum(-1)[:, :-1]
        zero = torch.zeros(labels.shape[0], 1)
        return torch.cat([zero, got], 1), torch.cat([zero, ent], 1)

    if "cu_seqlens" not in batch or batch["cu_seqlens"] is None:
        with torch.no_grad():
            logits = hf(**_inputs(batch)).logits
        lp, ent = score(logits, batch["labels"])
        mask = batch["attention_mask"].bool()
        return lp * mask, ent * mask
    parts = []
    with torch.no_grad():
        for seg in _segments(batch, hf.config):
            parts.append(score(hf(**seg).logits, seg["labels"]))
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


def logprob_records(path: str, tp: int) -> list[tuple]:
    """Rank body: ours' forward-only log-probs and entropies against transformers' on both batches."""
    from transformers import Qwen3VLForConditionalGeneration

    from models.qwen3_vl import build_parallel_model
    from parallel import ParallelConfig

    model = build_parallel_model(path, ParallelConfig(tp=tp, sequence_parallel=tp > 1))
    hf = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    records = []
    for kind, batch in (("padded", qwen3_vl_batch("q3_untied", "images_and_video")),
                        ("packed", qwen3_vl_packed_batch("q3_untied"))):
        inputs = _inputs(batch)
        ids, labels = inputs.pop("input_ids"), inputs.pop("labels")
        with torch.no_grad():
            lp, ent = model.forward_backward(ids, labels, forward_only=True, return_entropy=True, **inputs)
        ref_lp, ref_ent = _reference(hf, batch)
        scored = labels != -100
        scored[:, 0] = False  # a first token is predicted by nothing
        records += [(tp, kind, "logprobs", (lp.reshape(ref_lp.shape) - ref_lp).abs().max().item()),
                    (tp, kind, "scored_nonzero", float(bool((lp.reshape(ref_lp.shape)[scored] != 0).all()))),
                    (tp, kind, "entropy", (ent.reshape(ref_ent.shape)[scored] - ref_ent[scored]).abs().max().item())]
    return records


@pytest.fixture(scope="module")
def q3_path(tmp_path_factory):
    return write_qwen3_vl_model(tmp_path_factory.mktemp("vl_logprobs"), "q3_untied", seed=41)


@functools.lru_cache(maxsize=None)
def _records(tp: int, path: str) -> tuple:
    return tuple(logprob_records(path, 1) if tp == 1 else run_distributed(tp, logprob_records, path, tp)[0])


@pytest.mark.parametrize("tp", [1, 2])
def test_forward_only_logprobs_with_images_match_transformers(q3_path, tp):
    records = _records(tp, q3_path)
    assert {(r[1], r[2]) for r in records} == {(k, m) for k in ("padded", "packed")
                                               for m in ("logprobs", "scored_nonzero", "entropy")}
    bad = [f"{r[1]} {r[2]}={r[3]:.3g}" for r in records
           if (r[2] == "scored_nonzero" and r[3] != 1.0) or (r[2] != "scored_nonzero" and not r[3] <= TOL)]
    assert not bad, f"tp={tp}: {bad}"
