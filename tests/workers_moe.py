"""Qwen2-MoE worker bodies (run on every rank by tests/test_moe.py): our parallel model against
transformers' ``Qwen2MoeForCausalLM`` loaded from the same directory in the same process.

Every rank gets the same batch, so with the EP group carved from the data-parallel ranks the
reference is one transformers model (DP averaging of identical gradients changes nothing).
transformers 5 fuses experts in memory (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj
[E, H, I]``); ``hf_grads`` reads its gradients under the per-expert names written on disk.
"""

from __future__ import annotations

from pathlib import Path

import torch

from parallel import ParallelConfig
from tests.workers import _max_diff, _rel_diff, hf_named_grads, saved_tensors_diff

MOE_CASES = {
    # shared expert, norm_topk_prob False, a dense layer (mlp_only_layers), aux loss weighted heavily
    "shared": dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                   num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
                   router_aux_loss_coef=0.1, max_position_embeddings=64, tie_word_embeddings=False),
    # no shared expert (size 0, zero-size tensors on disk), renormalised top-k, sparse every 2nd layer
    "plain": dict(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, moe_intermediate_size=24, shared_expert_intermediate_size=0,
                  num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=2,
                  router_aux_loss_coef=0.1, max_position_embeddings=64, tie_word_embeddings=False),
}


def write_moe_model(root, name: str, seed: int = 0) -> str:
    """A random Qwen2-MoE saved by transformers (per-expert names on disk), every tensor randomized
    (norms and the shared-expert gate too, which transformers initializes to constants)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**MOE_CASES[name]))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    path = Path(root) / name
    model.save_pretrained(str(path))
    return str(path)


def per_expert_names(named) -> dict[str, torch.Tensor]:
    """``(name, tensor)`` pairs of a transformers model (fused experts ``mlp.experts.gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``) under the HF on-disk names (per expert); other names unchanged."""
    out = {}
    for name, t in named:
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def hf_grads(hf) -> dict[str, torch.Tensor]:
    """transformers' gradients under the HF on-disk names (fused experts split per expert)."""
    return per_expert_names((name, p.grad) for name, p in hf.named_parameters() if p.grad is not None)


def _grad_diff(model, hf) -> float:
    ours = hf_named_grads(model)
    ref = hf_grads(hf)
    missing = set(ours) - set(ref)
    worst = 0.0
    for name, grad in ours.items():
        if name in missing:
            if grad.numel() and grad.abs().max() > 0:  # a tensor transformers never used must stay untouched
                return float("inf")
            continue
        if grad.numel():
            worst = max(worst, _rel_diff(grad, ref[name]))
    return worst


def _batch(vocab: int, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 11), generator=gen)
    labels = ids.clone()
    labels[0, :2] = -100
    return ids, labels


def _reference_microbatch_loss(hf, ids, labels, schedule_mbs: int):
    """transformers' loss for ``forward_backward(..., num_microbatches=schedule_mbs, aux_loss=True)`` on
    the 2-row batch: cross entropy over the whole batch plus the coefficient times the load-balancing
    loss of each micro-batch averaged (one micro-batch: the whole batch; two: one row each)."""
    ce = hf(ids, labels=labels).loss
    if schedule_mbs == 1:
        aux = hf(ids, labels=labels, output_router_logits=True).aux_loss
    else:
        aux = sum(hf(ids[r:r + 1], output_router_logits=True).aux_loss for r in range(ids.shape[0])) / ids.shape[0]
    return ce + hf.config.router_aux_loss_coef * aux, aux


def parity(case: str, path: str, pconfig: ParallelConfig, steps: int = 2, lr: float = 0.3,
           microbatches: int | None = None, schedule: str = "1f1b") -> list[tuple]:
    """Logits, loss with the aux loss, router logits, a padded batch, and two SGD steps (grads compared).

    Pipeline layouts, and others when ``microbatches`` is given, train through ``forward_backward``
    with the load-balancing loss (per micro-batch, see ``_reference_microbatch_loss``)."""
    import importlib

    from transformers import AutoModelForCausalLM

    tag = (case, pconfig.describe() + (f" forward_backward({microbatches} {schedule})" if microbatches else ""))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # the model folder of the checkpoint's model_type (qwen2_moe, qwen3_moe)
    model = importlib.import_module(f"models.{hf.config.model_type}").build_parallel_model(path, pconfig)
    ids, labels = _batch(hf.config.vocab_size)
    records = []
    if pconfig.pp == 1:
        out = model(ids, labels=labels, gather_logits=True, output_router_logits=True)
        ref = hf(ids, labels=labels, output_router_logits=True)
        records += [(*tag, "logits", _max_diff(out.logits, ref.logits)), (*tag, "loss", _max_diff(out.loss, ref.loss)),
                    (*tag, "aux_loss", _max_diff(out.aux_loss, ref.aux_loss)),
                    (*tag, "router_logits", max(_max_diff(a, b) for a, b in zip(out.router_logits, ref.router_logits))),
                    (*tag, "router_layers", float(len(out.router_logits) != len(ref.router_logits)))]
        mask = torch.ones_like(ids)
        mask[1, 7:] = 0  # right padding: excluded from the aux loss statistics as transformers does
        out = model(ids, attention_mask=mask, labels=labels, gather_logits=True, output_router_logits=True)
        ref = hf(ids, attention_mask=mask, labels=labels, output_router_logits=True)
        valid = mask.bool()
        records += [(*tag, "masked_logits", _max_diff(out.logits[valid], ref.logits[valid])),
                    (*tag, "masked_aux_loss", _max_diff(out.aux_loss, ref.aux_loss))]
    records.append((*tag, "saved_tensors", saved_tensors_diff(model, path, pconfig)))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(hf.parameters(), lr=lr)
    first = None
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        if pconfig.pp > 1 or microbatches is not None:
            n_mbs = microbatches or 2
            loss, aux = model.forward_backward(ids, labels, num_microbatches=n_mbs, schedule=schedule, aux_loss=True,
                                               return_aux_loss=True)
            ref_loss, ref_aux = _reference_microbatch_loss(hf, ids, labels, n_mbs)
            records.append((*tag, f"step{step}_microbatch_aux_loss", _max_diff(aux, ref_aux)))
        else:
            loss = model(ids, labels=labels, return_logits=False, output_router_logits=True).loss
            loss.backward()
            model.finalize_grads()
            ref_loss = hf(ids, labels=labels, output_router_logits=True).loss
        ref_loss.backward()
        records += [(*tag, f"step{step}_loss", _max_diff(loss, ref_loss)),
                    (*tag, f"grads_step{step}", _grad_diff(model, hf))]
        first = loss.item() if first is None else first
        opt.step()
        ref_opt.step()
    if pconfig.pp == 1:
        out = model(ids, labels=labels, gather_logits=True)
        ref = hf(ids, labels=labels)
        records += [(*tag, "logits_after_steps", _max_diff(out.logits, ref.logits)),
                    (*tag, "loss_change", abs(out.loss.item() - first))]
    return records


def suite(dirs: dict[str, str], layouts: list[tuple[str, dict]]) -> list[tuple]:
    records = []
    for case, kwargs, *options in layouts:
        records += parity(case, dirs[case], ParallelConfig(**kwargs), **(options[0] if options else {}))
    return records


def _dispatch_inputs(rank: int, tokens: int, skew: bool, num_experts: int, hidden: int, top_k: int):
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, num_experts, generator=gen)
    if skew:  # every token picks experts of EP rank 0 only: the other ranks receive nothing
        logits[:, num_experts // 2:] -= 100.0
    cotangent = torch.randn(tokens, hidden, generator=gen)
    return x, logits, cotangent


def dispatch_case(dispatcher: str, token_counts: list[int], skew: bool) -> list[tuple]:
    """One MoE dispatch over the EP group (uneven token counts per rank, optionally no tokens for some
    ranks' experts) against a per-token dense reference computed from every rank's inputs."""
    import torch.distributed as dist

    from parallel.experts import dispatch, route

    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts, hidden, inter, top_k = 4 * world, 16, 8, 2
    gen = torch.Generator().manual_seed(0)
    w13_full = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.3
    w2_full = torch.randn(num_experts, hidden, inter, generator=gen) * 0.3
    local = num_experts // world
    w13 = w13_full[rank * local:(rank + 1) * local].clone().requires_grad_(True)
    w2 = w2_full[rank * local:(rank + 1) * local].clone().requires_grad_(True)
    x, logits, cot = _dispatch_inputs(rank, token_counts[rank], skew, num_experts, hidden, top_k)
    x.requires_grad_(True)
    logits.requires_grad_(True)
    weights, experts, _ = route(logits, top_k, norm_topk_prob=True)
    out = dispatch(dispatcher)(x, experts, weights, w13, w2, num_experts, None if world == 1 else dist.group.WORLD)
    (out * cot).sum().backward()

    # reference: every rank's tokens through the dense experts, one token and one expert at a time
    ref_w13 = w13_full.clone().requires_grad_(True)
    ref_w2 = w2_full.clone().requires_grad_(True)
    total = 0.0
    mine = None
    for r in range(world):
        xr, lr, cr = _dispatch_inputs(r, token_counts[r], skew, num_experts, hidden, top_k)
        xr.requires_grad_(r == rank)
        lr.requires_grad_(r == rank)
        wr, er, _ = route(lr, top_k, norm_topk_prob=True)
        rows = []
        for t in range(xr.shape[0]):
            acc = torch.zeros(hidden)
            for j in range(top_k):
                e = int(er[t, j])
                gate, up = (ref_w13[e] @ xr[t]).chunk(2)
                acc = acc + wr[t, j] * (ref_w2[e] @ (torch.nn.functional.silu(gate) * up))
            rows.append(acc)
        ref_out = torch.stack(rows) if rows else xr.new_zeros((0, hidden))
        total = total + (ref_out * cr).sum()
        if r == rank:
            mine = (ref_out, xr, lr)
    total.backward()
    ref_out, xr, lr = mine
    tag = (f"dispatch_{dispatcher}", f"ep={world} tokens={token_counts} skew={skew}")
    return [(*tag, "output", _max_diff(out, ref_out)),
            (*tag, "input_grad", _max_diff(x.grad, xr.grad) if x.numel() else 0.0),
            (*tag, "router_grad", _max_diff(logits.grad, lr.grad) if x.numel() else 0.0),
            (*tag, "w13_grad", _max_diff(w13.grad, ref_w13.grad[rank * local:(rank + 1) * local])),
            (*tag, "w2_grad", _max_diff(w2.grad, ref_w2.grad[rank * local:(rank + 1) * local]))]


def dispatch_suite(cases: list[tuple]) -> list[tuple]:
    records = []
    for case in cases:
        records += dispatch_case(*case)
    return records


def fsdp_with_ep_refusal(path: str) -> str:
    """FSDP2 with ep=2 (the replica mesh would hold different experts): the error message, raised by the
    builder before any process group or collective (every rank must get one, none may hang)."""
    from models.qwen2_moe import build_parallel_model
    from parallel import ParallelConfigError

    try:
        build_parallel_model(path, ParallelConfig(ep=2, fsdp=True))
    except ParallelConfigError as exc:
        return str(exc)
    return "no error"
