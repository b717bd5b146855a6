"""Qwen3-VL and Qwen3-VL-MoE sources for ``tools/bench_convert.py`` (``--model qwen3-vl`` / ``qwen3-vl-moe``,
issues 40 and 41), and the benchmark's correctness check (``--check``, every model).

* ``vl_config`` / ``vl_shapes``: ``Qwen3VLForConditionalGeneration`` / ``Qwen3VLMoeForConditionalGeneration`` as
  transformers 5.24 saves them (text under ``model.language_model.``, the tower under ``model.visual.`` with its
  DeepStack mergers and learned ``pos_embed``; MoE experts fused, ``mlp.experts.gate_up_proj`` [E, 2F, H] and
  ``down_proj`` [E, H, F], as released), names and shapes from transformers' own model built on the meta device
  (no memory). The tower is transformers' default Qwen3-VL tower (27 blocks of 1152, 16 heads, MLP 4304, patch
  16, DeepStack mergers after blocks 8, 16, 24; ~0.82 GB in bf16) projecting to the text model's width; the text
  model (Qwen3: q/k norms, head_dim 128; untied) has the layer count that brings the checkpoint nearest the size
  asked for, at least 4 (DeepStack adds the tower's features to the first three).
* ``child_setup_vl`` (a child process: torch is imported there, never in the timing parent): the HF checkpoint
  written from random tensors one layer per file (the tower in a file of its own; one group in memory at a
  time), then by pmz the Megatron sources the timed directions read (legacy TP2, torch_dist TP2; MoE: EP2 x TP2,
  and legacy GroupedMLP EP2 x TP2 for ``grouped->hf``; Megatron-Bridge's layout TP2 for ``bridge->hf``, written by
  the torch path: pmz writes Bridge targets there).
* ``check_sources`` / ``check_direction`` (``--check``, untimed): ``pmz inspect`` of every source and ``pmz
  verify`` of each against the HF source (exact: max difference 0), then each direction's output against its
  source once, so that every round trip HF -> target -> HF the benchmark times is checked bitwise.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from bench_convert_tables import HYBRID_DIRECTIONS

ROOT = Path(__file__).resolve().parents[1]
QWEN3_VLS = ("qwen3-vl", "qwen3-vl-moe")
VL_DIRECTIONS = {  # every direction the copy path takes for Qwen3-VL (Megatron: Bridge's Qwen3VLModel names)
    **HYBRID_DIRECTIONS,  # the same seven as the hybrids': HF <-> Megatron TP2 legacy / torch_dist, vLLM TP2
    "bridge->hf": ("bridge", ["--to", "hf"]),  # a Megatron-Bridge save (run_config.yaml) read by the copy path
}
VL_MOE_DIRECTIONS = {  # Qwen3-VL-MoE: Megatron targets EP2 x TP2, grouped-GEMM experts too
    **{k: (src, extra + (["--ep", "2"] if k in ("hf->legacy", "hf->dist") else []))
       for k, (src, extra) in VL_DIRECTIONS.items()},
    "hf->grouped": ("hf", ["--to", "megatron", "--tp", "2", "--ep", "2", "--moe-grouped-gemm"]),
    "grouped->hf": ("grouped", ["--to", "hf"]),
}
# not on the copy path (engine.convert: Megatron-Bridge targets are written by the torch path); time it on purpose
TORCH_PATH_DIRECTIONS = {"hf->bridge": ("hf", ["--to", "megatron-bridge", "--tp", "2"])}
SOURCES = ("legacy", "dist", "grouped", "bridge")  # the Megatron sources child_setup_vl writes, in argument order


def vl_directions(model: str) -> dict:
    """The direction table of ``model`` (the copy path's, and the torch-path ones that may be asked for)."""
    return {**(VL_MOE_DIRECTIONS if model.endswith("moe") else VL_DIRECTIONS), **TORCH_PATH_DIRECTIONS}


def vl_config(args: argparse.Namespace, layers: int):
    """The transformers config: the text model of the benchmark's shape arguments (MoE: every layer sparse, no
    shared expert) inside transformers' default tower, which projects to the text width."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    text = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                intermediate_size=args.ffn, max_position_embeddings=4096, tie_word_embeddings=False)
    if args.model == "qwen3-vl-moe":
        text.update(num_experts=args.experts, moe_intermediate_size=args.moe_ffn,
                    num_experts_per_tok=min(8, args.experts), decoder_sparse_step=1, mlp_only_layers=[])
    cls = Qwen3VLMoeConfig if args.model == "qwen3-vl-moe" else Qwen3VLConfig
    return cls(text_config=text, vision_config={"out_hidden_size": args.hidden}, tie_word_embeddings=False)


def vl_shapes(config) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the checkpoint stores: transformers' model on the meta device (its state
    dict is what ``save_pretrained`` writes for these models: fused experts included)."""
    import torch
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def vl_counts(args: argparse.Namespace) -> tuple[int, int]:
    """(elements of one text layer, elements outside the text layers): what ``vl_layers_for`` scales by."""
    shapes = vl_shapes(vl_config(args, 4))
    layers = "model.language_model.layers."
    per4 = sum(math.prod(s) for k, s in shapes.items() if k.startswith(layers))
    return per4 // 4, sum(math.prod(s) for k, s in shapes.items() if not k.startswith(layers))


def vl_layers_for(args: argparse.Namespace, size_gb: float) -> int:
    """The text layer count (at least 4) that brings the checkpoint nearest ``size_gb``; counted in a child
    (``bench_convert.py --_count``): torch imported in the timing parent would be in every timed child's peak RSS
    (a fork copies the parent's pages, which ``ru_maxrss`` counts before exec)."""
    item = 2 if args.dtype == "bf16" else 4
    shape = ["--model", args.model, "--hidden", str(args.hidden), "--heads", str(args.heads), "--kv-heads",
             str(args.kv_heads), "--head-dim", str(args.head_dim), "--ffn", str(args.ffn), "--experts",
             str(args.experts), "--moe-ffn", str(args.moe_ffn), "--vocab", str(args.vocab)]
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_convert.py"), *shape, "--_count"],
                         check=True, capture_output=True, text=True).stdout.split()
    per_layer, fixed = int(out[-2]), int(out[-1])
    return max(4, round((size_gb * 1e9 - item * fixed) / (item * per_layer)))


def child_setup_vl(args: argparse.Namespace) -> None:
    """Synthetic Qwen3-VL(-MoE) HF checkpoint (embedding, then one text layer per file, norm and head, the tower)
    -> the Megatron sources whose paths are given (``-``: not wanted), by pmz in this process."""
    sys.path.insert(0, str(ROOT))
    import torch
    from bench_convert_sources import write_sharded

    from converters.cli import main as pmz

    hf_dir, *megatron = (Path(p) if p != "-" else None for p in args._setup_vl)
    hf_dir.mkdir(parents=True)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = vl_config(args, args._layers)
    shapes = vl_shapes(config)
    gen = torch.Generator().manual_seed(0)

    def tensor(name: str, shape: tuple) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32)
        if "norm" in name and name.endswith(".weight"):  # RMSNorm / LayerNorm gains around 1
            t.uniform_(0.9, 1.1, generator=gen)
        else:
            t.uniform_(-0.05, 0.05, generator=gen)
        return t.to(dtype)

    def group(prefix: str | tuple):
        return lambda: {k: tensor(k, v) for k, v in shapes.items() if k.startswith(prefix)}

    text = "model.language_model."
    groups = ([group(f"{text}embed_tokens.")] + [group(f"{text}layers.{i}.") for i in range(args._layers)]
              + [group((f"{text}norm.", "lm_head.")), group("model.visual.")])
    total = write_sharded(hf_dir, groups)
    if total != sum(math.prod(s) for s in shapes.values()) * (2 if args.dtype == "bf16" else 4):
        raise RuntimeError("the synthetic checkpoint's groups do not cover every tensor of the model")
    config.dtype = dtype
    config.save_pretrained(str(hf_dir))
    ep = ["--ep", "2"] if args.model == "qwen3-vl-moe" else []
    how = {"legacy": ["--to", "megatron", "--tp", "2", *ep], "dist": ["--to", "megatron-dist", "--tp", "2", *ep],
           "grouped": ["--to", "megatron", "--tp", "2", "--ep", "2", "--moe-grouped-gemm"],
           "bridge": ["--to", "megatron-bridge", "--tp", "2"]}
    t0 = time.perf_counter()
    for name, path in zip(SOURCES, megatron):
        if path is not None:  # the CLI (as a user runs it), in this process
            if pmz(["convert", str(hf_dir), str(path), *how[name], "--quiet"]) != 0:
                raise RuntimeError(f"pmz convert {hf_dir} {path} {' '.join(how[name])} failed")
    print(json.dumps({"hf_bytes": total, "setup_convert_s": time.perf_counter() - t0}))


def _pmz(*argv: str) -> str:
    """``pmz ARGV`` in a child; its output; raises with the output's tail on a non-zero exit."""
    r = subprocess.run([sys.executable, "-m", "converters.cli", *argv], cwd=str(ROOT), capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pmz {' '.join(argv)}: exit {r.returncode}\n{(r.stdout + r.stderr)[-3000:]}")
    return r.stdout


def _verified(a: Path, b: Path) -> str:
    """``pmz verify A B`` (exact); the line that says how many tensors matched."""
    out = _pmz("verify", str(a), str(b), "--quiet")
    return next((line for line in out.splitlines() if line.startswith("OK")), out.strip().splitlines()[-1])


def check_sources(srcs: dict[str, Path]) -> None:
    """``pmz inspect`` of every source, ``pmz verify`` of each against the HF one (untimed)."""
    for name, path in srcs.items():
        _pmz("inspect", str(path))
        if name != "hf" and "hf" in srcs:
            print(f"  check: pmz inspect {name} ok; pmz verify hf {name}: {_verified(srcs['hf'], path)}", flush=True)


def check_direction(name: str, cmd: list[str], src: Path, out: Path, env: dict) -> None:
    """One conversion of ``name`` (``cmd`` writes ``out``), then ``pmz verify`` of the output against its source
    (exact); the output is left for the caller to remove."""
    subprocess.run(cmd, check=True, cwd=str(ROOT), env=env)
    print(f"  check: {name}: pmz verify source output: {_verified(src, out)}", flush=True)
