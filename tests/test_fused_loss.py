"""The fused, chunked LM-head loss (parallel/lm_head_loss.py) against independent references.

- The kernel alone against plain torch (full logits, ``F.cross_entropy``, ``log_softmax``) in fp32
  and bf16: per-token loss, entropy, gradients of hidden states and weight under a non-uniform
  per-token ``grad_output``, padding columns, chunks that do not divide the token count.
- Tiny Qwen2 models (vocab 101 untied, 77 tied: neither a multiple of TP, so the last TP rank holds
  padding) against transformers: ``model(..., return_logits=False)`` on padded and packed batches
  and ``forward_backward`` (training step; forward-only log-probs and entropy against transformers'
  logits through plain torch) at TP1 here, and TP2+SP, TP2, CP2 (ring), Ulysses2 and PP2 in two gloo
  processes. Loss within 1e-5, gradients within 1e-4 relative (docs/numerics.md).
- A chunk size that is not a positive integer: one line naming it, before any process group.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.lm_head_loss import check_chunk_tokens, default_chunk_tokens, linear_cross_entropy
from tests.distributed import run_distributed
from tests.workers_fused_loss import check_layout, two_rank_suite

LOSS_TOL = 1e-5
GRAD_REL_TOL = 1e-4
LOGPROB_TOL = 1e-5
TOLERANCES = {"forward_loss": LOSS_TOL, "packed_loss": LOSS_TOL, "step_loss": LOSS_TOL,
              "forward_grads": GRAD_REL_TOL, "packed_grads": GRAD_REL_TOL, "step_grads": GRAD_REL_TOL,
              "logprobs": LOGPROB_TOL, "entropy": LOGPROB_TOL, "logprobs_without_entropy": 0.0}


def _configs():
    from transformers import Qwen2Config

    return {
        "qwen2_untied": Qwen2Config(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False),
        "qwen2_tied": Qwen2Config(vocab_size=77, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  tie_word_embeddings=True),
    }


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from tests.cases import write_hf_model

    root = tmp_path_factory.mktemp("fused_loss_models")
    return {name: str(write_hf_model(root, name, cfg, seed=i)) for i, (name, cfg) in enumerate(_configs().items())}


def _check(records):
    assert records
    for *tag, what, value in records:
        if what == "entropy_nonzero":
            assert value == 1.0, (tag, what)
            continue
        assert value <= TOLERANCES[what], (*tag, what, value)


def _reference(h, w, t, valid, g):
    """Plain torch: full logits over the real columns, cross entropy, entropy, gradients of sum(g * loss)."""
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logits = (h @ w[:valid].t()).float()
    loss = F.cross_entropy(logits, t, reduction="none", ignore_index=-100)
    logp = torch.log_softmax(logits.double(), -1)
    entropy = -(logp.exp() * logp).sum(-1)
    (loss * g).sum().backward()
    return loss.detach(), entropy, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_kernel_matches_plain_torch(dtype, chunk):
    gen = torch.Generator().manual_seed(chunk)
    n, hidden, rows, valid = 45, 24, 40, 33  # 7 rows of vocabulary padding
    h = torch.randn(n, hidden, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(rows, hidden, generator=gen) * 0.3).to(dtype).requires_grad_()
    t = torch.randint(0, valid, (n,), generator=gen)
    t[[0, 9, 30]] = -100
    g = torch.rand(n, generator=gen) + 0.5  # a per-token grad_output (an RL-style weighted loss)
    loss, entropy = linear_cross_entropy(h, w, t, vocab_start=0, valid_columns=valid, chunk_tokens=chunk,
                                         entropy=True)
    (loss * g).sum().backward()
    ref_loss, ref_entropy, ref_gh, ref_gw = _reference(h, w, t, valid, g)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert loss.dtype == torch.float32 and (loss - ref_loss).abs().max() <= tol
    assert (loss[[0, 9, 30]] == 0).all()
    assert (entropy - ref_entropy).abs().max() <= tol
    for ours, ref in ((h.grad, ref_gh), (w.grad, ref_gw)):
        assert ours.dtype == dtype
        assert ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()) <= (1e-5 if dtype == torch.float32
                                                                                         else 2e-2)
    assert (w.grad[valid:] == 0).all()  # padding rows take no gradient


def test_tp1_matches_transformers(model_dirs):
    from parallel import ParallelConfig

    for path in model_dirs.values():
        _check(check_layout(path, ParallelConfig()))


def test_two_ranks_match_transformers(model_dirs):
    records = run_distributed(2, two_rank_suite, model_dirs)
    _check(records[0] + records[1])
    layouts = {r[1] for r in records[0]}
    assert len(layouts) == 5, layouts


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "64"])
def test_bad_chunk_size_is_one_line_before_any_group(value):
    import torch.distributed as dist
    from transformers import Qwen2Config

    from models.qwen2 import build_parallel_model
    from parallel import ParallelConfig

    cfg = Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    assert not dist.is_initialized()
    with pytest.raises(ValueError) as err:  # tp=2 without a process group: the check comes first
        build_parallel_model(cfg, ParallelConfig(tp=2), loss_chunk_tokens=value)
    assert "\n" not in str(err.value) and f"loss_chunk_tokens={value!r}" in str(err.value)
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        check_chunk_tokens(value)
    model = build_parallel_model(cfg)
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        model.loss_chunk_tokens = value
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        linear_cross_entropy(torch.zeros(2, 16), torch.zeros(4, 16), torch.zeros(2, dtype=torch.long), vocab_start=0,
                             valid_columns=4, chunk_tokens=value)


def test_default_chunk_follows_the_byte_budget():
    from parallel.lm_head_loss import LOGITS_CHUNK_BYTES, MAX_CHUNK_TOKENS, MIN_CHUNK_TOKENS

    assert default_chunk_tokens(151936) * 151936 * 4 <= LOGITS_CHUNK_BYTES
    assert default_chunk_tokens(100) == MAX_CHUNK_TOKENS
    assert default_chunk_tokens(10**9) == MIN_CHUNK_TOKENS
