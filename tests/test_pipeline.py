"""Pipeline parallelism, the training step and data parallelism against transformers (gloo, CPU).

Layouts: PP=2 (1F1B, GPipe), PP=2 x VPP=2 (interleaved 1F1B, looped BFS, interleaved zero
bubble), TP=2 x PP=2 with SP, PP=4 with
uneven stages, DP=2 with PP and with TP, and PP=1 with micro-batches. Each runs two SGD steps of
``forward_backward`` next to transformers on the whole batch (each DP rank gets its share): loss
and gradients must agree (fp32), forward-only log-probs too, and tied embeddings split over stages
must stay identical.
"""

from __future__ import annotations

import functools

import pytest

from tests.distributed import run_distributed
from tests.workers_pipeline import pipeline_suite

FP32_TOL = 1e-5
GRAD_REL_TOL = 1e-4


def _configs():
    from transformers import LlamaConfig, Qwen2Config

    return {
        # 8 layers: PP=2 x VPP=2 (2 per chunk), PP=4 uneven (1, 2, 2, 3); tied embeddings across stages
        "qwen2_tied8": Qwen2Config(vocab_size=83, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                   max_position_embeddings=64),
        "llama_untied8": LlamaConfig(vocab_size=70, hidden_size=32, intermediate_size=48, num_hidden_layers=8,
                                     num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                                     max_position_embeddings=64),
    }


@pytest.fixture(scope="module")
def pp_dirs(tmp_path_factory):
    from tests.cases import write_hf_model

    root = tmp_path_factory.mktemp("pp_models")
    return {name: str(write_hf_model(root, name, cfg, seed=i)) for i, (name, cfg) in enumerate(_configs().items())}


LAYOUTS = {
    2: [
        ("qwen2_tied8", dict(pp=2), "1f1b", 2),
        ("llama_untied8", dict(pp=2), "gpipe", 4),
        ("qwen2_tied8", dict(pp=2, vpp=2), "interleaved_1f1b", 2),
        ("llama_untied8", dict(pp=2, vpp=2), "looped_bfs", 4),
        ("qwen2_tied8", dict(pp=2, vpp=2), "interleaved_zero_bubble", 4),
        ("qwen2_tied8", dict(), "1f1b", 1),  # pp=1, DP=2
    ],
    4: [
        ("qwen2_tied8", dict(tp=2, pp=2, sequence_parallel=True), "1f1b", 2),
        ("llama_untied8", dict(pp=4, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3),
         "1f1b", 4),
        ("qwen2_tied8", dict(pp=2), "1f1b", 2),  # DP=2 with PP
        ("llama_untied8", dict(tp=2), "1f1b", 2),  # DP=2 with TP, micro-batches at pp=1
    ],
}


@functools.lru_cache(maxsize=None)
def _run(world: int, dirs_key: tuple) -> list[tuple]:
    dirs = dict(dirs_key)
    cases = [(case, dirs[case], kw, sched, nmb) for case, kw, sched, nmb in LAYOUTS[world]]
    return [r for rank in run_distributed(world, pipeline_suite, cases) for r in rank]


def _bound(metric: str) -> float:
    return GRAD_REL_TOL if metric.startswith("grads") else FP32_TOL


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("metric", ["loss_step", "grads_step", "logprobs", "tied_copies_differ"])
def test_pipeline_and_dp_match_transformers(world, metric, pp_dirs):
    records = [r for r in _run(world, tuple(sorted(pp_dirs.items()))) if r[4].startswith(metric)]
    assert records
    bad = [f"{r[0]} {r[1]} {r[2]} {r[3]} {r[4]}={r[5]:.3g}" for r in records if not r[5] <= _bound(r[4])]
    assert not bad, "\n".join(bad)
