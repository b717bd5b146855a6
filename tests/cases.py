"""Tiny HF models written to disk by transformers itself: the independent reference for every test.

Each case covers a switch of the shared decoder: GQA with fewer KV heads than TP ranks, tied and
untied embeddings, qkv bias (Qwen2), o_proj/MLP bias (Llama attention_bias/mlp_bias), vocab not
divisible by TP, explicit head_dim, and the RoPE scaling types.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

ARCH_OF = {"qwen2": "models.qwen2", "llama": "models.llama", "qwen3": "models.qwen3", "qwen3moe": "models.qwen3_moe"}


def _case_configs():
    from transformers import LlamaConfig, Qwen2Config

    return {
        # vocab 101: not divisible by 2 or 4; kv_heads 2 < tp 4 (replicated KV at tp=4)
        "qwen2_untied": Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False, rms_norm_eps=1e-6),
        # tied embeddings, a single KV head (replicated over every TP rank)
        "qwen2_tied_kv1": Qwen2Config(vocab_size=77, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                      tie_word_embeddings=True),
        # explicit head_dim (24 != 64/4), llama3 RoPE scaling, bias on q/k/v/o and the MLP
        "llama_llama3": LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, head_dim=24,
                                    max_position_embeddings=64, attention_bias=True, mlp_bias=True,
                                    tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8}),
        # dynamic NTK RoPE exercised past max_position_embeddings (tests use 20 tokens > 16), tied
        "llama_dynamic": LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                     tie_word_embeddings=True,
                                     rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    }


def qwen3_configs() -> dict:
    """Qwen3 and Qwen3-MoE cases (tests/test_qwen3.py): q/k norms, head_dim decoupled from hidden/heads,
    GQA with fewer KV heads than TP ranks, tied and untied embeddings, attention bias; MoE without a
    shared expert, renormalised or plain top-k, dense layers (``mlp_only_layers``, ``decoder_sparse_step``)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    return {
        # head_dim 24 (4 * 24 != 64), 4 layers (room for PP2 x VPP2), vocab 101 (not divisible by 2)
        "qwen3_untied": Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                    max_position_embeddings=64, tie_word_embeddings=False),
        # one KV head (replicated over every TP rank), tied embeddings, bias on q/k/v and o_proj
        "qwen3_tied_kv1": Qwen3Config(vocab_size=77, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, head_dim=16, attention_bias=True,
                                      max_position_embeddings=64, tie_word_embeddings=True),
        # the Qwen3-MoE checkpoints' switches: renormalised top-k, a dense layer among sparse ones
        "qwen3moe_norm": Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                        norm_topk_prob=True, mlp_only_layers=[1], router_aux_loss_coef=0.1,
                                        max_position_embeddings=64, tie_word_embeddings=False),
        # transformers' default top-k (not renormalised), every 2nd layer sparse, one KV head, tied
        "qwen3moe_step2": Qwen3MoeConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                         moe_intermediate_size=24, num_experts=4, num_experts_per_tok=3,
                                         norm_topk_prob=False, decoder_sparse_step=2, router_aux_loss_coef=0.1,
                                         max_position_embeddings=64, tie_word_embeddings=True),
    }


def seq_len_for(case: str) -> int:
    return 20 if case == "llama_dynamic" else 10


def save_randomized(model, path, norm_marks: tuple[str, ...] = ("norm",)) -> str:
    """``model`` (just built, under the caller's seed) with every norm weight (a name holding one of
    ``norm_marks``, ending in ``.weight``) uniform(0.5, 1.5) and everything else normal(0, 0.08), saved by
    transformers at ``path``: the vision-language and MoE tests' random checkpoints (transformers' own init
    leaves norms 1 and biases 0, which would hide mistakes in their handling)."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if any(mark in pname for mark in norm_marks) and pname.endswith(".weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path))
    return str(path)


def write_hf_model(root: Path, name: str, config, seed: int = 0) -> Path:
    """Random transformers model saved with ``save_pretrained``; norms and biases randomized too
    (transformers initializes them to 1 and 0, which would hide mistakes in their handling)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, 0.05)
            elif "norm" in pname:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    path = root / name
    model.save_pretrained(path)
    return path


def copy_path_configs() -> dict:
    """Two small models that exercise every Megatron layout the converters handle: GQA with
    biases (qwen2), one KV head with tied embeddings and all-linear biases (llama)."""
    from transformers import LlamaConfig, Qwen2Config

    return {
        "qwen2": Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=4, tie_word_embeddings=False),
        "llama_tied_bias": LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                       num_key_value_heads=1, num_hidden_layers=4, tie_word_embeddings=True,
                                       attention_bias=True, mlp_bias=True),
    }


def snapshot(folder: Path) -> dict[str, str]:
    """Every path under ``folder`` (hidden ones included) with a digest of each file's bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), folder) + "/"] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, folder)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


def write_all() -> dict[str, str]:
    """The cases above, each seeded by its position, from the session's checkpoint cache (read-only)."""
    from tests.checkpoint_cache import cached

    return {name: cached(write_hf_model, name, cfg, seed=i) for i, (name, cfg) in enumerate(_case_configs().items())}


def arch_of(case: str) -> str:
    return case.split("_")[0]


def build(case: str, source, pconfig, **kw):
    import importlib

    return importlib.import_module(ARCH_OF[arch_of(case)]).build_parallel_model(source, pconfig, **kw)


def load_hf(path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def convert_to_hf_in_fresh_python(src, out, cwd) -> str:
    """``pmz convert SRC OUT --to hf`` in a new interpreter; asserts exit 0 and returns whether the
    run imported torch ("TORCH 0" / "NO-TORCH 0"), so tests can hold the copy path to being torch-free."""
    import subprocess
    import sys

    code = ("import sys\nfrom converters.cli import main\n"
            f"rc = main(['convert', {str(src)!r}, {str(out)!r}, '--to', 'hf', '--quiet'])\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(cwd),
                         timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1]
