"""Megatron <-> HF conversion against real megatron-core on CPU (tests/megatron_oracle.py).

Megatron -> HF: megatron-core builds random models at TP/PP/VPP layouts and saves them (legacy
``torch`` and ``torch_dist``); we convert to HF and transformers' logits must equal megatron-core's.
HF -> Megatron: transformers writes random models; we convert at several layouts; megatron-core
loads them and its logits must equal transformers'. Megatron -> Megatron reshards likewise.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from converters import convert
from tests.distributed import run_distributed
from tests.megatron_oracle import OracleSpec, prompt_ids

LOGITS_TOL = 1e-4  # fp32, megatron-core kernels vs transformers kernels (measured ~1e-6)

SPECS = {
    # GQA, untied, no biases
    "llama": OracleSpec(arch="llama", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                        num_query_groups=2, kv_channels=16, vocab_size=100, make_vocab_size_divisible_by=16,
                        tie_embeddings=False, seed=3),
    # qkv bias, tied embeddings, one query group (< TP), explicit head_dim (24 != 64/4)
    "qwen2": OracleSpec(arch="qwen2", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                        num_query_groups=1, kv_channels=24, vocab_size=90, make_vocab_size_divisible_by=16,
                        tie_embeddings=True, seed=5),
    # a bias on every linear layer (HF Llama attention_bias + mlp_bias), non-default rotary_base and
    # Llama-3.1 RoPE scaling read from Megatron's args
    "llamabias": OracleSpec(arch="llama", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                            num_query_groups=2, kv_channels=16, vocab_size=100, make_vocab_size_divisible_by=16,
                            tie_embeddings=False, rotary_base=500000, rope_scaling=True, rope_scaling_factor=8.0,
                            add_bias_linear=True, seed=9),
}
DIVISIBLE_BY = 16  # what the specs use for vocab padding; our writer must use the same to be loadable as-is


def oracle_jobs(jobs: list[tuple]) -> list:
    """Run ("save", dir, spec, tp, pp, vpp, fmt) / ("load", ...) jobs in order; logits of each."""
    from tests.megatron_oracle import load_checkpoint_logits, save_random_checkpoint

    out = []
    for kind, path, spec, tp, pp, vpp, fmt in jobs:
        if kind == "save":
            out.append(save_random_checkpoint(path, spec, tp, pp, vpp, fmt)["logits"])
        else:
            out.append(load_checkpoint_logits(path, spec, tp, pp, vpp, fmt))
    return out


def hf_config_for(spec: OracleSpec):
    from transformers import LlamaConfig, Qwen2Config

    cls = Qwen2Config if spec.arch == "qwen2" else LlamaConfig
    kw = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
              num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
              num_key_value_heads=spec.num_query_groups, head_dim=spec.kv_channels,
              max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=spec.norm_epsilon,
              tie_word_embeddings=spec.tie_embeddings,
              rope_parameters={"rope_type": "default", "rope_theta": float(spec.rotary_base)})
    if spec.rope_scaling:  # megatron-core's Llama-3.1 scaling constants
        kw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": float(spec.rotary_base),
                                 "factor": spec.rope_scaling_factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}
    if spec.add_bias_linear:
        kw.update(attention_bias=True, mlp_bias=True)
    return cls(**kw)


def hf_logits(path, spec: OracleSpec) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(prompt_ids(spec)).logits


def _diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


# Megatron sources saved by megatron-core: (name, spec, tp, pp, vpp, fmt); all run on 2 ranks.
SOURCES = [(f"{arch}_{fmt}_tp2", arch, 2, 1, None, fmt) for arch in SPECS for fmt in ("torch", "torch_dist")] + \
          [(f"{arch}_{fmt}_pp2vpp2", arch, 1, 2, 2, fmt) for arch in SPECS for fmt in ("torch", "torch_dist")]


@pytest.fixture(scope="module")
def megatron_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mcore_src")
    jobs = [("save", str(root / name), SPECS[arch], tp, pp, vpp, fmt) for name, arch, tp, pp, vpp, fmt in SOURCES]
    logits = run_distributed(2, oracle_jobs, jobs)[0]
    return root, dict(zip([s[0] for s in SOURCES], logits))


@functools.lru_cache(maxsize=None)
def _converted_to_hf(root: str, name: str) -> Path:
    dst = Path(root) / f"{name}_hf"
    convert(Path(root) / name, dst, to="hf", workers=2)
    return dst


@pytest.mark.parametrize("name", [s[0] for s in SOURCES])
def test_megatron_to_hf_logits_match_megatron_core(megatron_sources, name):
    root, logits = megatron_sources
    spec = SPECS[name.split("_")[0]]
    hf_dir = _converted_to_hf(str(root), name)
    assert _diff(hf_logits(hf_dir, spec), logits[name]) <= LOGITS_TOL


@pytest.mark.parametrize("arch", list(SPECS))
@pytest.mark.parametrize("layout", ["tp2", "pp2vpp2"])
def test_legacy_and_torch_dist_sources_give_identical_hf(megatron_sources, arch, layout):
    from safetensors.torch import load_file

    root, _ = megatron_sources
    a = load_file(str(_converted_to_hf(str(root), f"{arch}_torch_{layout}") / "model.safetensors"))
    b = load_file(str(_converted_to_hf(str(root), f"{arch}_torch_dist_{layout}") / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


# HF -> Megatron targets loaded back by megatron-core: (name, arch, convert-to, tp, pp, vpp, load-at tp, pp, vpp).
TARGETS = [
    ("legacy_tp2", "megatron", 2, 1, 1, (2, 1, None)),
    ("legacy_pp2vpp2", "megatron", 1, 2, 2, (1, 2, 2)),
    ("dist_tp2", "megatron-dist", 2, 1, 1, (2, 1, None)),
    ("dist_pp2_loaded_tp2", "megatron-dist", 1, 2, 1, (2, 1, None)),  # megatron-core reshards torch_dist itself
]


@pytest.fixture(scope="module")
def hf_to_megatron(tmp_path_factory):
    from tests.cases import write_hf_model

    root = tmp_path_factory.mktemp("hf_to_mcore")
    jobs, names, refs = [], [], {}
    for arch, spec in SPECS.items():
        hf_dir = write_hf_model(root, f"{arch}_hf", hf_config_for(spec), seed=11)
        refs[arch] = hf_logits(hf_dir, spec)
        for name, fmt, tp, pp, vpp, (ltp, lpp, lvpp) in TARGETS:
            dst = root / f"{arch}_{name}"
            convert(hf_dir, dst, to=fmt, tp=tp, pp=pp, vpp=vpp, make_vocab_size_divisible_by=DIVISIBLE_BY, workers=2)
            jobs.append(("load", str(dst), spec, ltp, lpp, lvpp, "torch" if fmt == "megatron" else "torch_dist"))
            names.append((arch, name))
        # Megatron -> Megatron without an HF copy: legacy TP2 -> legacy PP2xVPP2 and -> torch_dist TP1
        for name, fmt, tp, pp, vpp, load in [
                ("reshard_legacy_pp2vpp2", "megatron", 1, 2, 2, (1, 2, 2, "torch")),
                ("reshard_dist_tp1", "megatron-dist", 1, 1, 1, (2, 1, None, "torch_dist"))]:
            dst = root / f"{arch}_{name}"
            convert(root / f"{arch}_legacy_tp2", dst, to=fmt, tp=tp, pp=pp, vpp=vpp,
                    make_vocab_size_divisible_by=DIVISIBLE_BY, workers=2)
            jobs.append(("load", str(dst), spec, *load))
            names.append((arch, name))
        # uneven stages written from pmz's flags (4 layers as 1 + 3 and 3 + 1), loaded by megatron-core
        # built with the same num_layers_in_first/last_pipeline_stage
        for name, fmt, first, last in [("uneven_legacy_first1", "megatron", 1, None),
                                       ("uneven_dist_last1", "megatron-dist", None, 1)]:
            dst = root / f"{arch}_{name}"
            convert(hf_dir, dst, to=fmt, pp=2, first_stage_layers=first, last_stage_layers=last,
                    make_vocab_size_divisible_by=DIVISIBLE_BY, workers=2)
            uneven = dataclasses.replace(spec, first_stage_layers=first, last_stage_layers=last)
            jobs.append(("load", str(dst), uneven, 1, 2, None, "torch" if fmt == "megatron" else "torch_dist"))
            names.append((arch, name))
    logits = run_distributed(2, oracle_jobs, jobs)[0]
    return refs, dict(zip(names, logits))


@pytest.mark.parametrize("arch", list(SPECS))
@pytest.mark.parametrize("name", [t[0] for t in TARGETS] + ["reshard_legacy_pp2vpp2", "reshard_dist_tp1",
                                                            "uneven_legacy_first1", "uneven_dist_last1"])
def test_hf_to_megatron_loads_in_megatron_core(hf_to_megatron, arch, name):
    refs, logits = hf_to_megatron
    assert _diff(logits[(arch, name)], refs[arch]) <= LOGITS_TOL
