"""The fused, chunked LM-head loss (parallel/lm_head_loss.py) against independent references.

- The kernel alone against plain torch (full logits, ``F.cross_entropy``, ``log_softmax``) in fp32
  and bf16: per-token loss, entropy, gradients of hidden states and weight under a non-uniform
  per-token ``grad_output``, padding columns, chunks that do not divide the token count.
- Tiny Qwen2 models (vocab 101 untied, 77 tied: neither a multiple of TP, so the last TP rank holds
  padding) against transformers: the default training call ``model(ids, labels=...)`` (training
  mode: the fused head, no logits) on padded batches, ``model(..., return_logits=False)`` on packed
  ones, and ``forward_backward`` (training step; forward-only log-probs and entropy against
  transformers' logits through plain torch) at TP1 here, and TP2+SP, TP2, CP2 (ring), Ulysses2 and
  PP2 in two gloo processes. Loss within 1e-5, gradients within 1e-4 relative (docs/numerics.md).
  The default's rule there: the same loss and gradients as ``return_logits=True``; logits with
  ``gather_logits=True`` and in eval mode. And the rule itself (``builds_logits``) case by case.
- The default chunk size (``chunk_tokens_for``, free memory injected): CPU's byte budget; CUDA's
  full-rate row count, capped by a share of free memory.
- A chunk size that is not a positive integer: one line naming it, before any process group.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel import ParallelConfig
from parallel.lm_head_loss import (
    CUDA_CHUNK_TOKENS,
    LOGITS_CHUNK_BYTES,
    MAX_CHUNK_TOKENS,
    MIN_CHUNK_TOKENS,
    check_chunk_tokens,
    chunk_bytes_per_token,
    chunk_tokens_for,
    default_chunk_tokens,
    linear_cross_entropy,
)
from tests.distributed import run_distributed
from tests.workers_fused_loss import check_layout, two_rank_suite

LOSS_TOL = 1e-5
GRAD_REL_TOL = 1e-4
LOGPROB_TOL = 1e-5
TOLERANCES = {"forward_loss": LOSS_TOL, "packed_loss": LOSS_TOL, "step_loss": LOSS_TOL,
              "forward_grads": GRAD_REL_TOL, "packed_grads": GRAD_REL_TOL, "step_grads": GRAD_REL_TOL,
              "logprobs": LOGPROB_TOL, "entropy": LOGPROB_TOL, "logprobs_without_entropy": 0.0,
              "logits_path_loss": LOSS_TOL, "logits_path_grads": GRAD_REL_TOL, "gathered_loss": LOSS_TOL,
              "eval_loss": LOSS_TOL}
FLAGS = {"entropy_nonzero", "default_no_logits", "logits_on_request", "eval_logits"}  # each must be 1.0


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
        if what in FLAGS:
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
    for path in model_dirs.values():
        _check(check_layout(path, ParallelConfig()))


def test_two_ranks_match_transformers(model_dirs):
    records = run_distributed(2, two_rank_suite, model_dirs)
    _check(records[0] + records[1])
    layouts = {r[1] for r in records[0]}
    assert len(layouts) == 5, layouts
    for layout in layouts - {ParallelConfig(pp=2).describe()}:  # the default's rule ran in every pp=1 layout
        assert {r[2] for r in records[0] if r[1] == layout} >= FLAGS, layout


def test_default_rule():
    from models.common.causal_lm import builds_logits

    train = dict(gather_logits=False, has_labels=True, training=True)
    assert not builds_logits(None, **train)  # a training step: the fused head, no logits
    assert builds_logits(None, **{**train, "gather_logits": True})  # logits asked for
    assert builds_logits(None, **{**train, "training": False})  # eval mode
    assert builds_logits(None, **{**train, "has_labels": False})  # no loss to fuse
    assert builds_logits(True, **train)
    assert not builds_logits(False, **{**train, "training": False})
    assert not builds_logits(False, **{**train, "gather_logits": True})  # an explicit False wins


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
    assert default_chunk_tokens(151936) * 151936 * 4 <= LOGITS_CHUNK_BYTES
    assert default_chunk_tokens(151936) == 441
    assert default_chunk_tokens(100) == MAX_CHUNK_TOKENS
    assert default_chunk_tokens(10**9) == MIN_CHUNK_TOKENS
    # CPU ignores free memory and the dtype: the same byte budget
    for free in (None, 0, 1 << 40):
        assert chunk_tokens_for(free, 151936, torch.bfloat16, "cpu") == default_chunk_tokens(151936)


def test_cuda_chunk_from_free_memory():
    vocab, gib = 151936, 1 << 30
    per_token = chunk_bytes_per_token(vocab, torch.bfloat16)
    assert per_token == vocab * 10 and chunk_bytes_per_token(vocab, torch.float32) == vocab * 12
    # plenty of free memory (an H200 with a small model): full-rate GEMMs, far above CPU's 441 tokens
    assert chunk_tokens_for(100 * gib, vocab, torch.bfloat16, "cuda") == CUDA_CHUNK_TOKENS >= 2048
    assert chunk_tokens_for(100 * gib, vocab // 8, torch.bfloat16, "cuda") == CUDA_CHUNK_TOKENS  # tp=8: same rows
    # tight memory: one chunk's buffers stay within a quarter of what is free, in whole 128-row tiles
    for free in (2 * gib, 5 * gib, 11 * gib):
        tokens = chunk_tokens_for(free, vocab, torch.bfloat16, "cuda")
        assert tokens * per_token <= free // 4 and tokens % 128 == 0 and tokens < CUDA_CHUNK_TOKENS
        assert (tokens + 128) * per_token > free // 4  # the largest such multiple
    # fp32 buffers are larger: fewer tokens for the same memory
    assert chunk_tokens_for(5 * gib, vocab, torch.float32, "cuda") < chunk_tokens_for(5 * gib, vocab, torch.bfloat16,
                                                                                        "cuda")
    # almost nothing free: never below the minimum (the allocator then decides)
    assert chunk_tokens_for(0, vocab, torch.bfloat16, "cuda") == MIN_CHUNK_TOKENS
    assert chunk_tokens_for(100 * gib, 1, torch.bfloat16, "cuda") == CUDA_CHUNK_TOKENS  # tiny vocab: still capped
    # monotone in free memory
    sizes = [chunk_tokens_for(f * gib // 4, vocab, torch.bfloat16, "cuda") for f in range(0, 200)]
    assert sizes == sorted(sizes)
