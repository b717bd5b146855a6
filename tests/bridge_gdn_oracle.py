"""Real Megatron-Bridge as a test oracle for the Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next),
run under ``.venv-bridge``: ``python tests/bridge_gdn_oracle.py JOBS.json RESULT.json``, one process for a
list of jobs (importing Bridge costs ~12 s quiet; a model build or load ~0.3-1 s; built and loaded models
are reused by later jobs), or the TP x PP ranks tests/bridge_run.py starts (bridge_oracle.init_world: every rank
runs every job). Nothing of the project is imported here. Result: ``versions``, per job its ``op``, ``seconds``:
  {"op": "write", "hf": DIR, "out": DIR}    ``AutoBridge.from_hf_pretrained(hf).to_megatron_provider(
                                            load_weights=True)`` (Bridge's own mapping; MTP built and imported
                                            when config.json has ``mtp_num_hidden_layers`` and the weights
                                            ``mtp.*``; ``"mtp": false`` builds without), ``save_megatron_model``.
                                            -> ``keys`` {checkpoint key: global shape | "object"}, ``run_config``.
  {"op": "load", "ckpt": DIR, "hf": DIR}    the checkpoint's model vs the model Bridge builds from ``hf``,
                                            bitwise -> ``loader``, ``compared``, ``mismatched``, ``missing``,
                                            ``unexpected``. With run_config.yaml: Bridge's loader
                                            (``load_model_config``, ``build_and_load_model``) and
                                            ``config_diff`` {public provider field: [loaded, derived from
                                            ``hf``] reprs} where they differ (both on CPU); without (or
                                            ``"via": "dist_checkpointing"``): the model built from ``hf``'s
                                            config, megatron-core ``dist_checkpointing.load(strict=RAISE_ALL)``
                                            (a missing or unexpected key raises) and ``load_state_dict(strict)``.
  {"op": "logits", "ckpt": DIR | none, "hf": DIR, "ids": [[...]]}  fp32 logits [batch, seq, HF vocab] of the
                                            checkpoint's model (else ``hf``'s), causal, no padding.
  {"op": "export", "ckpt": DIR, "hf": DIR, "out": DIR}
                                            Bridge's megatron->HF export of the checkpoint's model
                                            (``save_hf_weights``: ``save_hf_pretrained`` without its tokenizer
                                            copy, which these tiny directories lack) plus ``hf``'s config.

On CPU, in this process only: Bridge's ``transformer_layer_spec`` for these models,
``get_transformer_block_with_experimental_attention_variant_spec``, asserts ``transformer_impl ==
"transformer_engine"`` and takes every module from ``TESpecProvider``; megatron-core's spec modules get
``_TorchTESpecProvider`` instead, whose modules are torch stand-ins with TE's parameter names and state:
``TELayerNormColumnParallelLinear`` -> ``layer_norm_weight`` + ``weight`` (RMSNorm, ``x * (1 + w)`` when
``layernorm_zero_centered_gamma``), ``TENorm`` -> ``weight`` (same rule), TE (grouped) linears -> ``weight``
(``weight0..weight{E-1}``, experts as TE's ``TEGroupedMLP`` with ``moe_grouped_gemm``); each has
``_extra_state`` = empty uint8 tensor (TE 2.x without FP8, its op-based norms too); core attention is
megatron's local one (TE's ``TEDotProductAttention`` writes nothing to checkpoints either). GDN:
``HAVE_FLA`` set, FLA's ``chunk_gated_delta_rule`` -> megatron-core's ``torch_chunk_gated_delta_rule``,
``causal_conv1d`` / ``l2norm`` -> torch; ``torch.compile`` (megatron's ``jit_fuser``) off; the causal mask
and RNG fork off CUDA; MoE with the allgather dispatcher, no permute/router fusion (these runtime fields,
fp32 and the run's TP/PP show in run_config.yaml). Logits (one rank only) equal transformers' (fp32) to <= 5e-6.

Facts (megatron-bridge 0.6.2, megatron-core 0.19.2, transformers 5.12.1; tests/test_bridge_gdn_oracle.py
checks the layout against the HF tensors; L = layer, every key per layer, none stacked):
  * Files: ``latest_checkpointed_iteration.txt``, ``latest_train_state.pt``, ``iter_0000000/{.metadata,
    __0_0.distcp, metadata.json, run_config.yaml, train_state.pt}``; non-tensor items ``common_state`` and
    ``<module>._extra_state/shard_0_1`` for every TE module (linears, norms incl. q/k_layernorm,
    out_norm, final_layernorm, MTP's enorm/hnorm/eh_proj/final_layernorm), experts
    ``experts.experts.linear_fc{1,2}._extra_state/shard_{e}_{E}``; no ``core_attention`` keys.
  * Embedding ``embedding.word_embeddings.weight`` [vocab, H] (not padded: ``should_pad_vocab`` false,
    ``make_vocab_size_divisible_by`` 1), ``output_layer.weight`` only when untied,
    ``decoder.final_layernorm.weight`` [H] = HF ``model.norm`` (both zero-centred, no shift).
  * GDN layer ``decoder.layers.L.self_attention.``: ``in_proj.layer_norm_weight`` [H] = input_layernorm;
    ``in_proj.weight.{query,key}`` [Hk*dk, H], ``.{value,z}`` [Hv*dv, H], ``.{beta,alpha}`` [Hv, H] (every head
    of a part together; Qwen3-Next's per-key-head-group interleaved in_proj_qkvz/ba de-interleaved);
    ``conv1d.weight.{query,key}`` [Hk*dk, 1, K], ``.value`` [Hv*dv, 1, K]; ``A_log``, ``dt_bias`` [Hv];
    ``out_norm.weight`` [dv] = HF ``linear_attn.norm.weight - 1`` (zero-centred; HF's is not);
    ``out_proj.weight`` [H, Hv*dv].
  * Full-attention layer: ``self_attention.linear_qkv.layer_norm_weight`` [H]; ``linear_qkv.weight``
    [(2*nh + 2*ng)*hd, H] per KV group g: the queries of its nh/ng heads, then their output gates (HF
    q_proj is per head [query, gate]), then k_g, v_g; ``q_layernorm``/``k_layernorm`` [hd];
    ``linear_proj.weight`` [H, nh*hd]. No separate input_layernorm anywhere (fused in every layer).
  * Dense MLP (Qwen3.5): ``mlp.linear_fc1.layer_norm_weight`` [H] = post_attention_layernorm,
    ``mlp.linear_fc1.weight`` [2F, H] = [gate; up], ``mlp.linear_fc2.weight`` [H, F].
  * MoE (Qwen3.5-MoE, Qwen3-Next; every layer: Bridge sets no ``moe_layer_freq`` and ignores Qwen3-Next's
    ``mlp_only_layers`` / ``decoder_sparse_step``: it builds MoE there, warns "Can't find ... in hf_keys",
    leaves it at its initial values and still writes the checkpoint): ``pre_mlp_layernorm.weight`` [H],
    ``mlp.router.weight`` [E, H], ``mlp.experts.experts.linear_fc1.weight`` [E, 2F, H] ([gate; up] per
    expert), ``...linear_fc2.weight`` [E, H, F], ``mlp.shared_experts.linear_fc1.weight`` [2S, H],
    ``.linear_fc2.weight`` [H, S], ``mlp.shared_experts.gate_weight`` [1, H].
  * MTP (``mtp_num_hidden_layers`` -> ``mtp_num_layers``; imported, export gives ``mtp.*`` back bitwise):
    ``mtp.layers.0.{eh_proj.weight [H, 2H] = mtp.fc, enorm = pre_fc_norm_embedding, hnorm =
    pre_fc_norm_hidden, final_layernorm = mtp.norm}`` and the layer under
    ``mtp.layers.0.transformer_layer.*`` (in memory ``mtp_model_layer``) with the decoder layer's keys.
    megatron-core builds the MTP layer from the LAST decoder layer's spec: a model whose last layer is
    linear attention cannot be built with MTP (AssertionError on the attention mask type).
  * run_config.yaml: ``model._target_: megatron.bridge.models.gpt_provider.GPTModelProvider`` (no
    Qwen-specific provider), ``transformer_layer_spec._target_: ...get_transformer_block_with_experimental_
    attention_variant_spec``, ``experimental_attention_variant: gated_delta_net``, ``linear_attention_freq``
    as the list of layer kinds (1 = GDN, 0 = attention), ``linear_{conv_kernel_dim,key_head_dim,
    value_head_dim,num_key_heads,num_value_heads}``, ``layernorm_zero_centered_gamma: true``,
    ``attention_output_gate: true``, ``rotary_percent``, ``kv_channels``, ``hetereogenous_dist_checkpoint:
    true``, ``mtp_num_layers``, MoE fields (``moe_grouped_gemm: true``, ``moe_shared_expert_gate: true``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

_T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron's jit_fuser is torch.compile: eager here

import bridge_oracle  # noqa: E402  (its import guard, CUDA->CPU shims and stubs come first)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _extra_state(self) -> torch.Tensor:
    """What Transformer Engine 2.x modules return without FP8 state."""
    return torch.empty(0, dtype=torch.uint8)


def _ignore_extra_state(self, state) -> None:
    return None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """TE's RMSNorm in fp32: ``x / rms(x) * (1 + w)`` when zero-centred, else ``* w``."""
    dtype = x.dtype
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + 1 if zero_centered else weight.float()
    return (y * w).to(dtype)


class _TENorm(torch.nn.Module):
    """Stand-in for ``TENorm`` (te.pytorch.RMSNorm): parameter ``weight``, TE's ``_extra_state``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, has_residual: bool = False, **_):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"stand-in TENorm does RMSNorm only, not {config.normalization}")
        self.eps, self.zero_centered = eps, bool(config.layernorm_zero_centered_gamma)
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))

    def forward(self, x):
        return _rms(x, self.weight, self.eps, self.zero_centered)

    get_extra_state, set_extra_state = _extra_state, _ignore_extra_state


def _te_linears():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    class TEColumnParallelLinear(ColumnParallelLinear):
        """Stand-in for TE's column-parallel linear: ``weight`` (+ ``bias``) and TE's ``_extra_state``."""

        get_extra_state, set_extra_state = _extra_state, _ignore_extra_state

    class TERowParallelLinear(RowParallelLinear):
        """Stand-in for TE's row-parallel linear: ``weight`` (+ ``bias``) and TE's ``_extra_state``."""

        get_extra_state, set_extra_state = _extra_state, _ignore_extra_state

    class TELayerNormColumnParallelLinear(TEColumnParallelLinear):
        """Stand-in for TE's ``LayerNormLinear``: the input RMSNorm fused in as ``layer_norm_weight``
        (zero-centred by the config), then the column-parallel ``weight``."""

        def __init__(self, input_size, output_size, *, config, **kwargs):
            kwargs.pop("skip_weight_param_allocation", None)
            super().__init__(input_size, output_size, config=config, **kwargs)
            if config.normalization != "RMSNorm":
                raise ValueError(f"stand-in LayerNormLinear does RMSNorm only, not {config.normalization}")
            self.zero_centered = bool(config.layernorm_zero_centered_gamma)
            self.eps = config.layernorm_epsilon
            init = torch.zeros if self.zero_centered else torch.ones
            self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=config.params_dtype))

        def forward(self, x, *args, **kwargs):
            return super().forward(_rms(x, self.layer_norm_weight, self.eps, self.zero_centered), *args, **kwargs)

    return TEColumnParallelLinear, TERowParallelLinear, TELayerNormColumnParallelLinear


def _te_grouped_linears():
    """Stand-ins for TE's ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``: parameters
    ``weight0 .. weight{E-1}`` as TE's ``GroupedLinear`` holds them (this expert-TP rank's rows / columns), one
    ``_extra_state``; in the checkpoint each expert's weight is a slice of the global
    ``experts.linear_fc{1,2}.weight`` [E, out, in] and its ``_extra_state`` one shard of
    ``experts.linear_fc{1,2}._extra_state`` (the keys megatron-core's TE wrapper makes). No forward over
    expert-TP ranks (``logits`` runs on one rank)."""
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    class _Grouped(torch.nn.Module):
        tp_axis = 0

        def __init__(self, num_gemms, input_size, output_size, *, config, bias, skip_bias_add=False,
                     pg_collection=None, **_):
            super().__init__()
            if bias:
                raise ValueError("grouped-linear stand-in: no biases (Qwen experts have none)")
            self.num_gemms, self.config, self.pg_collection = num_gemms, config, pg_collection
            self.tp_group = getattr(pg_collection, "expt_tp", None)
            etp = self.tp_group.size() if self.tp_group is not None else 1
            output_size, input_size = (output_size // etp, input_size) if self.tp_axis == 0 else \
                (output_size, input_size // etp)
            for i in range(num_gemms):
                self.register_parameter(f"weight{i}", torch.nn.Parameter(
                    torch.empty(output_size, input_size, dtype=config.params_dtype)))

        def forward(self, x, m_splits):
            parts = torch.split(x, list(m_splits))
            return torch.cat([p @ getattr(self, f"weight{i}").t() for i, p in enumerate(parts)]), None

        get_extra_state, set_extra_state = _extra_state, _ignore_extra_state

        def backward_dw(self):
            return None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            ep = self.pg_collection.ep if self.pg_collection is not None else None
            first = (ep.rank() if ep is not None else 0) * self.num_gemms
            total = (ep.size() if ep is not None else 1) * self.num_gemms
            out = {}
            for i in range(self.num_gemms):
                sub = make_sharded_tensors_for_checkpoint(
                    {f"{i}.weight": getattr(self, f"weight{i}"), f"{i}._extra_state": self.get_extra_state()}, "",
                    {f"{i}.weight": self.tp_axis}, (*sharded_offsets, (len(sharded_offsets), first + i, total)),
                    tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
                replace_prefix_for_sharding(sub, f"{i}.", prefix)
                out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
                out[f"{prefix}_extra_state{i or ''}"] = sub[f"{i}._extra_state"]
            return out

    class TEColumnParallelGroupedLinear(_Grouped):
        tp_axis = 0

    class TERowParallelGroupedLinear(_Grouped):
        tp_axis = 1

    return TEColumnParallelGroupedLinear, TERowParallelGroupedLinear


def _spec_provider():
    """A ``BackendSpecProvider`` answering as ``TESpecProvider`` does, with the stand-ins."""
    from functools import partial

    from megatron.core.models.backends import BackendSpecProvider
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, SequentialMLP, TEGroupedMLP

    column, row, ln_column = _te_linears()
    grouped_column, grouped_row = _te_grouped_linears()

    class _TorchTESpecProvider(BackendSpecProvider):
        def linear(self):
            return column

        def column_parallel_linear(self):
            return column

        def row_parallel_linear(self):
            return row

        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return ln_column

        def layer_norm(self, rms_norm=False, for_qk=False, has_residual=False):
            return _TENorm

        def core_attention(self):
            return DotProductAttention

        def grouped_mlp_modules(self, moe_use_grouped_gemm):
            if moe_use_grouped_gemm:  # as TESpecProvider: TE's grouped experts
                return partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
                    linear_fc1=grouped_column, linear_fc2=grouped_row, activation_func=None))
            return partial(SequentialMLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row))

        def activation_func(self):
            return None

    return _TorchTESpecProvider


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2norm: ``x / sqrt(sum(x^2) + eps)``, in fp32."""
    return (x.float() * torch.rsqrt(x.float().pow(2).sum(dim, keepdim=True) + eps)).to(x.dtype)


def _conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, **_):
    """FLA's ``causal_conv1d`` on ``x`` [b, s, d] with a depthwise ``weight`` [d, w], in torch."""
    if initial_state is not None or output_final_state or cu_seqlens is not None:
        raise NotImplementedError("torch causal_conv1d stand-in: no states, no packed sequences")
    seq = x.shape[1]
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=weight.shape[1] - 1,
                 groups=weight.shape[0])[..., :seq]
    if activation in ("silu", "swish"):
        y = F.silu(y)
    return y.transpose(1, 2), None


def _install() -> None:
    """Point megatron-core's TE spec provider and FLA kernels at the stand-ins (this process only)."""
    import torch._dynamo

    torch._dynamo.config.disable = True
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as ea
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.ssm.gated_delta_net import common, gdn
    from megatron.core.transformer import utils

    provider = _spec_provider()
    ea._get_backend_spec_provider = lambda config: provider()
    gpt_layer_specs.TESpecProvider = provider
    common.HAVE_FLA = True
    common.l2norm = _l2norm
    gdn.chunk_gated_delta_rule = common.torch_chunk_gated_delta_rule
    gdn.causal_conv1d = _conv1d
    utils.get_default_causal_mask = fused_softmax.get_default_causal_mask = _causal_mask
    from contextlib import nullcontext

    from megatron.core.tensor_parallel import random

    random.CudaRNGStatesTracker.fork = lambda self, name=None: nullcontext()  # no dropout in these runs


def _causal_mask(sq: int) -> torch.Tensor:
    """megatron-core's default causal mask (True above the diagonal), on the CPU instead of "cuda"."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu(provider) -> None:
    """Bridge's provider on CPU, one rank, fp32, keeping its hybrid block spec (built from the stand-ins)."""
    spec = provider.transformer_layer_spec
    bridge_oracle._cpu(provider)
    provider.transformer_layer_spec = spec
    for name, value in (("moe_token_dispatcher_type", "allgather"), ("moe_permute_fusion", False),
                        ("moe_router_fusion", False), ("fused_residual_rmsnorm", False)):
        if hasattr(provider, name):
            setattr(provider, name, value)


_BUILT: dict[tuple, object] = {}  # models built or loaded in this process, reused by later jobs
_PROVIDERS: dict[tuple, object] = {}  # the provider each model of _BUILT came from


def _provider(hf: str, mtp: bool, load_weights: bool):
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(hf, torch_dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    if not mtp:
        provider.mtp_num_layers = None
    _cpu(provider)
    provider.finalize()
    return bridge, provider


def _from_hf(hf: str, mtp: bool = True):
    """(bridge, model) Bridge builds from the HF weights in ``hf`` (once per process)."""
    key = ("hf", hf, mtp)
    if key not in _BUILT:
        bridge, provider = _provider(hf, mtp, load_weights=True)
        _BUILT[key] = bridge, provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
        _PROVIDERS[key] = provider
    return _BUILT[key]


def _module(model):  # the model chunk (no virtual pipeline here)
    return model[0] if isinstance(model, list) else model


def _checkpoint_keys(ckpt: str) -> dict[str, list[int]]:
    """{key: global shape} of every tensor in a torch_dist checkpoint (its ``.metadata``), plus
    ``key: "object"`` for non-tensor entries (``_extra_state``, common state)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(_iteration_dir(ckpt)).read_metadata()
    return {k: (list(v.size) if hasattr(v, "size") else "object") for k, v in sorted(meta.state_dict_metadata.items())}


def _iteration_dir(ckpt: str) -> str:
    iters = sorted(p for p in Path(ckpt).iterdir() if p.is_dir() and p.name.startswith("iter_"))
    return str(iters[-1]) if iters else ckpt  # as AutoBridge.load_megatron_model picks it


def _via(job: dict) -> str:
    """``bridge`` (run_config.yaml, Bridge's loader) when the checkpoint has run_config.yaml, else
    ``dist_checkpointing``; a job may ask for ``"via": "dist_checkpointing"`` on a Bridge checkpoint."""
    has_config = (Path(_iteration_dir(job["ckpt"])) / "run_config.yaml").exists()
    via = job.get("via", "bridge" if has_config else "dist_checkpointing")
    if via == "bridge" and not has_config:
        raise FileNotFoundError(f"{job['ckpt']}: no run_config.yaml for Bridge's loader")
    return via


def _load_model(job: dict):
    """(loader, model) for ``job["ckpt"]`` (once per process and loader): Bridge's own loader
    (``load_model_config`` on run_config.yaml, ``build_and_load_model``), or the model Bridge builds from
    ``job["hf"]``'s config loaded with megatron-core's ``dist_checkpointing.load`` (strict: any missing or
    unexpected checkpoint key raises) and ``load_state_dict(strict=True)``."""
    via, mtp = _via(job), job.get("mtp", True)
    key = ("ckpt", job["ckpt"], via, mtp)
    if key in _BUILT:
        return _BUILT[key]
    it_dir = _iteration_dir(job["ckpt"])
    if via == "bridge":
        from megatron.bridge.training.model_load_save import build_and_load_model, load_model_config

        cfg, _ = load_model_config(it_dir)
        _cpu(cfg)
        model = build_and_load_model(it_dir, cfg, use_cpu_init=True, skip_temp_dist_context=True)
        _BUILT[key] = f"{type(cfg).__module__}.{type(cfg).__name__}", model
        _PROVIDERS[key] = cfg
        return _BUILT[key]
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    model = _provider(job["hf"], mtp, load_weights=False)[1].provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True)
    module = _module(model)
    state = dist_checkpointing.load(module.sharded_state_dict(), it_dir, strict=StrictHandling.RAISE_ALL)
    own = module.state_dict()  # the checkpoint's common state (iteration, ...) is not the model's
    module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=True)
    _BUILT[key] = "megatron.core.dist_checkpointing.load", model
    return _BUILT[key]


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _module(model).state_dict().items() if "_extra_state" not in k}


def _load(job: dict) -> dict:
    loader, model = _load_model(job)
    loaded = _weights(model)
    mtp = job.get("mtp", True)
    expected = _weights(_from_hf(job["hf"], mtp)[1])
    mismatched = sorted(k for k in expected if k in loaded and not (
        loaded[k].shape == expected[k].shape and torch.equal(loaded[k], expected[k])))
    out = {"loader": loader, "compared": len(expected), "mismatched": mismatched,
           "missing": sorted(set(expected) - set(loaded)), "unexpected": sorted(set(loaded) - set(expected))}
    if _via(job) == "bridge":  # the provider run_config.yaml made against the one Bridge derives from ``hf``
        out["config_diff"] = bridge_oracle._config_diff(_PROVIDERS[("ckpt", job["ckpt"], "bridge", mtp)],
                                                        _PROVIDERS[("hf", job["hf"], mtp)])
    return out


def _logits(job: dict) -> dict:
    """fp32 logits of the model in ``ckpt`` (else the one built from ``hf``) for ``ids`` (causal, positions
    0..s-1 in every row, no padding), trimmed to the HF vocab."""
    from transformers import AutoConfig

    if bridge_oracle.PARALLEL != {"tp": 1, "pp": 1}:
        raise ValueError(f"logits: one rank only (this run: {bridge_oracle.PARALLEL})")
    model = _load_model(job)[1] if "ckpt" in job else _from_hf(job["hf"], job.get("mtp", True))[1]
    module = _module(model).eval()
    ids = torch.tensor(job["ids"], dtype=torch.long)
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        out = module(input_ids=ids, position_ids=positions, attention_mask=None)
    vocab = AutoConfig.from_pretrained(job["hf"]).vocab_size
    return {"logits": out[..., :vocab].float().tolist()}


def _write(job: dict) -> dict:
    bridge, model = _from_hf(job["hf"], job.get("mtp", True))
    bridge.save_megatron_model(model, job["out"])
    run_config = Path(_iteration_dir(job["out"])) / "run_config.yaml"
    return {"out": job["out"], "keys": _checkpoint_keys(job["out"]), "run_config": run_config.read_text()}


def _export(job: dict) -> dict:
    """Bridge's megatron->HF weight export (``save_hf_weights``, the weight half of ``save_hf_pretrained``,
    whose other half copies the tokenizer these tiny checkpoints lack) plus the HF config."""
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(job["hf"], torch_dtype=torch.float32)
    model = _load_model(job)[1]
    Path(job["out"]).mkdir(parents=True, exist_ok=True)
    bridge.hf_pretrained.config.save_pretrained(job["out"])
    bridge.save_hf_weights(model if isinstance(model, list) else [model], job["out"], show_progress=False)
    return {"out": job["out"]}


OPS = {"write": _write, "load": _load, "logits": _logits, "export": _export}


def main(jobs_path: str, result_path: str) -> None:
    bridge_oracle.init_world()  # one rank, or one of the TP x PP ranks tests/bridge_run.py starts
    import megatron.bridge

    _install()
    imported = time.perf_counter()
    results = []
    for job in json.loads(Path(jobs_path).read_text()):
        start = time.perf_counter()
        results.append({"op": job["op"], **OPS[job["op"]](job), "seconds": round(time.perf_counter() - start, 2)})
    from importlib.metadata import version

    packages = ("megatron-bridge", "megatron-core", "transformers", "torch")
    bridge_oracle.finish(result_path, {"import_seconds": round(imported - _T0, 2), "results": results,
                                       "versions": {p: version(p) for p in packages},
                                       "bridge_file": megatron.bridge.__file__})


if __name__ == "__main__":  # the checkpoint writer starts worker processes that import this file
    main(sys.argv[1], sys.argv[2])
