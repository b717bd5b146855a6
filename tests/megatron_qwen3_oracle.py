"""Real megatron-core Qwen3 / Qwen3-MoE models on CPU as the oracle of the Megatron converters.

Run inside processes spawned by ``tests/distributed.run_distributed`` (gloo). megatron-core builds a
Qwen3-like ``GPTModel`` (local spec with ``qk_layernorm=True``, ``kv_channels`` != hidden/heads, no
linear biases, tied or untied embeddings) or a Qwen3-MoE one (no shared expert, softmax router,
``SequentialMLP`` or grouped-GEMM ``GroupedMLP`` experts) at a TP/PP/VPP/EP layout, its weights
loaded from a transformers checkpoint through the hand-written mapping below (independent of
converters/), writes Megatron-LM checkpoints (legacy ``torch`` per rank, or ``torch_dist``), loads
checkpoint folders back strictly and returns the logits of the fixed prompt.

CPU shims beyond the dense and MoE oracles' (``megatron_oracle.apply_cpu_shims``, the allgather
dispatcher, ``moe_utils.te_general_gemm = None``): ``GroupedMLP`` asserts the ``grouped_gemm``
package when built and calls ``grouped_gemm.ops.gmm`` in its forward -- ``grouped_gemm_util`` is
made to report it available and ``ops.gmm`` is a per-expert matmul loop (``_gmm``: rows of expert
g times ``w[g]``, ``trans_b`` honoured); its forward also asserts ``config.bf16``, so each
``GroupedMLP`` gets a copy of the config with ``bf16=True`` (the flag is read nowhere else in it;
the weights and the computation stay fp32).

Router: transformers' Qwen3-MoE is softmax over all experts, top-k, renormalised over the k when
``norm_topk_prob`` (its released checkpoints) = megatron-core's ``moe_router_pre_softmax=False``
(top-k of the logits, softmax over the k); ``norm_topk_prob=False`` = ``moe_router_pre_softmax=True``.
No ``moe_router_topk_scaling_factor``. Checked by the logits (tests/test_convert_qwen3_megatron.py).

GroupedMLP's parameters (megatron-core 0.16 ``experts.GroupedMLP``), per layer and EP rank, with
``E_local`` experts, ``F = moe_ffn_hidden_size`` and TP rank r of ``tp`` (expert TP = TP):

    weight1 [H, E_local * 2F/tp]: forward views it as ``weight1.view(E_local, H, 2F/tp)`` -- a
            reinterpretation of memory, not column blocks -- and expert e's block is the transpose of
            SequentialMLP's fc1 shard ``[gate_r; up_r]`` (the GLU chunks the last dim in two: gate, up)
    weight2 [E_local * F/tp, H]: ``view(E_local, F/tp, H)``, expert e's block is the transpose of
            SequentialMLP's fc2 shard ``[H, F/tp]``

So ``weight1 = stack([fc1_e.T for e]).reshape(H, -1)``. ``GroupedMLP.sharded_state_dict`` stores
the same global tensors as SequentialMLP in torch_dist (``...mlp.experts.experts.linear_fc1.weight``
``[L, E, 2F, H]`` in gate and up chunks per TP rank, ``linear_fc2.weight`` ``[L, E, H, F]``).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tests.megatron_oracle import (
    ITERATION,
    _chunk_key,
    _load_chunk,
    apply_cpu_shims,
    forward_logits,
    iteration_dir,
    megatron_args,
    prompt_ids,
    read_tracker,
    transformer_config,
)

__all__ = ["Qwen3Spec", "Layout", "hf_config_of", "save_from_hf", "load_logits", "prompt_ids", "ITERATION"]


@dataclass(frozen=True)
class Qwen3Spec:
    """A tiny Qwen3 (``moe=False``) or Qwen3-MoE decoder; field names the dense oracle's helpers read
    (``forward_logits``, ``megatron_args``, ``transformer_config``) are kept."""

    moe: bool = False
    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int = 96
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int = 24  # head_dim != hidden / heads = 16
    vocab_size: int = 100
    make_vocab_size_divisible_by: int = 16
    tie_embeddings: bool = False
    num_experts: int = 4
    moe_ffn_hidden_size: int = 32
    topk: int = 2
    norm_topk_prob: bool = True
    rotary_base: int = 10000
    norm_epsilon: float = 1e-6
    max_position_embeddings: int = 64
    init_method_std: float = 0.05
    seed: int = 7
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0

    def padded_vocab_size(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    grouped_gemm: bool = False  # GroupedMLP experts (MoE only)

    def __str__(self) -> str:
        return (f"tp{self.tp}pp{self.pp}" + (f"vpp{self.vpp}" if self.vpp else "") + f"ep{self.ep}"
                + ("gg" if self.grouped_gemm else ""))


# ----------------------------------------------------------------------------------------------- HF side


def hf_config_of(spec: Qwen3Spec):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
                  num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
                  num_key_value_heads=spec.num_query_groups, head_dim=spec.kv_channels,
                  max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=spec.norm_epsilon,
                  tie_word_embeddings=spec.tie_embeddings, attention_bias=False,
                  rope_parameters={"rope_type": "default", "rope_theta": float(spec.rotary_base)})
    if not spec.moe:
        return Qwen3Config(**common)
    return Qwen3MoeConfig(**common, num_experts=spec.num_experts, num_experts_per_tok=spec.topk,
                          moe_intermediate_size=spec.moe_ffn_hidden_size, norm_topk_prob=spec.norm_topk_prob,
                          decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0)


def write_hf(spec: Qwen3Spec, path: str, seed: int) -> str:
    """A random transformers checkpoint (norms ~ N(1, 0.1), router ~ N(0, 0.3): decisive routing)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config_of(spec))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, spec.init_method_std)
    model.save_pretrained(path)
    return path


def read_hf(path: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


# ---------------------------------------------------------------------------------------------- megatron


def _gmm(x: torch.Tensor, w: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """``grouped_gemm.ops.gmm``: rows of group g (``batch_sizes[g]`` of them, in order) times ``w[g]``."""
    outs, start = [], 0
    for g, n in enumerate(batch_sizes.tolist()):
        outs.append(x[start:start + n] @ (w[g].t() if trans_b else w[g]))
        start += n
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[-2] if trans_b else w.shape[-1])


def apply_shims() -> None:
    apply_cpu_shims()
    from megatron.core.transformer.moe import grouped_gemm_util as gg
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None
    gg.grouped_gemm_is_available = lambda: True
    gg.assert_grouped_gemm_is_available = lambda: None
    gg.ops = type("GroupedGemmOps", (), {"gmm": staticmethod(_gmm)})


def _moe_fields(spec: Qwen3Spec, layout: Layout) -> dict:
    return dict(num_moe_experts=spec.num_experts, expert_model_parallel_size=layout.ep,
                expert_tensor_parallel_size=layout.tp, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
                moe_router_topk=spec.topk, moe_router_pre_softmax=not spec.norm_topk_prob,
                moe_router_score_function="softmax", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=layout.grouped_gemm)


def args_of(spec: Qwen3Spec, layout: Layout, fmt: str):
    """Megatron-LM's args for the model (Megatron-LM's names: ``num_experts``, ``qk_layernorm``...)."""
    args = megatron_args(spec, layout.tp, layout.pp, layout.vpp, fmt)
    args.qk_layernorm = True
    if spec.moe:
        fields = _moe_fields(spec, layout)
        fields["num_experts"] = fields.pop("num_moe_experts")
        args.__dict__.update(fields, moe_shared_expert_intermediate_size=None, moe_router_topk_scaling_factor=None,
                             moe_router_enable_expert_bias=False, moe_layer_freq=1)
    return args


def build(spec: Qwen3Spec, layout: Layout) -> list:
    """This rank's model chunks (megatron's own init; ``fill_from_hf`` overwrites every weight)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import GroupedMLP

    apply_shims()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    vpp = layout.vpp if layout.vpp and layout.vpp > 1 else None
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                 virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=layout.ep,
                                 expert_tensor_parallel_size=layout.tp)
    extra = dict(qk_layernorm=True, **(_moe_fields(spec, layout) if spec.moe else {}))
    config = transformer_config(spec, layout.tp, layout.pp, vpp, **extra)
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts if spec.moe else None,
                                          moe_grouped_gemm=layout.grouped_gemm, qk_layernorm=True,
                                          normalization="RMSNorm")
    torch.manual_seed(0)
    chunks = []
    for v in range(vpp or 1):
        stage = v if vpp else None
        chunk = GPTModel(config=config, transformer_layer_spec=layer_spec,
                         vocab_size=spec.padded_vocab_size(layout.tp), max_sequence_length=spec.max_position_embeddings,
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                         share_embeddings_and_output_weights=spec.tie_embeddings, position_embedding_type="rope",
                         rotary_base=spec.rotary_base, parallel_output=True, vp_stage=stage).eval()
        for module in chunk.modules():
            if isinstance(module, GroupedMLP):  # its forward asserts bf16; the computation stays fp32
                module.config = copy.copy(module.config)
                module.config.bf16 = True
        chunks.append(chunk)
    return chunks


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Qwen3Spec) -> torch.Tensor:
    """linear_qkv: per query group [its q heads, k, v] (megatron-core's SelfAttention split)."""
    g, d = spec.num_query_groups, spec.kv_channels
    per = spec.num_attention_heads // g
    return torch.cat([q.reshape(g, per * d, -1), k.reshape(g, d, -1), v.reshape(g, d, -1)], dim=1).reshape(
        -1, q.shape[-1])


@torch.no_grad()
def fill_from_hf(chunks: list, hf: dict, spec: Qwen3Spec, layout: Layout, weight1_columns: bool = False) -> None:
    """Every parameter of this rank from the HF tensors ``hf`` (megatron-core's TP conventions:
    column-parallel rows / row-parallel columns in contiguous chunks, gated fc1 ``[gate_r; up_r]``,
    vocab padded with zeros; experts ``ep_rank * E_local + i``; GroupedMLP as the module docstring).
    ``weight1_columns``: a negative control filling GroupedMLP's ``weight1`` as column blocks
    ``[fc1_0.T | fc1_1.T | ...]`` (the plausible misreading of its shape)."""
    from megatron.core import parallel_state as ps

    tp, r, ep_rank = layout.tp, ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    n_local = spec.num_experts // layout.ep
    V, pad = spec.vocab_size, spec.padded_vocab_size(tp)

    def vocab(t):
        return torch.cat([t, t.new_zeros(pad - V, t.shape[1])]).chunk(tp)[r]

    def fc1(gate, up):
        return torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])

    def expert(h, e, part):
        x = f"{h}mlp.experts.{e}."
        if part == 1:
            return fc1(hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"])
        return hf[x + "down_proj.weight"].chunk(tp, dim=1)[r]

    for chunk in chunks:
        for name, param in chunk.named_parameters():
            parts = name.split(".")
            if name == "embedding.word_embeddings.weight":
                value = vocab(hf["model.embed_tokens.weight"])
            elif name == "output_layer.weight":
                value = vocab(hf["model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"])
            elif name == "decoder.final_layernorm.weight":
                value = hf["model.norm.weight"]
            else:
                layer = chunk.decoder.layers[int(parts[2])].layer_number - 1
                h, rest = f"model.layers.{layer}.", ".".join(parts[3:])
                a = h + "self_attn."
                if rest == "self_attention.linear_qkv.weight":
                    value = _qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"],
                                 spec).chunk(tp)[r]
                elif rest == "self_attention.linear_proj.weight":
                    value = hf[a + "o_proj.weight"].chunk(tp, dim=1)[r]
                elif rest in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
                    value = hf[a + rest.split(".")[1][0] + "_norm.weight"]
                elif rest in ("input_layernorm.weight", "pre_mlp_layernorm.weight"):
                    value = hf[h + ("input_layernorm.weight" if rest.startswith("input")
                                    else "post_attention_layernorm.weight")]
                elif rest == "mlp.linear_fc1.weight":
                    value = fc1(hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"])
                elif rest == "mlp.linear_fc2.weight":
                    value = hf[h + "mlp.down_proj.weight"].chunk(tp, dim=1)[r]
                elif rest == "mlp.router.weight":
                    value = hf[h + "mlp.gate.weight"]
                elif rest.startswith("mlp.experts.local_experts."):
                    e = ep_rank * n_local + int(parts[6])
                    value = expert(h, e, int(rest[-len("1.weight")]))
                elif rest in ("mlp.experts.weight1", "mlp.experts.weight2"):
                    part = int(rest[-1])
                    blocks = [expert(h, ep_rank * n_local + i, part).t() for i in range(n_local)]
                    value = torch.stack(blocks).reshape(param.shape)
                    if weight1_columns and part == 1:
                        value = torch.cat(blocks, dim=1)
                else:
                    raise KeyError(f"no HF source for megatron parameter {name}")
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"{name}: HF gives {tuple(value.shape)}, megatron-core holds {tuple(param.shape)}")
            param.copy_(value)


def weight1_columns_logits(hf_dir: str, spec: Qwen3Spec, layout: Layout) -> torch.Tensor:
    """Logits of a GroupedMLP model whose ``weight1`` was filled as column blocks (negative control)."""
    chunks = build(spec, layout)
    fill_from_hf(chunks, read_hf(hf_dir), spec, layout, weight1_columns=True)
    return forward_logits(chunks, spec)


def _rank_dir(layout: Layout) -> str:
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if layout.pp > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if layout.ep > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    return name


def save_from_hf(hf_dir: str, out_dir: str, spec: Qwen3Spec, layout: Layout, fmt: str) -> torch.Tensor:
    """megatron-core model at ``layout`` with ``hf_dir``'s weights, saved as Megatron-LM does in ``fmt``
    ("torch": legacy rank files, one writer per (tp, pp, ep); "torch_dist"); returns its logits."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    chunks = build(spec, layout)
    fill_from_hf(chunks, read_hf(hf_dir), spec, layout)
    logits = forward_logits(chunks, spec)
    state = {"args": args_of(spec, layout, fmt), "checkpoint_version": 3.0, "iteration": ITERATION}
    if dist.get_rank() == 0:
        os.makedirs(iteration_dir(out_dir), exist_ok=True)
    dist.barrier()
    if fmt == "torch":
        for i, chunk in enumerate(chunks):
            state[_chunk_key(i, len(chunks))] = chunk.state_dict_for_save_checkpoint()
        if ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0:
            path = os.path.join(iteration_dir(out_dir), _rank_dir(layout), "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(state, path)
    else:
        for i, chunk in enumerate(chunks):
            state[_chunk_key(i, len(chunks))] = chunk.sharded_state_dict()
        dist_checkpointing.save(state, iteration_dir(out_dir))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    dist.barrier()
    return logits


def load_logits(ckpt_dir: str, spec: Qwen3Spec, layout: Layout, fmt: str) -> torch.Tensor:
    """A fresh model at ``layout`` (megatron's random init) loads ``ckpt_dir`` strictly (legacy:
    ``load_state_dict`` of this rank's file, no key missing or unexpected but ``_extra_state``;
    torch_dist: ``dist_checkpointing.load`` resharding to this layout); returns the logits."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    iteration = read_tracker(ckpt_dir)
    chunks = build(spec, layout)
    if fmt == "torch":
        path = os.path.join(iteration_dir(ckpt_dir, iteration), _rank_dir(layout), "model_optim_rng.pt")
        state = torch.load(path, map_location="cpu", weights_only=False)
        for i, chunk in enumerate(chunks):
            _load_chunk(chunk, state[_chunk_key(i, len(chunks))], f"{path}[{_chunk_key(i, len(chunks))}]")
    else:
        sharded = {_chunk_key(i, len(chunks)): c.sharded_state_dict() for i, c in enumerate(chunks)}
        state, missing, unexpected = dist_checkpointing.load(sharded, iteration_dir(ckpt_dir, iteration),
                                                             strict=StrictHandling.RETURN_ALL)
        unexpected = {k for k in unexpected if "_extra_state" not in k}
        if missing or unexpected:
            raise KeyError(f"{ckpt_dir}: checkpoint keys the model lacks {sorted(missing)}; model keys the "
                           f"checkpoint lacks {sorted(unexpected)}")
        for i, chunk in enumerate(chunks):
            _load_chunk(chunk, state[_chunk_key(i, len(chunks))], ckpt_dir)
    return forward_logits(chunks, spec)


def te_grouped_copy(src, dst) -> dict:
    """A copy of the SequentialMLP legacy checkpoint ``src`` at ``dst`` under Transformer Engine's
    ``TEGroupedMLP`` names (``mlp.experts.linear_fc{1,2}.weight{i}``, each a SequentialMLP shard, and
    the args megatron-core records for it): Transformer Engine is not installed here, so the layout is
    made by renaming. Returns the last rank file's renamed model state (for the caller's checks)."""
    import shutil
    from pathlib import Path

    shutil.copytree(src, dst)
    renamed: dict = {}
    for f in Path(dst).glob("*/mp_rank_*/model_optim_rng.pt"):
        data = torch.load(f, weights_only=False)
        renamed = {}
        for k, v in data["model"].items():
            if ".local_experts." in k:
                head, rest = k.split(".local_experts.")
                i, module, leaf = rest.split(".", 2)
                k = f"{head}.{module}.{leaf}{i}" if leaf == "weight" else f"{head}.{module}.{leaf}"
            renamed[k] = v
        data["model"] = renamed
        data["args"].moe_grouped_gemm, data["args"].transformer_impl = True, "transformer_engine"
        torch.save(data, f)
    return renamed
