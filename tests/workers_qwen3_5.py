"""Qwen3.5 (dense, text) rank bodies: our model against transformers' ``Qwen3_5ForCausalLM`` loaded from
the same directory in the same process, fp32, plus transformers in fp64 as the truth both are measured
against. Records are ``(case, layout, metric, value)``; tests/test_qwen3_5.py holds the bounds.

  * padded batch (a full row, a right-padded and a left-padded row; 70 tokens, past one 64-token
    chunk): logits on real tokens, loss, gradients of every HF tensor;
  * packed batch (``cu_seqlens``; lengths 5, 1, 20, 3, 70: two shorter than the conv kernel, one past a
    chunk) against each sequence run alone in transformers (which ignores packing): logits, the loss
    (token mean over all sequences) and its gradients.
"""

from __future__ import annotations

import torch

from parallel import ParallelConfig
from tests.workers import _rel_diff, fp32_error_ratio, hf_named_grads

PACKED_LENGTHS = (5, 1, 20, 3, 70)
PADDED_LENGTH = 70


def configs() -> dict:
    from transformers import Qwen3_5TextConfig

    linear, full = "linear_attention", "full_attention"
    return {
        # GQA in both mixers (kv 2 of 4 heads; value heads 4 on 2 key heads), dv != dk, partial rotary 0.25
        # (4 of 16 channels), vocab 101 (padded), untied
        "mixed": Qwen3_5TextConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                   linear_value_head_dim=24, layer_types=[linear, linear, full, linear],
                                   max_position_embeddings=128, tie_word_embeddings=False),
        # one KV head (replicated over TP2), as many value heads as key heads, tied embeddings, rotary half
        "tied_kv1": Qwen3_5TextConfig(vocab_size=77, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                                      linear_value_head_dim=16, layer_types=[full, linear],
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5},
                                      max_position_embeddings=128, tie_word_embeddings=True),
    }


def write_model(root, name: str, config, seed: int) -> str:
    """A random transformers hybrid (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) saved with ``save_pretrained``; every
    tensor randomized (zero-centred norms around 0, the gated norm around 1, decays slow enough that the
    state carries ~10 tokens)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):
                p.normal_(-2.0, 0.5)
            elif pname.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
            elif "conv1d" in pname:
                p.normal_(0.0, 0.3)
            elif pname.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.1)
            elif "norm" in pname:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    path = root / name
    model.save_pretrained(path)
    return str(path)


def _diff(a, b) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


def _grad_rel(model, hf) -> float:
    ours = hf_named_grads(model)
    ref = dict(hf.named_parameters())
    assert set(ours) == set(ref) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set()), \
        sorted(set(ours) ^ set(ref))
    return max(_rel_diff(g, ref[n].grad) for n, g in ours.items())


def _padded_batch(vocab: int, length: int = PADDED_LENGTH, right: int = 50, left: int = 20):
    """Three rows of ``length`` tokens: full, right-padded from ``right``, left-padded up to ``left``."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (3, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, right:] = 0  # right padding
    mask[2, :left] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :3] = -100
    labels[2, left] = -100  # predicted from a padding position, whose outputs are not defined
    return ids, mask, labels


def case(name: str, path: str, tp: int, sp: bool) -> list[tuple]:
    from transformers import AutoModelForCausalLM

    from models.qwen3_5 import build_parallel_model

    layout = ParallelConfig(tp=tp, sequence_parallel=sp).describe()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    truth = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    model = build_parallel_model(path, ParallelConfig(tp=tp, sequence_parallel=sp))
    records = []

    def rec(metric, value):
        records.append((name, layout, metric, value))

    # padded batch
    ids, mask, labels = _padded_batch(hf.config.vocab_size)
    out = model(ids, attention_mask=mask, labels=labels, gather_logits=True)
    ref = hf(input_ids=ids, attention_mask=mask, labels=labels)
    with torch.no_grad():
        exact = truth(input_ids=ids, attention_mask=mask, labels=labels)
    real = mask.bool()
    rec("padded_logits", _diff(out.logits[real], ref.logits[real]))
    rec("padded_logits_ratio", fp32_error_ratio(out.logits[real], ref.logits[real], exact.logits[real]))
    rec("padded_loss", _diff(out.loss, ref.loss))
    model.zero_grad()
    hf.zero_grad()
    model(ids, attention_mask=mask, labels=labels, return_logits=False).loss.backward()  # the fused head
    model.finalize_grads()
    ref.loss.backward()
    rec("padded_grads", _grad_rel(model, hf))

    # packed batch against each sequence alone
    gen = torch.Generator().manual_seed(12)
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen) for n in PACKED_LENGTHS]
    flat = torch.cat(seqs)
    cu = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()])
    out = model(flat, cu_seqlens=cu, labels=flat.clone(), gather_logits=True)
    count = sum(n - 1 for n in PACKED_LENGTHS)
    hf.zero_grad()
    ref_logits, exact_logits, ref_loss = [], [], 0.0
    for s in seqs:
        r = hf(input_ids=s[None], labels=s[None] if len(s) > 1 else None)
        ref_logits.append(r.logits[0])
        with torch.no_grad():
            exact_logits.append(truth(input_ids=s[None]).logits[0])
        if len(s) > 1:  # transformers' loss is this sequence's token mean: weight it by its tokens
            ref_loss = ref_loss + r.loss * (len(s) - 1) / count
    ref_logits, exact_logits = torch.cat(ref_logits), torch.cat(exact_logits)
    rec("packed_logits", _diff(out.logits[0], ref_logits))
    rec("packed_logits_ratio", fp32_error_ratio(out.logits[0], ref_logits, exact_logits))
    rec("packed_loss", _diff(out.loss, ref_loss))
    rec("packed_loss_value", out.loss.item())
    model.zero_grad()
    model(flat, cu_seqlens=cu, labels=flat.clone(), return_logits=False).loss.backward()
    model.finalize_grads()
    ref_loss.backward()
    rec("packed_grads", _grad_rel(model, hf))
    return records


def suite(dirs: dict[str, str], plan: list[tuple]) -> list[tuple]:
    """``plan``: ``(case, sp)`` items, each run at TP = world size."""
    import torch.distributed as dist

    world = dist.get_world_size()
    return [r for name, sp in plan for r in case(name, dirs[name], world, sp)]
