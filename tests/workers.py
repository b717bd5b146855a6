"""Worker bodies run on every rank by tests/distributed.py; they return measured differences.

Each rank compares its parallel model with a transformers model loaded from the same directory in
the same process. The parent process (pytest) asserts on the returned numbers, so a failure shows
which case, layout and quantity is off.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from models.common.sources import SafetensorsSource
from parallel import ParallelConfig
from tests.cases import build, load_hf, seq_len_for


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return (a.detach().float() - b.detach().float()).abs().max().item()


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return _max_diff(a, b) / max(b.detach().float().abs().max().item(), 1e-12)


def hf_named_grads(model) -> dict[str, torch.Tensor]:
    """Our gradients under the HF names, whole tensors (gathered over TP/EP, FSDP2 shards by the model's
    own map); zeros for a parameter that got no gradient."""
    return dict(model.iter_hf_weights({n: p.grad if p.grad is not None else torch.zeros_like(p)
                                       for n, p in model.named_parameters()}))


def _batch(vocab: int, seq: int, seed: int = 123):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, seq), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100  # ignored labels must not count
    return ids, labels


def _grad_diffs(model, hf) -> float:
    """Largest relative gradient difference over all HF tensors (our grads gathered over TP)."""
    ours = dict(model.iter_hf_weights({n: p.grad for n, p in model.named_parameters()}))
    ref = dict(hf.named_parameters())
    worst = 0.0
    for name, grad in ours.items():
        worst = max(worst, _rel_diff(grad, ref[name].grad))
    return worst


class CountingSource(SafetensorsSource):
    """Counts the elements actually read from the files (to check each rank reads only its slices)."""

    def __init__(self, path):
        super().__init__(path)
        self.elements_read = 0

    def read(self, name, piece, dtype=None):
        t = super().read(name, piece, dtype)
        self.elements_read += t.numel()
        return t

    def total_elements(self) -> int:
        return sum(math.prod(self.shape(n)) for n in self.names())


def parity_case(case: str, path: str, world: int, sp: bool, steps: int = 2, lr: float = 0.5) -> list[tuple]:
    """Logits, loss, grads and post-SGD-step agreement of one case at TP=world."""
    tag = (case, world, sp)
    hf = load_hf(path)
    source = CountingSource(path)
    model = build(case, (hf.config, source), ParallelConfig(tp=world, sequence_parallel=sp))
    # Each rank reads its 1/tp share (plus small replicated norms/biases and replicated KV heads),
    # never whole tensors: the fraction read minus 1/tp is recorded and bounded by the test.
    read_fraction = source.elements_read / source.total_elements()
    ids, labels = _batch(hf.config.vocab_size, seq_len_for(case))
    out = model(ids, labels=labels, gather_logits=True)
    ref = hf(ids, labels=labels)
    records = [(*tag, "logits", _max_diff(out.logits, ref.logits)), (*tag, "loss", _max_diff(out.loss, ref.loss)),
               (*tag, "read_fraction_excess", read_fraction - 1.0 / world)]
    first_loss = out.loss.item()
    head = model.lm_head
    local = model(ids).logits
    own_columns = ref.logits[..., head.vocab_start:head.vocab_start + head.valid_columns]
    records.append((*tag, "local_logits", _max_diff(local, own_columns)))
    records.append((*tag, "local_logits_shape_ok", float(local.shape[-1] != head.valid_columns)))

    # transformers in fp64, trained alongside: the truth both fp32 models are measured against after the steps
    truth = load_hf(path).double()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (hf, truth)]
    for step in range(steps):
        opt.zero_grad()
        for o in ref_opts:
            o.zero_grad()
        loss = model(ids, labels=labels, return_logits=False).loss
        loss.backward()
        model.finalize_grads()
        hf(ids, labels=labels).loss.backward()
        truth(ids, labels=labels).loss.backward()
        records.append((*tag, f"grads_step{step}", _grad_diffs(model, hf)))
        opt.step()
        for o in ref_opts:
            o.step()
    out = model(ids, labels=labels, gather_logits=True)
    ref = hf(ids, labels=labels)
    exact = truth(ids, labels=labels)
    records += [(*tag, "logits_after_steps", fp32_error_ratio(out.logits, ref.logits, exact.logits)),
                (*tag, "loss_after_steps", fp32_error_ratio(out.loss, ref.loss, exact.loss)),
                (*tag, "loss_change", abs(out.loss.item() - first_loss))]
    return records


def fp32_error_ratio(ours: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor) -> float:
    """Our fp32 error against the fp64 truth, in units of transformers' own fp32 error against it.

    After SGD steps at a large learning rate, fp32 roundings of both models (different but equally
    valid summation orders: TP splits, the fused head's chunks) grow with the steps and with the
    logits' size, and how far depends on the CPU's kernels: an absolute bound sits at the edge on
    some machines (1.0e-5 measured on one, 3.8e-6 on another for the same case, where transformers'
    own error was 3.8e-6). Both are measured against transformers run in fp64 through the same
    steps, so the bound scales with the case; the denominator's floor, 1e-6 of the output's size
    (~8 fp32 ulps), keeps a lucky near-exact transformers run from making the ratio meaningless.
    A real layout error (a gradient summed twice, a missing shard) is orders of magnitude larger."""
    exact = exact.detach().double()
    scale = max(1.0, exact.abs().max().item())

    def diff(t: torch.Tensor) -> float:  # in fp64: the truth is not rounded to fp32 first
        return float("inf") if t.shape != exact.shape else (t.detach().double() - exact).abs().max().item()

    return diff(ours) / max(diff(ref), 1e-6 * scale)


def packed_case(case: str, path: str, world: int, sp: bool) -> list[tuple]:
    """A packed batch (cu_seqlens) equals the right-padded batch with attention_mask, and transformers."""
    tag = (case, world, sp)
    model = build(case, path, ParallelConfig(tp=world, sequence_parallel=sp))
    hf = load_hf(path)
    lengths = [7, 3, 5]
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen) for n in lengths]
    s = max(lengths)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    mask = torch.zeros(len(seqs), s, dtype=torch.long)
    for i, q in enumerate(seqs):
        ids[i, :len(q)] = q
        mask[i, :len(q)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    padded = model(ids, attention_mask=mask, labels=labels, gather_logits=True)
    ref = hf(ids, attention_mask=mask, labels=labels)
    flat = torch.cat(seqs)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = model(flat, cu_seqlens=cu, labels=flat.clone(), gather_logits=True)
    valid = mask.bool()
    return [
        (*tag, "packed_vs_padded_logits", _max_diff(packed.logits[0], padded.logits[valid])),
        (*tag, "packed_vs_padded_loss", _max_diff(packed.loss, padded.loss)),
        (*tag, "padded_vs_hf_logits", _max_diff(padded.logits[valid], ref.logits[valid])),
        (*tag, "packed_vs_hf_loss", _max_diff(packed.loss, ref.loss)),
    ]


def bf16_case(case: str, path: str, world: int, sp: bool, *, plain: bool = True) -> list[tuple]:
    """bf16 model against transformers in bf16 (same weights): documented tolerance, see docs. At tp > 1 with SP
    also the model built with ``ParallelConfig.tp_reduce_in_fp32`` (``tp_fp32sum_*``: the row-parallel partials
    summed in fp32 and rounded once, bitwise transformers' bf16 on the development CPU); ``plain=False``: that
    model alone, and the plain model's ratio against fp32."""
    tag = (case, world, sp)
    hf = load_hf(path, dtype=torch.bfloat16)
    ref32 = load_hf(path)
    ids, labels = _batch(hf.config.vocab_size, seq_len_for(case))
    ref = hf(ids, labels=labels)
    exact = ref32(ids, labels=labels)
    scale = exact.logits.abs().max().item()
    records = []
    layouts = [False] + ([True] if world > 1 and sp else [])
    for fp32_sum in layouts:
        pconfig = ParallelConfig(tp=world, sequence_parallel=sp, tp_reduce_in_fp32=fp32_sum)
        out = build(case, path, pconfig, dtype=torch.bfloat16)(ids, labels=labels, gather_logits=True)
        if fp32_sum:
            records += [(*tag, "tp_fp32sum_logits_rel", _max_diff(out.logits, ref.logits) / scale),
                        (*tag, "tp_fp32sum_loss", _max_diff(out.loss, ref.loss))]
            continue
        # ours in bf16 is no further from the fp32 truth than transformers in bf16 (2x slack)
        records.append((*tag, "bf16_vs_fp32_ratio",
                        _max_diff(out.logits, exact.logits) / max(_max_diff(ref.logits, exact.logits), 1e-6)))
        if plain:
            records += [(*tag, "bf16_logits_rel", _max_diff(out.logits, ref.logits) / scale),
                        (*tag, "bf16_loss", _max_diff(out.loss, ref.loss))]
    return records


def tp_fp32sum_layer_case(world: int) -> list[tuple]:
    """``RowParallelLinear`` (bias; SP off and on) with ``reduce_in_fp32`` in bf16 against one ``nn.Linear`` in bf16,
    its LoRA (``RowLoRA``) against peft's ``LoraModel`` on that ``nn.Linear``; gradients with the flag equal the
    default path's bitwise (its backward is the default's); in fp32 the flag changes nothing (bitwise)."""
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model

    from parallel.layers import RowParallelLinear
    from parallel.lora import RowLoRA

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    k_in, n_out, seq, r = 512, 48, 4 * world, 4
    x = torch.randn(seq, 2, k_in, generator=gen)
    w = torch.randn(n_out, k_in, generator=gen) / k_in ** 0.5
    b, g = torch.randn(n_out, generator=gen), torch.randn(seq, 2, n_out, generator=gen)
    a_lora, b_lora = torch.randn(r, k_in, generator=gen) / k_in ** 0.5, torch.randn(n_out, r, generator=gen)
    cols = slice(rank * k_in // world, (rank + 1) * k_in // world)
    records = []
    for dtype in (torch.bfloat16, torch.float32):
        ref = F.linear(x.to(dtype), w.to(dtype), b.to(dtype))
        lin = torch.nn.Sequential(torch.nn.Linear(k_in, n_out)).to(dtype)
        with torch.no_grad():
            lin[0].weight.copy_(w), lin[0].bias.copy_(b)
        # adapters in the layer's dtype, as ours are (peft would upcast bf16 adapters to fp32 by default)
        peft = get_peft_model(lin, LoraConfig(r=r, lora_alpha=8, target_modules=["0"]), autocast_adapter_dtype=False)
        with torch.no_grad():
            peft.base_model.model[0].lora_A["default"].weight.copy_(a_lora)
            peft.base_model.model[0].lora_B["default"].weight.copy_(b_lora)
            ref_lora = peft(x.to(dtype))
        for sp in (False, True):
            rows = (lambda t: t.chunk(world, 0)[rank]) if sp else (lambda t: t)
            runs = {}
            for flag in (False, True):
                layer = RowParallelLinear(k_in, n_out, bias=True, tp_group=dist.group.WORLD, sequence_parallel=sp,
                                          dtype=dtype, reduce_in_fp32=flag)
                with torch.no_grad():
                    layer.weight.copy_(w[:, cols]), layer.bias.copy_(b)
                xl = x[..., cols].to(dtype).requires_grad_()
                y = layer(xl)
                y.backward(rows(g).to(dtype))
                runs[flag] = (y.detach(), xl.grad, layer.weight.grad, layer.bias.grad)
                layer.lora = RowLoRA("proj", k_in // world, n_out, r=r, scaling=2.0, dropout=0.0,
                                     tp_group=dist.group.WORLD, sequence_parallel=sp, dtype=dtype)
                with torch.no_grad():
                    layer.lora.lora_A_proj.copy_(a_lora[:, cols]), layer.lora.lora_B_proj.copy_(b_lora)
                    runs[flag] += (layer(xl),)
            tag, scale = (f"layer_{str(dtype)[6:]}", world, sp), ref.abs().max().item()
            grads_moved = max(_max_diff(p, q) for p, q in zip(runs[False][1:4], runs[True][1:4]))
            if dtype == torch.float32:  # the flag is a no-op in fp32
                records.append((*tag, "tp_fp32sum_fp32_noop",
                                max(_max_diff(p, q) for p, q in zip(runs[False], runs[True]))))
                continue
            records += [(*tag, "tp_fp32sum_layer_rel", _max_diff(runs[True][0], rows(ref)) / scale),
                        (*tag, "tp_fp32sum_lora_rel", _max_diff(runs[True][4], rows(ref_lora)) / scale),
                        (*tag, "tp_fp32sum_grads_vs_default", grads_moved),
                        # the default path does round more: the flag must change the forward somewhere
                        (*tag, "tp_fp32sum_default_differs", float(not torch.equal(runs[False][0], rows(ref))))]
    return records


def parity_suite(dirs: dict[str, str], extras: bool, fp32_sum_dirs: dict[str, str] | None = None) -> list[tuple]:
    """Every case at TP = world size, SP off and (when tp > 1) on; packed/bf16 checks when ``extras``;
    ``fp32_sum_dirs``: more cases run only in bf16 with and without ``tp_reduce_in_fp32`` (TP+SP)."""
    world = dist.get_world_size()
    records = []
    for sp in ([False, True] if world > 1 else [False]):
        for case, path in dirs.items():
            records += parity_case(case, path, world, sp)
            if extras:
                records += packed_case(case, path, world, sp)
                records += bf16_case(case, path, world, sp)
    if world > 1 and extras:
        records += tp_fp32sum_layer_case(world)
        for case, path in (fp32_sum_dirs or {}).items():
            records += bf16_case(case, path, world, True, plain=False)
    return records


def megatron_groups_case(path: str) -> list[tuple]:
    """The model runs on groups adopted from megatron-core's parallel_state (TP=2, SP) and matches HF."""
    from megatron.core import parallel_state as ps

    from parallel import groups_from_megatron

    world = dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        groups = groups_from_megatron(ParallelConfig(tp=world, sequence_parallel=True))
        model = build("qwen2", path, groups.config, groups=groups)
        hf = load_hf(path)
        ids, labels = _batch(hf.config.vocab_size, 10)
        out = model(ids, labels=labels, gather_logits=True)
        ref = hf(ids, labels=labels)
        tag = ("megatron_groups", world, True)
        return [(*tag, "logits", _max_diff(out.logits, ref.logits)), (*tag, "loss", _max_diff(out.loss, ref.loss)),
                (*tag, "tp_rank_matches_megatron", float(groups.tp_rank != ps.get_tensor_model_parallel_rank()))]
    finally:
        ps.destroy_model_parallel()


def random_init_case(hf_config) -> list[tuple]:
    """A model built from a config (random weights) exports, gathered over TP, to an HF state dict that
    transformers loads strictly and that reproduces our logits."""
    from transformers import AutoModelForCausalLM

    world = dist.get_world_size()
    model = build(hf_config.model_type, hf_config, ParallelConfig(tp=world, sequence_parallel=world > 1), seed=3)
    state = dict(model.iter_hf_weights())
    hf = AutoModelForCausalLM.from_config(hf_config).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (hf_config.tie_word_embeddings and m == "lm_head.weight")]
    ids, labels = _batch(hf_config.vocab_size, 10)
    out = model(ids, labels=labels, gather_logits=True)
    ref = hf(ids, labels=labels)
    tag = (f"random_init_{hf_config.model_type}", world, world > 1)
    return [(*tag, "state_keys_mismatch", float(len(missing) + len(unexpected))),
            (*tag, "logits", _max_diff(out.logits, ref.logits)), (*tag, "loss", _max_diff(out.loss, ref.loss))]


def adapter_and_init_suite(path: str, configs: list) -> list[tuple]:
    records = megatron_groups_case(path)
    for cfg in configs:
        records += random_init_case(cfg)
    return records


def saved_tensors_diff(model, path: str, pconfig: ParallelConfig) -> float:
    """``model.save_pretrained`` (collective) must write every tensor of the source checkpoint ``path``
    bitwise under the same names; the largest difference (inf: the names differ), on every rank."""
    import re
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file

    out = f"{path}_saved_{re.sub('[^a-z0-9]+', '_', pconfig.describe())}"
    model.save_pretrained(out)
    worst = 0.0
    if not dist.is_initialized() or dist.get_rank() == 0:
        def tensors(folder):
            merged = {}
            for f in sorted(Path(folder).glob("*.safetensors")):
                merged.update(load_file(str(f)))
            return merged

        saved, source = tensors(out), tensors(path)
        worst = (float("inf") if set(saved) != set(source)
                 else max((_max_diff(saved[n], source[n]) for n in source), default=0.0))
        shutil.rmtree(out)
    if dist.is_initialized():
        dist.barrier()
    return worst
