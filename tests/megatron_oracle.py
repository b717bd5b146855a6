"""Real megatron-core on CPU as a test oracle for the Megatron <-> HF converters.

Run inside processes spawned by ``tests/distributed.py`` (gloo initialized): the workers here build
megatron-core ``GPTModel`` chunks at a TP/PP/VPP layout, write Megatron-LM checkpoints in the legacy
``torch`` layout or the ``torch_dist`` layout, reload them, and return the logits of a fixed prompt.
Converter tests compare their own output against these logits.

megatron-core needs a few CUDA-only calls replaced to run on CPU; ``apply_cpu_shims`` patches them
in the calling process only (never import this module for its side effects in library code).

Legacy layout written here (megatron-core has no legacy writer; this mirrors Megatron-LM's
``save_checkpoint`` with ``--ckpt-format torch``)::

    <root>/latest_checkpointed_iteration.txt            "10"
    <root>/iter_0000010/mp_rank_{tp:02d}/model_optim_rng.pt        (PP == 1)
    <root>/iter_0000010/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt (PP > 1)
        {"args": Namespace, "checkpoint_version": 3.0, "iteration": 10,
         "model": state_dict}  or  {"model0": ..., "model1": ...} per VPP chunk

``torch_dist`` layout (Megatron-LM ``--ckpt-format torch_dist``): the same tracker file and
``<root>/iter_0000010/`` holding the ``dist_checkpointing.save`` output of
``{"args", "checkpoint_version", "iteration", "model" | "model0", "model1", ...}``: the non-sharded
entries (``args``, ``checkpoint_version``, ``iteration``) land in ``common.pt``; tensors are stored
under global keys (``decoder.layers.<param>`` stacked over all layers; the model/model0/model1
nesting and the VPP chunking leave no trace in them). Even with the local spec, the layer norms are
stored under Transformer-Engine names: ``input_layernorm.weight`` ->
``self_attention.linear_qkv.layer_norm_weight``, ``pre_mlp_layernorm.weight`` ->
``mlp.linear_fc1.layer_norm_weight``. ``read_legacy`` / ``read_torch_dist`` read both layouts in a
plain process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

ITERATION = 10
PROMPT_BATCH = 2
PROMPT_SEQ = 12
PROMPT_SEED = 1234

_SHIMS_APPLIED = False


# ----------------------------------------------------------------------------------------------
# CPU shims
# ----------------------------------------------------------------------------------------------


def apply_cpu_shims() -> None:
    """Replace the CUDA-only calls megatron-core makes on the forward / checkpoint paths.

    Idempotent; meant for spawned test processes only. Each shim is listed with the call site that
    needs it. Applied on GPU machines too: the oracle always runs on CPU over gloo.
    """
    global _SHIMS_APPLIED
    if _SHIMS_APPLIED:
        return

    # RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device(); dist_checkpointing
    # and others ask for the current device too. A CPU device keeps everything on the host.
    torch.cuda.current_device = lambda: torch.device("cpu")
    # dist_checkpointing save/load and timers synchronize.
    torch.cuda.synchronize = lambda *a, **k: None

    # The attention softmax builds its default causal mask with device="cuda".
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as tutils

    def cpu_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    tutils.get_default_causal_mask = cpu_causal_mask
    fused_softmax.get_default_causal_mask = cpu_causal_mask

    # Attention dropout runs under get_cuda_rng_tracker().fork(), which needs CUDA RNG states.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()

    # LanguageModule.setup_embeddings_and_output_layer (tied embeddings with PP > 1) does
    # ``weight.data = weight.data.cuda()`` before all-reducing the two embedding copies.
    from megatron.core.models.common.language_module import language_module

    original_setup = language_module.LanguageModule.setup_embeddings_and_output_layer

    def setup_on_cpu(self) -> None:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t
        try:
            original_setup(self)
        finally:
            torch.Tensor.cuda = cuda

    language_module.LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu

    _shim_dist_checkpoint_writer()
    _SHIMS_APPLIED = True


def _shim_dist_checkpoint_writer() -> None:
    """Let ``dist_checkpointing.save`` write from a daemonic process.

    The torch_dist writer (``FileSystemWriterAsync``) collects results through a
    ``multiprocessing.Manager().Queue()`` (a spawned server process) and writes each bucket in a
    forked child. ``tests/distributed.py`` runs ranks as daemonic processes, which may not have
    children. A synchronous save only touches the results queue from the saving process itself, so a
    plain in-process queue replaces the Manager; the forked writers run with the daemon flag lifted
    for the duration of the write (they are joined before it returns). Files written are unchanged.
    """
    import multiprocessing
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # The writer logs each child's memory through psutil, which megatron-core does not declare.
    if not filesystem_async.HAVE_PSUTIL:
        filesystem_async._process_memory = lambda: 0

    local_queue = queue.Queue()
    filesystem_async._get_write_results_queue = lambda: local_queue

    original = filesystem_async.FileSystemWriterAsync.write_preloaded_data_multiproc

    def write_lifting_daemon(*args, **kwargs):
        config = multiprocessing.current_process()._config
        was_daemon = config.get("daemon")
        config["daemon"] = False
        try:
            return original(*args, **kwargs)
        finally:
            if was_daemon is None:
                config.pop("daemon", None)
            else:
                config["daemon"] = was_daemon

    filesystem_async.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(write_lifting_daemon)


# ----------------------------------------------------------------------------------------------
# Model description
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OracleSpec:
    """A tiny Llama/Qwen2-like decoder as megatron-core builds it (RMSNorm, SwiGLU, RoPE; Qwen2's QKV
    bias; ``add_bias_linear``: a bias on every linear layer, HF Llama's attention_bias + mlp_bias;
    ``rope_scaling``: Llama-3.1 frequency scaling). Norm weights and biases are randomized after
    megatron-core's init (which leaves norms at 1 and biases at 0 and would hide their handling)."""

    arch: str = "llama"  # "llama" or "qwen2" (qwen2: add_qkv_bias=True)
    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int = 16  # head_dim; may differ from hidden_size // num_attention_heads
    vocab_size: int = 100  # the real (HF) vocabulary
    make_vocab_size_divisible_by: int = 16  # Megatron pads to a multiple of this * TP
    tie_embeddings: bool = False
    rotary_base: int = 10000
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    add_bias_linear: bool = False
    norm_epsilon: float = 1e-6
    max_position_embeddings: int = 64
    init_method_std: float = 0.05
    seed: int = 7
    # uneven pipeline stages (megatron-core's num_layers_in_first/last_pipeline_stage); None: even
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2"):
            raise ValueError(f"OracleSpec.arch must be 'llama' or 'qwen2', got {self.arch!r}")

    @property
    def add_qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron-LM's ``_vocab_size_with_padding``: round up to make_vocab_size_divisible_by * tp."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict:
        return asdict(self)


def prompt_ids(spec: OracleSpec) -> torch.Tensor:
    """The fixed prompt, ``[batch, seq]`` token ids below the real vocabulary."""
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, spec.vocab_size, (PROMPT_BATCH, PROMPT_SEQ), generator=gen)


def megatron_args(spec: OracleSpec, tp: int, pp: int, vpp: int | None, fmt: str) -> argparse.Namespace:
    """The subset of Megatron-LM's ``args`` a converter reads, named and defaulted as Megatron-LM does.

    As in Megatron-LM, a model without GQA has ``group_query_attention=False`` and keeps the CLI
    default ``num_query_groups=1``: a converter must read ``num_query_groups`` only when
    ``group_query_attention`` is set.
    """
    gqa = spec.num_query_groups != spec.num_attention_heads
    return argparse.Namespace(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        group_query_attention=gqa,
        num_query_groups=spec.num_query_groups if gqa else 1,
        kv_channels=spec.kv_channels,
        padded_vocab_size=spec.padded_vocab_size(tp),
        vocab_size=spec.vocab_size,
        make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by,
        max_position_embeddings=spec.max_position_embeddings,
        seq_length=PROMPT_SEQ,
        norm_epsilon=spec.norm_epsilon,
        normalization="RMSNorm",
        rotary_base=spec.rotary_base,
        rotary_percent=1.0,
        use_rope_scaling=spec.rope_scaling,
        rope_scaling_factor=spec.rope_scaling_factor,
        position_embedding_type="rope",
        swiglu=True,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        untie_embeddings_and_output_weights=not spec.tie_embeddings,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        expert_model_parallel_size=1,
        num_experts=None,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        ckpt_format=fmt,
        use_dist_ckpt=fmt != "torch",
        transformer_impl="local",
    )


def check_layout(spec: OracleSpec, tp: int, pp: int, vpp: int | None) -> None:
    """Raise ValueError, before any collective, if megatron-core cannot build ``spec`` at this layout."""
    world = dist.get_world_size() if dist.is_initialized() else tp * pp
    chunks = vpp if vpp and vpp > 1 else 1
    problems = []
    if world % (tp * pp):
        problems.append(f"world size {world} is not a multiple of tp*pp = {tp * pp}")
    uneven = getattr(spec, "first_stage_layers", None) or getattr(spec, "last_stage_layers", None)
    if spec.num_layers % (pp * chunks) and not uneven:
        problems.append(f"num_layers {spec.num_layers} is not divisible by pp*vpp = {pp * chunks}")
    if vpp and vpp > 1 and pp == 1:
        problems.append("virtual pipeline stages need pp > 1")
    if spec.num_attention_heads % tp or spec.num_attention_heads % spec.num_query_groups:
        problems.append(f"heads {spec.num_attention_heads} / groups {spec.num_query_groups} do not fit tp={tp}")
    if spec.ffn_hidden_size % tp:
        problems.append(f"ffn_hidden_size {spec.ffn_hidden_size} is not divisible by tp={tp}")
    if problems:
        raise ValueError(f"oracle layout tp={tp} pp={pp} vpp={vpp} for {spec}: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------
# Building and running megatron-core models
# ----------------------------------------------------------------------------------------------


def init_parallel(tp: int, pp: int, vpp: int | None) -> None:
    """(Re)initialize megatron-core's parallel_state on the gloo world."""
    from megatron.core import parallel_state as ps

    apply_cpu_shims()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
    )


def transformer_config(spec, tp: int, pp: int, vpp: int | None = None, **extra):
    """megatron-core's TransformerConfig of a Qwen2/Llama-like ``spec`` (``OracleSpec`` or the MoE
    oracle's ``MoeSpec``) for CPU: RMSNorm, SwiGLU, RoPE, no dropout, no fused kernels; ``extra``
    adds fields (the MoE ones)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=spec.init_method_std,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        num_layers_in_first_pipeline_stage=getattr(spec, "first_stage_layers", None),
        num_layers_in_last_pipeline_stage=getattr(spec, "last_stage_layers", None),
        **extra,
    )


def build_chunks(spec: OracleSpec, tp: int, pp: int, vpp: int | None, seed: int | None = None) -> list:
    """This rank's model chunks (one per virtual stage), as Megatron-LM's ``model_provider`` builds
    them. Deterministic from ``seed`` (default ``spec.seed``) and the rank's (tp, pp) position."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    check_layout(spec, tp, pp, vpp)
    init_parallel(tp, pp, vpp)
    vpp = vpp if vpp and vpp > 1 else None
    config = transformer_config(spec, tp, pp, vpp)
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    # Same seed on every rank: CPU initialization draws each full weight and slices this rank's
    # shard, so the TP ranks of a stage agree; stages differ only in which modules they build.
    torch.manual_seed(spec.seed if seed is None else seed)
    chunks = []
    for v in range(vpp or 1):
        vp_stage = v if vpp else None
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=layer_spec,
                vocab_size=spec.padded_vocab_size(tp),
                max_sequence_length=spec.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=spec.tie_embeddings,
                position_embedding_type="rope",
                rotary_base=spec.rotary_base,
                rope_scaling=spec.rope_scaling,
                rope_scaling_factor=spec.rope_scaling_factor,
                parallel_output=True,
                vp_stage=vp_stage,
            ).eval()
        )
        _randomize_norms_and_biases(chunks[-1], spec.seed if seed is None else seed, v)
    return chunks


@torch.no_grad()
def _randomize_norms_and_biases(chunk, seed: int, vp_stage: int) -> None:
    """Norm weights ~ N(1, 0.1), biases ~ N(0, 0.05), drawn per parameter as the full tensor from a
    generator seeded by (seed, pipeline rank, virtual stage, name) and sliced for this TP rank, so
    the TP ranks of a stage hold pieces of one tensor and no two layers get the same values."""
    import zlib

    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    for name, param in chunk.named_parameters():
        is_norm = "norm" in name and name.endswith("weight")
        if not (is_norm or name.endswith(".bias")):
            continue
        split = getattr(param, "tensor_model_parallel", False)
        dim = getattr(param, "partition_dim", 0)
        full_shape = list(param.shape)
        if split:
            full_shape[dim] *= tp
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{pp_rank}/{vp_stage}/{name}".encode()))
        full = torch.randn(full_shape, generator=gen, dtype=torch.float32) * (0.1 if is_norm else 0.05)
        full += 1.0 if is_norm else 0.0
        param.copy_(full.chunk(tp, dim=dim)[tp_rank] if split else full)


@torch.no_grad()
def forward_logits(chunks: list, spec: OracleSpec) -> torch.Tensor:
    """Full-vocab logits of the fixed prompt, trimmed to the real vocab, ``[batch, seq, vocab]``.

    Runs the pipeline by hand: chunk v of pipeline rank p is global stage v * pp + p; hidden states
    ``[seq, batch, hidden]`` go to the next stage with send/recv (from the last rank's chunk v to
    the first rank's chunk v + 1 under VPP). The last stage gathers the vocab-sharded logits over
    TP and broadcasts them over its pipeline group, so every rank returns them.
    """
    from megatron.core import parallel_state as ps

    ids = prompt_ids(spec)
    position_ids = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    pp = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    hidden_shape = (ids.shape[1], ids.shape[0], spec.hidden_size)
    logits = None
    for v, model in enumerate(chunks):
        if not (v == 0 and pp_rank == 0):
            hidden = torch.empty(hidden_shape)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(input_ids=ids, position_ids=position_ids, attention_mask=None)
        if v == len(chunks) - 1 and pp_rank == pp - 1:
            logits = out  # [batch, seq, padded_vocab / tp]
        else:
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    # Gather the vocab shards on the last stage.
    last_rank_of_pipeline = ps.get_pipeline_model_parallel_last_rank()
    full_shape = (ids.shape[0], ids.shape[1], spec.padded_vocab_size(ps.get_tensor_model_parallel_world_size()))
    if logits is not None:
        tp = ps.get_tensor_model_parallel_world_size()
        if tp > 1:
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, dim=-1)
        logits = logits.contiguous()
    else:
        logits = torch.empty(full_shape)
    # Every pipeline group broadcasts from its own last stage (the TP groups of a stage agree).
    dist.broadcast(logits, src=last_rank_of_pipeline, group=ps.get_pipeline_model_parallel_group())
    return logits[..., : spec.vocab_size].clone()


# ----------------------------------------------------------------------------------------------
# Checkpoint paths and descriptions
# ----------------------------------------------------------------------------------------------


def iteration_dir(root: str, iteration: int | str = ITERATION) -> str:
    if iteration == "release":
        return os.path.join(root, "release")
    return os.path.join(root, f"iter_{iteration:07d}")


def legacy_rank_file(root: str, tp_rank: int, pp_rank: int, pp: int, iteration: int | str = ITERATION) -> str:
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(iteration_dir(root, iteration), name, "model_optim_rng.pt")


def read_tracker(root: str) -> int | str:
    """The iteration named by ``latest_checkpointed_iteration.txt``: a number, or ``"release"``."""
    path = os.path.join(root, "latest_checkpointed_iteration.txt")
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path}: expected an iteration number, found {text!r}") from None


def _chunk_key(i: int, nchunks: int) -> str:
    return "model" if nchunks == 1 else f"model{i}"


def _describe_legacy(state: dict) -> dict:
    """``{name: (shape, dtype)}``; non-tensors (``_extra_state``) as ``(type name, None)``."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = (tuple(value.shape), str(value.dtype))
        else:
            out[key] = (type(value).__name__, None)
    return out


def _describe_sharded(sharded: dict) -> dict:
    """``{module name: (kind, checkpoint key, global shape, local shape, global offset, replica_id)}``.

    ``kind`` is the megatron class (ShardedTensor, ShardedObject, ShardedTensorFactory). A factory
    (gated ``linear_fc1``) is described by its first produced ShardedTensor's key and its data's shape.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    out = {}
    for name, value in sharded.items():
        if isinstance(value, ShardedTensor):
            out[name] = ("ShardedTensor", value.key, tuple(value.global_shape), tuple(value.local_shape),
                         tuple(value.global_offset), value.replica_id)
        elif isinstance(value, ShardedObject):
            out[name] = ("ShardedObject", value.unique_key, tuple(value.global_shape), None,
                         tuple(value.global_offset), value.replica_id)
        elif isinstance(value, ShardedTensorFactory):
            out[name] = ("ShardedTensorFactory", value.key, None, tuple(value.data.shape), None, value.replica_id)
        else:
            out[name] = (type(value).__name__, None, None, None, None, None)
    return out


# ----------------------------------------------------------------------------------------------
# Workers (run on every rank through tests/distributed.run_distributed)
# ----------------------------------------------------------------------------------------------


def save_random_checkpoint(out_dir: str, spec: OracleSpec, tp: int, pp: int, vpp: int | None, fmt: str) -> dict:
    """Build the random model at (tp, pp, vpp), save it as Megatron-LM would in ``fmt`` ("torch" =
    legacy, "torch_dist") under ``out_dir``.

    Returns ``{"logits": [batch, seq, vocab_size] (same on every rank), "keys": {chunk key:
    description of what this rank saved}, "tp_rank", "pp_rank"}``.
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    if fmt not in ("torch", "torch_dist"):
        raise ValueError(f"fmt must be 'torch' or 'torch_dist', got {fmt!r}")
    chunks = build_chunks(spec, tp, pp, vpp)
    logits = forward_logits(chunks, spec)
    # Megatron-LM's generate_state_dict: args, version, iteration, then one entry per chunk.
    state = {"args": megatron_args(spec, tp, pp, vpp, fmt), "checkpoint_version": 3.0, "iteration": ITERATION}
    if dist.get_rank() == 0:
        os.makedirs(iteration_dir(out_dir), exist_ok=True)
    dist.barrier()
    if fmt == "torch":
        for i, chunk in enumerate(chunks):
            state[_chunk_key(i, len(chunks))] = chunk.state_dict_for_save_checkpoint()
        keys = {k: _describe_legacy(v) for k, v in state.items() if k.startswith("model")}
        if ps.get_data_parallel_rank() == 0:  # one writer per (tp, pp) position
            path = legacy_rank_file(out_dir, ps.get_tensor_model_parallel_rank(),
                                    ps.get_pipeline_model_parallel_rank(), pp)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(state, path)
    else:
        for i, chunk in enumerate(chunks):
            state[_chunk_key(i, len(chunks))] = chunk.sharded_state_dict()
        keys = {k: _describe_sharded(v) for k, v in state.items() if k.startswith("model")}
        # Non-sharded entries (args, checkpoint_version, iteration) go to common.pt.
        dist_checkpointing.save(state, iteration_dir(out_dir))
    dist.barrier()
    if dist.get_rank() == 0:  # the tracker last, as Megatron-LM does after all ranks finished
        with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    dist.barrier()
    return {"logits": logits, "keys": keys, "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank()}


def load_checkpoint_logits(ckpt_dir: str, spec: OracleSpec, tp: int, pp: int, vpp: int | None, fmt: str,
                           seed: int | None = None) -> torch.Tensor:
    """Build a fresh model at (tp, pp, vpp), load ``ckpt_dir`` into it and return the fixed prompt's
    logits ``[batch, seq, vocab_size]`` (every rank).

    The fresh model is initialized from another seed, so a load that leaves weights untouched shows.
    Loading is strict except for ``_extra_state`` entries (no weights; a converter need not write
    them): legacy uses ``load_state_dict`` per chunk; torch_dist uses ``dist_checkpointing.load``,
    which reshards to this layout and raises on any other key mismatch.
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if fmt not in ("torch", "torch_dist"):
        raise ValueError(f"fmt must be 'torch' or 'torch_dist', got {fmt!r}")
    iteration = read_tracker(ckpt_dir)
    chunks = build_chunks(spec, tp, pp, vpp, seed=spec.seed + 1000 if seed is None else seed)
    if fmt == "torch":
        path = legacy_rank_file(ckpt_dir, ps.get_tensor_model_parallel_rank(),
                                ps.get_pipeline_model_parallel_rank(), pp, iteration)
        state = torch.load(path, map_location="cpu", weights_only=False)
        for i, chunk in enumerate(chunks):
            key = _chunk_key(i, len(chunks))
            if key not in state:
                raise KeyError(f"{path}: no {key!r} entry (has {sorted(state)})")
            _load_chunk(chunk, state[key], f"{path}[{key}]")
    else:
        sharded = {_chunk_key(i, len(chunks)): c.sharded_state_dict() for i, c in enumerate(chunks)}
        state, missing, unexpected = dist_checkpointing.load(
            sharded, iteration_dir(ckpt_dir, iteration), strict=StrictHandling.RETURN_ALL)
        # "unexpected": requested by the model but absent from the checkpoint; "missing": the reverse.
        unexpected = {k for k in unexpected if "_extra_state" not in k}
        if missing or unexpected:
            raise KeyError(f"{ckpt_dir}: checkpoint keys the model does not have {sorted(missing)}; "
                           f"model keys the checkpoint lacks {sorted(unexpected)}")
        for i, chunk in enumerate(chunks):
            key = _chunk_key(i, len(chunks))
            _load_chunk(chunk, state[key], f"{ckpt_dir}[{key}]")
    return forward_logits(chunks, spec)


def _load_chunk(chunk, state: dict, where: str) -> None:
    result = chunk.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise KeyError(f"{where}: missing {missing}, unexpected {result.unexpected_keys}")


def fresh_logits(spec: OracleSpec, tp: int, pp: int, vpp: int | None, seed: int) -> torch.Tensor:
    """Logits of a model built from ``seed`` without loading anything (a negative control)."""
    return forward_logits(build_chunks(spec, tp, pp, vpp, seed=seed), spec)


# ----------------------------------------------------------------------------------------------
# Reading checkpoints in a plain process (no torch.distributed, no megatron)
# ----------------------------------------------------------------------------------------------


def read_legacy(root: str) -> dict:
    """``{(tp_rank, pp_rank): the torch.load-ed model_optim_rng.pt}`` of a legacy checkpoint."""
    it_dir = iteration_dir(root, read_tracker(root))
    out = {}
    for name in sorted(os.listdir(it_dir)):
        parts = name.split("_")  # mp, rank, TT[, PPP]
        if parts[:2] != ["mp", "rank"]:
            continue
        tp_rank, pp_rank = int(parts[2]), int(parts[3]) if len(parts) > 3 else 0
        out[(tp_rank, pp_rank)] = torch.load(os.path.join(it_dir, name, "model_optim_rng.pt"),
                                             map_location="cpu", weights_only=False)
    return out


def read_torch_dist(root: str) -> tuple[dict, dict]:
    """``(tensors, common)`` of a torch_dist checkpoint, read with torch.distributed.checkpoint
    without a process group: every stored tensor by its global key, and common.pt's dict."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    it_dir = iteration_dir(root, read_tracker(root))
    reader = dcp.FileSystemReader(it_dir)
    metadata = reader.read_metadata()
    tensors = {key: torch.empty(md.size, dtype=md.properties.dtype)
               for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": intended here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    common = torch.load(os.path.join(it_dir, "common.pt"), map_location="cpu", weights_only=False)
    return tensors, common


# ----------------------------------------------------------------------------------------------
# Checkpoints as training frameworks write them (no Megatron args)
# ----------------------------------------------------------------------------------------------


def optimizer_like_state(model_state: dict, seed: int) -> dict:
    """An optimizer-like sharded state beside ``model_state``: for every model ShardedTensor an
    ``optimizer.state.exp_avg.<model key>`` ShardedTensor with the same sharding (the key scheme of
    megatron-core's distributed optimizer in ``fully_sharded_model_space``; gated-fc1 factories are
    left out). Random values, so a reader that mistakes them for weights shows."""
    import dataclasses

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, value in enumerate(nested_values(model_state)):
        if isinstance(value, ShardedTensor):  # stacked layers share a key: index the entries instead
            key = f"optimizer.state.exp_avg.{value.key}"
            out[i] = dataclasses.replace(value, key=key, data=torch.randn(value.data.shape, generator=gen))
    return {"state": out}


def rng_state_object() -> object:
    """verl's RNG entry: a ShardedObject ``rng_state`` over (pp, tp), replicated over data parallel."""
    import random

    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = [{"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state(),
              "rng_tracker_states": {}}]
    return ShardedObject("rng_state", state, (ps.get_pipeline_model_parallel_world_size(),
                                              ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank())


def save_framework_checkpoints(root: str, spec: OracleSpec, vpp_spec: OracleSpec) -> dict:
    """Real megatron-core ``dist_checkpointing.save`` calls, as frameworks make them (run on 4 ranks):

    * ``model_only``: ``dist_checkpointing.save(model.sharded_state_dict(), dir)`` at TP2 x PP2 (no
      args, an empty common state);
    * ``verl/global_step_5/actor/dist_ckpt``: verl's ``{"model", "optimizer", "rng_state",
      "lr_scheduler"}`` of the same model (optimizer-like sharded state, RNG ShardedObject);
    * ``lora``: the model plus a LoRA-adapter-like tensor;
    * ``verl_vpp/global_step_7/actor/dist_ckpt``: ``vpp_spec`` at TP1 x PP2 x VPP2 (data parallel 2)
      saved as verl does with virtual stages: ``{"model0", "model1", "optimizer", "rng_state"}``.

    Returns the fixed prompt's logits of both models (every rank).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    chunks = build_chunks(spec, 2, 2, None)
    logits = forward_logits(chunks, spec)
    dist_checkpointing.save(chunks[0].sharded_state_dict(), _fresh_dir(root, "model_only"))
    actor = os.path.join(root, "verl", "global_step_5", "actor")
    model = chunks[0].sharded_state_dict()
    state = {"model": model, "optimizer": optimizer_like_state(model, seed=1), "rng_state": rng_state_object(),
             "lr_scheduler": {"max_lr": 1e-5, "num_steps": 5}}
    dist_checkpointing.save(state, _fresh_dir(actor, "dist_ckpt"))
    lora = chunks[0].sharded_state_dict()
    key = "decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight"
    if dist.get_rank() == 0:  # one writer holds the whole (tiny) adapter tensor
        lora["adapter"] = ShardedTensor.from_rank_offsets(key, torch.zeros(8, spec.hidden_size), replica_id=0)
    dist_checkpointing.save(lora, _fresh_dir(root, "lora"))

    vchunks = build_chunks(vpp_spec, 1, 2, 2)
    vpp_logits = forward_logits(vchunks, vpp_spec)
    state = {f"model{i}": c.sharded_state_dict() for i, c in enumerate(vchunks)}
    state["optimizer"] = optimizer_like_state({k: v for k, v in state.items()}, seed=2)
    state["rng_state"] = rng_state_object()
    dist_checkpointing.save(state, _fresh_dir(os.path.join(root, "verl_vpp", "global_step_7", "actor"), "dist_ckpt"))
    dist.barrier()
    return {"logits": logits, "vpp_logits": vpp_logits}


def _fresh_dir(parent: str, name: str) -> str:
    path = os.path.join(parent, name)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path
