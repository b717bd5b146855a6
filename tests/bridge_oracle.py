"""Real Megatron-Bridge as a test oracle, run under ``.venv-bridge`` (tools/setup.sh makes it) by
tests/test_convert_bridge_vl.py and tests/test_convert_bridge_text.py: ``python tests/bridge_oracle.py
JOBS.json RESULT.json``.

Jobs (a JSON list), all run in one process (importing Bridge costs ~12 s):
  {"op": "write", "hf": DIR, "out": DIR}   ``AutoBridge.from_hf_pretrained(hf).to_megatron_provider(
                                           load_weights=True)`` builds the model from the HF weights with
                                           Bridge's own mapping; ``save_megatron_model`` writes its checkpoint.
                                           Result: ``keys``, {checkpoint tensor key: global shape}.
  {"op": "load", "ckpt": DIR, "hf": DIR}   loads ``ckpt`` strictly and compares its state dict bitwise with
                                           the model Bridge builds from ``hf``. A Megatron-Bridge checkpoint
                                           (``iter_*/run_config.yaml``, picked as ``AutoBridge.load_megatron_model``
                                           picks it) goes through Bridge's own loader (``load_model_config`` on
                                           run_config.yaml, ``build_and_load_model``); its provider's fields are
                                           compared with those Bridge derives from ``hf`` (``config_diff``). A
                                           Megatron-LM checkpoint (``latest_checkpointed_iteration.txt`` naming
                                           ``release`` or an iteration; args in common.pt) is loaded into the
                                           model Bridge builds from ``hf`` with the layer spec its args'
                                           ``transformer_impl`` names (Bridge's ``mlm_compat`` rule) by Bridge's
                                           ``_load_model_weights_from_checkpoint`` (``raise_all``: a key missing
                                           on either side fails). Result: provider, spec, compared, mismatched,
                                           missing, unexpected (names).

Megatron-Bridge 0.6.2 / megatron-core 0.19.2 run on CPU here with, in this process only: Python 3.11's
missing ``typing.override``; stub modules for the imports ``megatron.bridge`` (and one megatron-core
Triton kernel file) make of transformer_engine, modelopt, megatron.energon, nvidia_resiliency_ext and
triton (megatron-core's own guarded imports still fail, so it builds its local non-TE layers);
``torch.cuda`` device and RNG calls and ``Tensor.cuda()`` mapped to the CPU; a gloo world of one, or of
TP x PP ranks that tests/bridge_run.py starts (``PMZ_BRIDGE_WORLD``, ``init_world``: every rank runs every job,
rank 0 writes the results of all ranks, ``gathered``); fp32, no fusions, CPU initialisation; MoE with the
allgather token dispatcher and no permute fusion (TE kernels, CUDA streams).

Measured (4 ranks, TP2 x PP2, gloo on CPU): megatron-core builds its tensor-parallel layers and Bridge imports,
saves (one ``__{rank}_0.distcp`` per writing rank, same keys and global shapes as at TP1) and loads with only
``Tensor.cuda()`` added to the shims (megatron-core's ``setup_embeddings_and_output_layer`` moves the embedding
copy of a later stage there before its all-reduce, with tied embeddings or MTP). Bridge's unpadded vocabulary
must divide by TP (``VocabParallelEmbedding``: "101 is not divisible by 2").

Checkpoint names as Bridge writes them on a GPU: Bridge builds Transformer Engine's layer spec there
(``default_layer_spec``). Here the layers are megatron-core's local (non-TE) modules, whose parameters
are named differently in memory but whose checkpoint keys are set by the spec's
``sharded_state_dict_keys_map``: ``te_named_local_spec`` gives the local layers the keys map of
megatron-core's own TE spec, read from ``get_gpt_layer_with_transformer_engine_submodules`` (built
with a stand-in backend whose fused layer-norm linear is a marker class): a norm the TE spec fuses into
the next linear (``input_layernorm`` -> ``self_attention.linear_qkv.layer_norm_weight``, dense layers'
``pre_mlp_layernorm`` -> ``mlp.linear_fc1.layer_norm_weight``) is stored under that name; one the TE
spec keeps as a module of its own (the MoE layers' ``pre_mlp_layernorm``: a MoE layer has no
``linear_fc1``) keeps its name. (megatron-core's local spec would store both norms under the fused
names in every layer, MoE ones included: a checkpoint TE-spec models cannot load.) Each norm the TE spec
builds as a module of its own (``backend.layer_norm()``, TE's ``TENorm``: q/k norms, a MoE layer's
``pre_mlp_layernorm``) is ``_TENorm`` in the local spec too (read from the same spec build), and so is the
block's final norm, which is not in the layer spec: megatron-core's ``TransformerBlock`` takes
``LayerNormImpl``, ``TENorm`` with TE installed. ``_TENorm`` keeps an empty ``_extra_state`` as TE's norms do,
so Bridge's saves here hold ``<norm>._extra_state`` as on a GPU and its loader refuses a checkpoint without
("Missing key in checkpoint state_dict: decoder.layers.pre_mlp_layernorm._extra_state/shard_0_2"). A Megatron-LM
load (``_mlm_load``) of a local-spec checkpoint keeps megatron-core's local norms. Nothing of the project is
imported here.
"""

from __future__ import annotations

import builtins
import json
import os
import sys
import typing
from pathlib import Path

typing.override = getattr(typing, "override", lambda f: f)  # Bridge asks for Python 3.12; this is 3.11
STUB_ROOTS = ("transformer_engine", "modelopt", "megatron.energon", "nvidia_resiliency_ext", "triton")
STUBBED_FOR = ("megatron.bridge", "megatron.core.transformer.moe.ops.paged_stash")


class _Stub(type):
    """A stand-in for a module or class of a package that is not installed: any attribute is another
    stand-in, calling or subclassing one works (what module-level code of Bridge needs)."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)


def _stub(name: str) -> type:
    return _Stub(name, (object,), {"__init__": lambda self, *a, **k: None})


_import = builtins.__import__
_stubs: dict[str, type] = {}


def _guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__") or ""
    if level == 0 and importer.startswith(STUBBED_FOR) and any(name == r or name.startswith(r + ".")
                                                               for r in STUB_ROOTS):
        if fromlist:
            return _stubs.setdefault(name, _stub(name))
        if name.startswith("megatron."):
            return _import("megatron", globals, locals, fromlist, level)
        return _stubs.setdefault(name.split(".")[0], _stub(name))
    return _import(name, globals, locals, fromlist, level)


builtins.__import__ = _guarded_import

import torch  # noqa: E402

torch.cuda.current_device = lambda: "cpu"
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
torch.Tensor.cuda = lambda self, *a, **k: self
WORLD_ENV = "PMZ_BRIDGE_WORLD"  # "RANK,TP,PP,STORE_FILE": one rank of the world tests/bridge_run.py starts
PARALLEL = {"tp": 1, "pp": 1}  # this process's model-parallel sizes (init_world); every provider gets them
FUSIONS = ("gradient_accumulation_fusion", "bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm",
           "bias_dropout_fusion", "apply_rope_fusion", "cross_entropy_loss_fusion", "bf16", "fp16")


class _LayerNormLinear:
    """Marks the fused layer-norm linear (TE's ``TELayerNormColumnParallelLinear``) in ``te_keys_map``."""


class _TENorm(torch.nn.RMSNorm):
    """Stand-in for ``TENorm`` (te.pytorch.RMSNorm): ``weight`` and TE's empty ``_extra_state`` (TE 2.x without
    FP8), built with the arguments megatron-core passes a norm (config, hidden_size, eps). It stands wherever
    megatron-core's TE spec puts its ``backend.layer_norm()`` (``te_spec_submodules``: q/k norms, a MoE layer's
    ``pre_mlp_layernorm``) and as the block's final norm (``_final_norm``)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(f"stand-in TENorm: plain RMSNorm only, not {config.normalization}")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        return None


def te_spec_submodules(config):
    """megatron-core's Transformer-Engine GPT layer submodules for ``config``
    (``get_gpt_layer_with_transformer_engine_submodules``, as Bridge's ``transformer_engine_layer_spec`` calls
    it), built with a local backend whose fused layer-norm linear is ``_LayerNormLinear`` and whose
    ``layer_norm()`` (TE's ``TENorm``) is ``_TENorm``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import gpt_layer_specs as specs

    class FusedNormBackend(LocalSpecProvider):
        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self) -> type:
            return _LayerNormLinear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> type:
            return _TENorm

    saved, specs.TESpecProvider = specs.TESpecProvider, FusedNormBackend
    try:
        return specs.get_gpt_layer_with_transformer_engine_submodules(
            num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm)
    finally:
        specs.TESpecProvider = saved


def te_keys_map(sub) -> dict[str, str]:
    """The checkpoint keys map of the TE spec's layer ``sub`` (``te_spec_submodules``): a norm the spec leaves
    out (IdentityOp) because the next linear is the fused module is stored under the linear's ``layer_norm_``
    names."""
    from megatron.core.transformer.identity_op import IdentityOp

    keys = {}
    if sub.input_layernorm is IdentityOp and sub.self_attention.submodules.linear_qkv is _LayerNormLinear:
        keys["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
    mlp = getattr(sub.mlp, "keywords", {}).get("submodules")
    if sub.pre_mlp_layernorm is IdentityOp and getattr(mlp, "linear_fc1", None) is _LayerNormLinear:
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return keys


def te_named_local_spec(config):
    """megatron-core's local GPT layer (what runs on CPU) saving and loading under the TE spec's keys, with
    ``_TENorm`` (an ``_extra_state`` of its own) in each norm slot where the TE spec builds TENorm (q/k norms,
    a MoE layer's ``pre_mlp_layernorm``)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    te = te_spec_submodules(config)
    spec = local_layer_spec(config)
    spec.submodules.sharded_state_dict_keys_map = te_keys_map(te)
    for sub_te, sub_local in ((te, spec.submodules),
                              (te.self_attention.submodules, spec.submodules.self_attention.submodules)):
        for slot in ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm"):
            if getattr(sub_te, slot, None) is _TENorm:
                setattr(sub_local, slot, _TENorm)
    return spec


def _final_norm(te: bool) -> None:
    """The norm megatron-core's ``TransformerBlock`` builds after the last layer of a model from a layer spec
    (``transformer_block.LayerNormImpl``, read when a block is built): ``TENorm`` with TE installed (what
    Bridge's providers build on a GPU; an ``_extra_state`` of its own, ``decoder.final_layernorm._extra_state/
    shard_0_1``), megatron-core's torch norm without (the local spec)."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    transformer_block.LayerNormImpl = _TENorm if te else WrappedTorchNorm


def _cpu(provider, spec=None) -> None:
    """The provider on CPU: local (non-TE) layers under the TE spec's checkpoint keys and the block's final norm
    as TE's (``spec``: another layer spec; megatron-core's local final norm unless it is ``te_named_local_spec``),
    fp32, no fusions."""
    _final_norm(spec in (None, te_named_local_spec))
    provider.transformer_layer_spec = spec or te_named_local_spec
    for name in FUSIONS:
        if hasattr(provider, name):
            setattr(provider, name, False)
    provider.params_dtype = provider.pipeline_dtype = torch.float32
    provider.use_cpu_initialization = True
    provider.perform_initialization = False
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = PARALLEL["tp"], PARALLEL["pp"]
    provider.context_parallel_size = 1
    provider.virtual_pipeline_model_parallel_size = None
    provider.sequence_parallel = False
    if getattr(provider, "num_moe_experts", None):  # MoE: no TE permutation kernels, no CUDA streams
        provider.moe_permute_fusion = False
        provider.moe_token_dispatcher_type = "allgather"


def _from_hf(hf: str, with_provider: bool = False):
    """(bridge, the model Bridge imports from ``hf``[, its provider])."""
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(hf, torch_dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    _cpu(provider)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    return (bridge, model, provider) if with_provider else (bridge, model)


def _weights(model) -> dict[str, torch.Tensor]:
    module = model[0] if isinstance(model, list) else model
    return {k: v for k, v in module.state_dict().items() if "_extra_state" not in k}


def _checkpoint_keys(it_dir: str) -> dict[str, list[int]]:
    """{key: global shape} of every tensor of a torch_dist folder (its ``.metadata``)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(it_dir).read_metadata()
    return {k: list(v.size) for k, v in sorted(meta.state_dict_metadata.items()) if hasattr(v, "size")}


def _same(a, b) -> bool:
    try:
        if bool(a == b):
            return True
    except Exception:  # tensors, objects without a usable __eq__
        pass
    return repr(a) == repr(b)  # functools.partial of the same function and arguments


def _config_diff(loaded, reference) -> dict[str, list[str]]:
    """{field: [loaded, reference] reprs} of the public provider fields that differ (both already on CPU;
    private fields hold runtime objects such as process groups)."""
    import dataclasses

    return {f.name: [repr(getattr(loaded, f.name, None)), repr(getattr(reference, f.name, None))]
            for f in dataclasses.fields(reference) if not f.name.startswith("_")
            and not _same(getattr(loaded, f.name, None), getattr(reference, f.name, None))}


def _bridge_load(it_dir: str, reference) -> tuple[dict, dict]:
    """Bridge's own loader on a Bridge checkpoint folder: (result fields, loaded weights); the provider's
    fields against ``reference``'s (the one Bridge derives from the HF directory)."""
    from megatron.bridge.training.model_load_save import build_and_load_model, load_model_config

    cfg, _ = load_model_config(it_dir)
    provider_class = f"{type(cfg).__module__}.{type(cfg).__name__}"
    _cpu(cfg)
    loaded = _weights(build_and_load_model(it_dir, cfg, use_cpu_init=True, skip_temp_dist_context=True))
    return {"provider": provider_class, "spec": "te", "config_diff": _config_diff(cfg, reference)}, loaded


def _mlm_load(root: str, bridge) -> tuple[dict, dict]:
    """A Megatron-LM checkpoint (tracker, ``release/`` or ``iter_N/``, args in common.pt) into a model of
    ``bridge``'s provider (from the HF config, no HF weights) built with the spec its args name, by Bridge's
    weight loader, strict."""
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.bridge.training.checkpointing import _load_model_weights_from_checkpoint
    from megatron.bridge.training.mlm_compat.arguments import _load_args_from_checkpoint

    tracker = (Path(root) / "latest_checkpointed_iteration.txt").read_text().strip()
    it_dir = str(Path(root) / ("release" if tracker == "release" else f"iter_{int(tracker):07d}"))
    impl = _load_args_from_checkpoint(it_dir).transformer_impl
    provider = bridge.to_megatron_provider(load_weights=False)
    _cpu(provider, te_named_local_spec if impl == "transformer_engine" else local_layer_spec)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    _load_model_weights_from_checkpoint(it_dir, model, dist_ckpt_strictness="raise_all")
    return {"provider": "args", "spec": "te" if impl == "transformer_engine" else "local"}, _weights(model)


def _load(ckpt: str, hf: str) -> dict:
    iters = sorted(p for p in Path(ckpt).iterdir() if p.is_dir() and p.name.startswith("iter_"))
    it_dir = str(iters[-1]) if iters else ckpt  # as AutoBridge.load_megatron_model picks it
    bridge, reference, provider = _from_hf(hf, with_provider=True)
    if (Path(it_dir) / "run_config.yaml").is_file():
        out, loaded = _bridge_load(it_dir, provider)
    else:
        out, loaded = _mlm_load(ckpt, bridge)
    expected = _weights(reference)
    mismatched = sorted(k for k in expected if k in loaded and not (
        loaded[k].shape == expected[k].shape and torch.equal(loaded[k], expected[k])))
    return {**out, "compared": len(expected), "mismatched": mismatched,
            "missing": sorted(set(expected) - set(loaded)), "unexpected": sorted(set(loaded) - set(expected))}


def init_world() -> int:
    """The gloo world and megatron-core's model-parallel groups; returns this rank. One rank: an in-process store
    (no port to pick: one derived from the pid could be taken). ``PMZ_BRIDGE_WORLD`` = "RANK,TP,PP,FILE": rank
    RANK of TP x PP ranks meeting in a FileStore at FILE (tests/bridge_run.py starts them all)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if os.environ.get(WORLD_ENV):
        rank, tp, pp, store = os.environ[WORLD_ENV].split(",", 3)
        PARALLEL.update(tp=int(tp), pp=int(pp))
        world = PARALLEL["tp"] * PARALLEL["pp"]
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=int(rank), world_size=world)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(PARALLEL["tp"], PARALLEL["pp"])
    return dist.get_rank()


LOAD_LISTS = ("mismatched", "missing", "unexpected")


def gathered(results: list[dict]) -> list[dict]:
    """Every rank's results of the same jobs as one list (rank 0 gets it; a no-op on one rank): a ``load``
    result holds each rank's ``mismatched`` / ``missing`` / ``unexpected`` names as "rank R: name", ``compared``
    summed and ``compared_per_rank``; anything else is rank 0's (checkpoint keys and provider fields are the same
    on every rank)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return results
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    merged = []
    for per_rank in zip(*everyone):
        out = dict(per_rank[0])
        if "compared" in out:
            out["compared_per_rank"] = [r["compared"] for r in per_rank]
            out["compared"] = sum(out["compared_per_rank"])
            out.update({f: [f"rank {i}: {k}" for i, r in enumerate(per_rank) for k in r[f]] for f in LOAD_LISTS})
        merged.append(out)
    return merged


def finish(result_path: str, out: dict) -> None:
    """Rank 0 writes ``out`` (its ``results`` gathered from every rank); then the world is torn down."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    out["results"] = gathered(out["results"])
    out["parallel"] = dict(PARALLEL)
    if dist.get_rank() == 0:
        with open(result_path, "w") as f:
            json.dump(out, f)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main(jobs_path: str, result_path: str) -> None:
    init_world()
    import megatron.bridge

    results = []
    for job in json.loads(open(jobs_path).read()):
        if job["op"] == "write":
            bridge, model = _from_hf(job["hf"])
            bridge.save_megatron_model(model, job["out"])
            it_dir = max(p for p in Path(job["out"]).iterdir() if p.name.startswith("iter_"))
            results.append({"op": "write", "out": job["out"], "keys": _checkpoint_keys(str(it_dir))})
        else:
            results.append({"op": "load", **_load(job["ckpt"], job["hf"])})
    from importlib.metadata import version

    finish(result_path, {"versions": {p: version(p) for p in ("megatron-bridge", "megatron-core", "transformers",
                                                              "torch")},
                         "bridge_file": megatron.bridge.__file__, "results": results})


if __name__ == "__main__":  # the checkpoint writer starts worker processes that import this file
    main(sys.argv[1], sys.argv[2])
