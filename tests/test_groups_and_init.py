"""Groups adopted from megatron-core, and random-init models that export to transformers (TP=2, gloo)."""

from __future__ import annotations

import pytest

from tests.cases import _case_configs
from tests.distributed import run_distributed
from tests.workers import adapter_and_init_suite


@pytest.fixture(scope="module")
def records(hf_dirs):
    cfgs = _case_configs()
    per_rank = run_distributed(2, adapter_and_init_suite, hf_dirs["qwen2_untied"],
                               [cfgs["qwen2_tied_kv1"], cfgs["llama_llama3"]])
    return [r for rank in per_rank for r in rank]


def _values(records, prefix, metric):
    vals = [r[4] for r in records if r[0].startswith(prefix) and r[3] == metric]
    assert vals, f"no {prefix} {metric} records"
    return vals


def test_megatron_parallel_state_groups(records):
    assert max(_values(records, "megatron_groups", "logits")) <= 1e-5
    assert max(_values(records, "megatron_groups", "loss")) <= 1e-5
    assert max(_values(records, "megatron_groups", "tp_rank_matches_megatron")) == 0


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_random_init_exports_to_transformers(records, arch):
    assert max(_values(records, f"random_init_{arch}", "state_keys_mismatch")) == 0
    assert max(_values(records, f"random_init_{arch}", "logits")) <= 1e-5
    assert max(_values(records, f"random_init_{arch}", "loss")) <= 1e-5
