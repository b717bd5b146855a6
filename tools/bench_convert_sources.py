"""Synthetic source checkpoints for ``tools/bench_convert.py`` (run in its child processes: torch and
transformers are imported here, never in the timing parent, whose pages a fork would copy into every
timed child's peak RSS).

* dense Llama / Qwen2 (``child_setup``): HF, then Megatron legacy TP=2 PP=2 by pmz;
* Qwen3-MoE (``child_setup_moe``): HF with experts per expert, then legacy / torch_dist EP=2 x TP=2;
* the Gated DeltaNet hybrids (``child_setup_hybrid``): Qwen3.5 / Qwen3.5-MoE text checkpoints, and their
  conditional-generation checkpoints with the vision tower (``--model qwen3.5-vl`` / ``qwen3.5-moe-vl``:
  ``Qwen3_5ForConditionalGeneration``, text under ``model.language_model.``, the tower under
  ``model.visual.``, as released), names and shapes from transformers' own model on the meta device;
* the peer converter of ``--peers`` (``child_naive``: load every rank file whole, merge, save);
* ``layers_for``: the layer count that brings a model to the size asked for.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HYBRIDS = ("qwen3.5", "qwen3.5-moe")
VL_HYBRIDS = ("qwen3.5-vl", "qwen3.5-moe-vl")  # the same text models as conditional-generation checkpoints
ALL_HYBRIDS = HYBRIDS + VL_HYBRIDS

def write_sharded(hf_dir: Path, groups: list) -> int:
    """An HF safetensors checkpoint of one file per group (each group a callable making its tensors, one
    group in memory at a time) with its index, as transformers shards a model; returns the tensor bytes."""
    from safetensors.torch import save_file

    n = len(groups)
    weight_map, total = {}, 0
    for k, make in enumerate(groups):
        tensors = make()
        name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(hf_dir / name), metadata={"format": "pt"})
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
        del tensors
    (hf_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


def child_setup(args: argparse.Namespace) -> None:
    """Synthetic HF checkpoint (layer by layer) -> Megatron legacy TP=2 PP=2 (the parent deletes the HF dir)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from converters import convert

    hf_dir, mcore_dir = Path(args._setup[0]), Path(args._setup[1])
    hf_dir.mkdir(parents=True)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    h, nh, kv, ffn, L, V = args.hidden, args.heads, args.kv_heads, args.ffn, args._layers, args.vocab
    hd = h // nh
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.empty(shape, dtype=torch.float32).uniform_(-0.05, 0.05, generator=gen).to(dtype)

    groups = []  # callables returning one shard's tensors
    groups.append(lambda: {"model.embed_tokens.weight": rand(V, h)})
    for i in range(L):
        def layer(i=i):
            pre = f"model.layers.{i}."
            t = {pre + "self_attn.q_proj.weight": rand(nh * hd, h), pre + "self_attn.k_proj.weight": rand(kv * hd, h),
                 pre + "self_attn.v_proj.weight": rand(kv * hd, h), pre + "self_attn.o_proj.weight": rand(h, nh * hd),
                 pre + "mlp.gate_proj.weight": rand(ffn, h), pre + "mlp.up_proj.weight": rand(ffn, h),
                 pre + "mlp.down_proj.weight": rand(h, ffn),
                 pre + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                 pre + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)}
            if args.arch == "qwen2":
                t.update({pre + "self_attn.q_proj.bias": rand(nh * hd), pre + "self_attn.k_proj.bias": rand(kv * hd),
                          pre + "self_attn.v_proj.bias": rand(kv * hd)})
            return t
        groups.append(layer)
    groups.append(lambda: {"model.norm.weight": torch.ones(h, dtype=dtype), "lm_head.weight": rand(V, h)})

    total = write_sharded(hf_dir, groups)
    common = dict(vocab_size=V, hidden_size=h, intermediate_size=ffn, num_hidden_layers=L, num_attention_heads=nh,
                  num_key_value_heads=kv, max_position_embeddings=4096, tie_word_embeddings=False)
    if args.arch == "qwen2":
        from transformers import Qwen2Config as Config
    else:
        from transformers import LlamaConfig as Config
    config = Config(**common)
    config.dtype = dtype
    config.save_pretrained(str(hf_dir))
    t0 = time.perf_counter()
    convert(str(hf_dir), str(mcore_dir), to="megatron", tp=2, pp=2)
    print(json.dumps({"hf_bytes": total, "setup_convert_s": time.perf_counter() - t0}))


def child_setup_moe(args: argparse.Namespace) -> None:
    """Synthetic Qwen3-MoE HF checkpoint (one layer per file) -> Megatron legacy EP=2 TP=2
    (SequentialMLP experts) and, when a path is given, torch_dist EP=2 TP=2, by pmz (the parent
    deletes the HF dir)."""
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import Qwen3MoeConfig

    from converters import convert

    hf_dir, legacy_dir, dist_dir = (Path(p) if p != "-" else None for p in args._setup_moe)
    hf_dir.mkdir(parents=True)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    h, nh, kv, hd, L, V = args.hidden, args.heads, args.kv_heads, args.head_dim, args._layers, args.vocab
    E, F = args.experts, args.moe_ffn
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.empty(shape, dtype=torch.float32).uniform_(-0.05, 0.05, generator=gen).to(dtype)

    def norm(n):
        return (1.0 + torch.empty(n, dtype=torch.float32).uniform_(-0.1, 0.1, generator=gen)).to(dtype)

    groups = [lambda: {"model.embed_tokens.weight": rand(V, h)}]
    for i in range(L):
        def layer(i=i):
            pre = f"model.layers.{i}."
            t = {pre + "self_attn.q_proj.weight": rand(nh * hd, h), pre + "self_attn.k_proj.weight": rand(kv * hd, h),
                 pre + "self_attn.v_proj.weight": rand(kv * hd, h), pre + "self_attn.o_proj.weight": rand(h, nh * hd),
                 pre + "self_attn.q_norm.weight": norm(hd), pre + "self_attn.k_norm.weight": norm(hd),
                 pre + "mlp.gate.weight": rand(E, h),
                 pre + "input_layernorm.weight": norm(h), pre + "post_attention_layernorm.weight": norm(h)}
            for e in range(E):
                x = f"{pre}mlp.experts.{e}."
                t.update({x + "gate_proj.weight": rand(F, h), x + "up_proj.weight": rand(F, h),
                          x + "down_proj.weight": rand(h, F)})
            return t
        groups.append(layer)
    groups.append(lambda: {"model.norm.weight": norm(h), "lm_head.weight": rand(V, h)})
    total = write_sharded(hf_dir, groups)
    config = Qwen3MoeConfig(vocab_size=V, hidden_size=h, intermediate_size=3 * F, num_hidden_layers=L,
                            num_attention_heads=nh, num_key_value_heads=kv, head_dim=hd, num_experts=E,
                            num_experts_per_tok=min(8, E), moe_intermediate_size=F, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
                            tie_word_embeddings=False)
    config.dtype = dtype
    config.save_pretrained(str(hf_dir))
    t0 = time.perf_counter()
    if legacy_dir is not None:
        convert(str(hf_dir), str(legacy_dir), to="megatron", tp=2, ep=2)
    if dist_dir is not None:
        convert(str(hf_dir), str(dist_dir), to="megatron-dist", tp=2, ep=2)
    print(json.dumps({"hf_bytes": total, "setup_convert_s": time.perf_counter() - t0}))


def hybrid_config(args: argparse.Namespace, layers: int):
    """The transformers config of the synthetic hybrid (every 4th layer full attention, the last one included,
    as in the released checkpoints): the text config, or (``VL_HYBRIDS``) the conditional-generation config
    around it with transformers' default Qwen3.5 vision tower (27 blocks of 1152, ~0.8 GB in bf16) projecting
    to the text model's width."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    hk, hv, dh = (int(x) for x in args.linear_heads.split(","))
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                  linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dh,
                  linear_value_head_dim=dh, max_position_embeddings=4096, tie_word_embeddings=False,
                  layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)])
    moe = args.model.startswith("qwen3.5-moe")
    if not moe:
        text = Qwen3_5TextConfig(**common, intermediate_size=args.ffn)
    else:
        text = Qwen3_5MoeTextConfig(**common, num_experts=args.experts, moe_intermediate_size=args.moe_ffn,
                                    shared_expert_intermediate_size=args.moe_ffn,
                                    num_experts_per_tok=min(8, args.experts))
    if args.model not in VL_HYBRIDS:
        return text
    if not args.no_mtp:
        text.mtp_num_hidden_layers = 1
    return (Qwen3_5MoeConfig if moe else Qwen3_5Config)(text_config=text.to_dict(),
                                                       vision_config={"out_hidden_size": args.hidden},
                                                       tie_word_embeddings=False)


def text_prefix(config) -> str:
    """Where the text model's tensors live: ``model.`` (text checkpoint) or ``model.language_model.``."""
    return "model.language_model." if hasattr(config, "text_config") else "model."


def hybrid_shapes(config) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a checkpoint of ``config`` stores: transformers' own model built on
    the meta device (no memory), its fused experts written per expert as released checkpoints store them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    with torch.device("meta"):
        vl = hasattr(config, "text_config")
        model = (AutoModelForImageTextToText if vl else AutoModelForCausalLM).from_config(config)
    shapes = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2F, H]: gate rows then up rows per expert
            base, (E, F2, H) = name.removesuffix("gate_up_proj"), t.shape
            for e in range(E):
                shapes.update({f"{base}{e}.gate_proj.weight": (F2 // 2, H), f"{base}{e}.up_proj.weight": (F2 // 2, H)})
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, F]
            base, (E, H, F) = name.removesuffix("down_proj"), t.shape
            shapes.update({f"{base}{e}.down_proj.weight": (H, F) for e in range(E)})
        else:
            shapes[name] = tuple(t.shape)
    return shapes


def hybrid_counts(args: argparse.Namespace) -> tuple[int, int]:
    """(elements of four decoder layers, elements outside the decoder layers but the MTP block): what
    ``layers_for`` scales by."""
    import math

    config = hybrid_config(args, 4)
    layers = text_prefix(config) + "layers."
    shapes = hybrid_shapes(config)
    per4 = sum(math.prod(s) for k, s in shapes.items() if k.startswith(layers))
    fixed = sum(math.prod(s) for k, s in shapes.items() if not k.startswith((layers, "mtp.")))
    return per4, fixed


def child_setup_hybrid(args: argparse.Namespace) -> None:
    """Synthetic Qwen3.5 / Qwen3.5-MoE HF checkpoint (one layer per file, MTP block in the last file; the
    conditional-generation ones: the tower in a file of its own) -> Megatron legacy TP=2 and torch_dist
    TP=2 by pmz, each when a path is given (the parent deletes nothing: HF is a source too)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from converters import convert

    hf_dir, legacy_dir, dist_dir = (Path(p) if p != "-" else None for p in args._setup_hybrid)
    hf_dir.mkdir(parents=True)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = hybrid_config(args, args._layers)
    text = getattr(config, "text_config", config)
    pre_text = text_prefix(config)
    shapes = hybrid_shapes(config)
    full = [i for i, kind in enumerate(text.layer_types) if kind == "full_attention"][-1]
    if not args.no_mtp:  # one MTP block: a full-attention layer with the model's MLP, its fc and norms
        h = args.hidden
        pre = f"{pre_text}layers.{full}."
        shapes.update({"mtp.layers.0." + k.removeprefix(pre): v for k, v in list(shapes.items()) if k.startswith(pre)})
        shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                       "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
    gen = torch.Generator().manual_seed(0)

    def tensor(name: str, shape: tuple) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32)
        if name.endswith("linear_attn.norm.weight"):  # the gated norm (plain RMSNorm) around 1
            t.uniform_(0.9, 1.1, generator=gen)
        elif "norm" in name or name.endswith(("A_log", "dt_bias")):  # zero-centred norms around 0
            t.uniform_(-0.1, 0.1, generator=gen)
        else:
            t.uniform_(-0.05, 0.05, generator=gen)
        return t.to(dtype)

    def group(prefix: str | tuple):
        return lambda: {k: tensor(k, v) for k, v in shapes.items() if k.startswith(prefix)}

    groups = [group(f"{pre_text}embed_tokens.")] + [group(f"{pre_text}layers.{i}.") for i in range(args._layers)]
    groups.append(group((f"{pre_text}norm.", "lm_head.", "mtp.")))
    if text is not config:
        groups.append(group("model.visual."))
    total = write_sharded(hf_dir, groups)
    config.dtype = dtype
    config.save_pretrained(str(hf_dir))
    if not args.no_mtp and text is config:
        cfg_path = hf_dir / "config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "mtp_num_hidden_layers": 1}, indent=2))
    t0 = time.perf_counter()
    if legacy_dir is not None:
        convert(str(hf_dir), str(legacy_dir), to="megatron", tp=2)
    if dist_dir is not None:
        convert(str(hf_dir), str(dist_dir), to="megatron-dist", tp=2)
    print(json.dumps({"hf_bytes": total, "setup_convert_s": time.perf_counter() - t0}))


def child_naive(args: argparse.Namespace) -> None:
    """The peer: a load-all-and-merge converter, as the simple tools do it (every rank file loaded
    whole, TP shards concatenated, the whole HF state dict built in memory, then saved)."""
    sys.path.insert(0, str(ROOT))
    import torch
    from safetensors.torch import save_file

    from converters.layout.megatron import megatron_to_hf, merge_tp, tp_split_kind
    from converters.layout.stages import unit_megatron_keys
    from converters.torch_path.megatron_legacy import LegacyReader

    src, dst = Path(args._naive[0]), Path(args._naive[1])
    meta = LegacyReader(src)  # only for the file names, the model config and the stage layout
    lay = meta.layout
    files = {(t, p): torch.load(meta.it_dir / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if lay.pp > 1 else ""))
                                / "model_optim_rng.pt", map_location="cpu", weights_only=False)
             for t in range(meta.tp) for p in range(lay.pp)}
    out = {}
    for unit in meta.units():
        p, v = lay.unit_location(unit)
        local = None if not isinstance(unit, int) else lay.where[unit][2]
        for entry, key in unit_megatron_keys(meta.wmap, unit, local):
            shards = [files[t, p]["model" if lay.vpp == 1 else f"model{v}"][key] for t in range(meta.tp)]
            full = merge_tp(tp_split_kind(entry, shards[0].dim()), shards, key)
            out.update(zip(entry.hf, (t.contiguous() for t in megatron_to_hf(entry, full, meta.cfg))))
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    meta.hf_config.save(str(dst))


def layers_for(args: argparse.Namespace, size_gb: float) -> int:
    """Smallest even layer count whose checkpoint reaches ``size_gb`` (even: PP=2 splits it evenly);
    qwen3-moe: the layer count nearest to it (no PP; a layer is ~1.25 GB at the default shape)."""
    item = 2 if args.dtype == "bf16" else 4
    if args.model in ALL_HYBRIDS:  # four layers (three linear, one full) at a time, from the meta
        # model's shapes, counted in a child: torch imported here would be in every timed child's peak RSS
        # (a fork copies the parent's pages, which ru_maxrss counts before exec)
        shape = ["--model", args.model, "--hidden", str(args.hidden), "--heads", str(args.heads), "--kv-heads",
                 str(args.kv_heads), "--head-dim", str(args.head_dim), "--ffn", str(args.ffn), "--experts",
                 str(args.experts), "--moe-ffn", str(args.moe_ffn), "--vocab", str(args.vocab), "--linear-heads",
                 args.linear_heads]
        per4, fixed = (int(x) for x in subprocess.run([sys.executable, str(ROOT / "tools" / "bench_convert.py"),
                                                        *shape, "--_count"], check=True, capture_output=True,
                                                       text=True).stdout.split()[-2:])
        return 4 * max(1, round((size_gb * 1e9 - item * fixed) / (item * per4)))
    if args.model == "qwen3-moe":
        h, q, kv = args.hidden, args.heads * args.head_dim, args.kv_heads * args.head_dim
        per_layer = item * (2 * q * h + 2 * kv * h + 2 * args.head_dim + args.experts * h
                            + 3 * args.experts * args.moe_ffn * h + 2 * h)
        fixed = item * (2 * args.vocab * h + h)
        return max(1, round((size_gb * 1e9 - fixed) / per_layer))
    h, kv_rows = args.hidden, args.kv_heads * (args.hidden // args.heads)
    per_layer = item * (2 * h * h + 2 * kv_rows * h + 3 * args.ffn * h + 2 * h)
    fixed = item * (2 * args.vocab * h + h)
    need = max(1, -(-int(size_gb * 1e9 - fixed) // per_layer))
    return need + need % 2
