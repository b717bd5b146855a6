"""``pmz convert``'s fixed cost: the median wall of each direction on a tiny model, beside ``python -c pass``.

    python tools/bench_startup.py            # 20 rounds
    python tools/bench_startup.py --runs 40  # more rounds on a noisy machine

A 0.6 MiB Qwen2 (4 layers, hidden 64, written here as config.json + one safetensors file: no torch, no
transformers) is converted HF->HF, HF->Megatron legacy / torch_dist, Megatron legacy / torch_dist->HF and
HF<->vLLM, each run a fresh ``pmz`` process (the installed console script, ``--quiet --overwrite``). On a
checkpoint this small nearly all of the wall is the fixed cost: interpreter start, imports, reading and
planning. The directions and the baseline run round-robin, one of each per round, so a load change on a
shared machine hits them alike; ``- baseline`` is the median minus the baseline's (what pmz adds to an
empty interpreter), ``cpu`` the median user+sys time of the process (less inflated than the wall when
other work shares the cores). Bytecode caches are written (``PYTHONDONTWRITEBYTECODE`` is dropped for the
children) and one warm-up round is not counted. ``PYTHONPATH`` passes through: pointing it at another
checkout's tree times that tree with the same venv.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 176, 4, 4, 2, 512
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": HIDDEN,
    "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": True,
    "dtype": "float32", "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
    "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
}


def tiny_tensors() -> dict[str, list[int]]:
    """HF names and shapes of the tiny Qwen2 (tied embeddings: no lm_head)."""
    head = HIDDEN // HEADS
    shapes = {"model.embed_tokens.weight": [VOCAB, HIDDEN], "model.norm.weight": [HIDDEN]}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": [HIDDEN], p + "post_attention_layernorm.weight": [HIDDEN],
            p + "self_attn.q_proj.weight": [HEADS * head, HIDDEN], p + "self_attn.q_proj.bias": [HEADS * head],
            p + "self_attn.k_proj.weight": [KV_HEADS * head, HIDDEN], p + "self_attn.k_proj.bias": [KV_HEADS * head],
            p + "self_attn.v_proj.weight": [KV_HEADS * head, HIDDEN], p + "self_attn.v_proj.bias": [KV_HEADS * head],
            p + "self_attn.o_proj.weight": [HIDDEN, HEADS * head],
            p + "mlp.gate_proj.weight": [FFN, HIDDEN], p + "mlp.up_proj.weight": [FFN, HIDDEN],
            p + "mlp.down_proj.weight": [HIDDEN, FFN],
        })
    return shapes


def write_tiny_hf(directory: Path) -> None:
    """config.json and model.safetensors (fp32, distinct finite values) written by hand."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    header, blobs, offset = {}, [], 0
    for k, (name, shape) in enumerate(sorted(tiny_tensors().items())):
        data = array("f", ((k * 7919 + j) % 1000 / 1000.0 - 0.5 for j in range(math.prod(shape)))).tobytes()
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for blob in blobs:
            f.write(blob)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="rounds counted (default 20)")
    args = parser.parse_args()
    pmz = str(Path(sys.executable).parent / "pmz")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        root = Path(tmp)
        write_tiny_hf(root / "hf")
        for to in ("megatron", "megatron-dist", "vllm"):  # the sources of the reverse directions
            subprocess.run([pmz, "convert", str(root / "hf"), str(root / to), "--to", to, "--quiet"],
                           check=True, env=env, stdout=subprocess.DEVNULL)
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "hf -> hf": ["hf", "hf"], "hf -> megatron": ["hf", "megatron"],
            "hf -> megatron-dist": ["hf", "megatron-dist"], "megatron -> hf": ["megatron", "hf"],
            "megatron-dist -> hf": ["megatron-dist", "hf"], "hf -> vllm": ["hf", "vllm"], "vllm -> hf": ["vllm", "hf"],
        }
        commands = {name: cmd if name.startswith("python") else
                    [pmz, "convert", str(root / cmd[0]), str(root / "out"), "--to", cmd[1], "--quiet", "--overwrite"]
                    for name, cmd in cases.items()}
        walls: dict[str, list[float]] = {name: [] for name in commands}
        cpus: dict[str, list[float]] = {name: [] for name in commands}
        load = os.getloadavg()[0]
        for round_ in range(args.runs + 1):
            for name, cmd in commands.items():
                used = resource.getrusage(resource.RUSAGE_CHILDREN)
                start = time.perf_counter()
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
                wall = time.perf_counter() - start
                now = resource.getrusage(resource.RUSAGE_CHILDREN)
                if round_:  # round 0 warms the caches
                    walls[name].append(wall)
                    cpus[name].append(now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime)
    size = sum(4 * math.prod(shape) for shape in tiny_tensors().values())
    print(f"{args.runs} runs each, load {load:.2f} -> {os.getloadavg()[0]:.2f} (1-minute average, {os.cpu_count()} "
          f"cores); the tiny Qwen2 is {size / 2**20:.2f} MiB. cpu: the process's user+sys time, which a loaded "
          f"machine inflates less than the wall")
    print(f"{'direction':<22}{'median s':>10}{'min s':>9}{'- baseline':>12}{'cpu median':>12}")
    base = statistics.median(walls["python -c pass"])
    for name, ts in walls.items():
        med = statistics.median(ts)
        extra = f"{'':>12}" if name.startswith("python") else f"{med - base:>12.3f}"
        print(f"{name:<22}{med:>10.3f}{min(ts):>9.3f}{extra}{statistics.median(cpus[name]):>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
