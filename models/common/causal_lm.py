"""The shared tensor/sequence-parallel causal LM: the decoder blocks (``blocks/``) with the LM head,
and its training (``training/``) and export (``export/``) entry points.

Activations are ``[seq, batch, hidden]`` (``[seq/tp, batch, hidden]`` between blocks under SP).
Parameter names follow vLLM (``model.layers.{i}.self_attn.qkv_proj.weight`` ...), layers are keyed
by their global index so names do not depend on the parallel layout.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from models.common.blocks.decoder import CausalLMOutput, ParallelDecoder
from models.common.blocks.moe import ParallelMoE, full_router_logits, load_balancing_loss, recording_routes
from models.common.blocks.rope import RotaryEmbedding
from models.common.config import ModelConfig
from models.common.weights import WeightEntry, WeightMap, export_hf_state, hf_shapes
from parallel.collectives import gather_last_dim
from parallel.cross_entropy import vocab_parallel_cross_entropy
from parallel.fsdp import unshard
from parallel.grads import finalize_grads
from parallel.groups import ParallelGroups
from parallel.layers import ParallelLMHead
from parallel.lm_head_loss import check_chunk_tokens, linear_cross_entropy
from parallel.pipeline_layout import stage_layer_ranges
from parallel.sequence_layout import SequencePlan
from parallel.sequence_shard import SequenceShard, plan_for

__all__ = ["CausalLMOutput", "ParallelCausalLM", "builds_logits"]

IGNORE_INDEX = -100


def builds_logits(return_logits: bool | None, *, gather_logits: bool, has_labels: bool, training: bool) -> bool:
    """Whether a forward builds full logits (else the loss goes through the fused, chunked head).

    ``return_logits`` decides when given (``False`` also overrides ``gather_logits``). Otherwise
    (``None``, the default) logits are built unless the call is a training step: the model in
    training mode with labels (or targets) and no request for logits (``gather_logits=True`` is
    one); such a step gets the loss from the fused head and ``logits=None``, as Liger-Kernel's
    models do. Eval mode, or no labels: logits, as transformers returns them."""
    if return_logits is not None:
        return bool(return_logits)
    return gather_logits or not (training and has_labels)


class ParallelCausalLM(nn.Module):
    """A tensor/sequence-parallel causal LM; build it with ``models.<arch>.build_parallel_model``."""

    # the decoder stack (embedding, layers, final norm); models with other layers (the Gated DeltaNet
    # hybrids, ``models/common/hybrid/lm.py``) set theirs
    decoder_class = ParallelDecoder

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, weight_map: WeightMap, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.weight_map = weight_map  # the architecture's table: HF names, shard rules, Megatron names
        self.groups = groups
        self.padded_vocab_size = groups.config.padded_vocab_size(cfg.vocab_size)
        # Pipeline stage: this rank's virtual chunks, each a list of global layer indices.
        self.chunk_layers = [list(r) for r in stage_layer_ranges(cfg.num_hidden_layers, groups.config)[groups.pp_rank]]
        self.is_first_stage = groups.pp_rank == 0
        self.is_last_stage = groups.pp_rank == groups.pp_size - 1
        self.model = self.decoder_class(cfg, groups, [i for c in self.chunk_layers for i in c], self.padded_vocab_size,
                                     dtype, device, has_embedding=self.is_first_stage, has_norm=self.is_last_stage)
        self.lm_head = None
        if self.is_last_stage:
            # Tied embeddings share one tensor on a single stage; across stages the last one holds a copy
            # whose gradient finalize_grads sums with the embedding's (they stay identical).
            tied = self.model.embed_tokens if cfg.tie_word_embeddings and self.is_first_stage else None
            self.lm_head = ParallelLMHead(cfg.vocab_size, self.padded_vocab_size, cfg.hidden_size,
                                          tp_group=groups.tp_group, sequence_parallel=groups.sequence_parallel,
                                          dtype=dtype, device=device, tied_to=tied)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        if device is not None:
            self.rotary.to(device)
        self._loss_chunk_tokens: int | None = None

    @property
    def loss_chunk_tokens(self) -> int | None:
        """Tokens per chunk of the fused LM-head loss (``parallel/lm_head_loss.py``); None: chosen from
        a byte budget for one chunk's logits. Setting it checks the value (a positive integer or None)."""
        return self._loss_chunk_tokens

    @loss_chunk_tokens.setter
    def loss_chunk_tokens(self, value: int | None) -> None:
        self._loss_chunk_tokens = check_chunk_tokens(value)

    # ------------------------------------------------------------------ inputs
    def _prepare(self, input_ids, position_ids, attention_mask, labels, cu_seqlens):
        """Normalize both batch forms to ``[b, s]`` tensors and pad ``s`` to a multiple of tp under SP."""
        if cu_seqlens is not None:
            if attention_mask is not None:
                raise ValueError("packed input (cu_seqlens) takes no attention_mask")
            input_ids = input_ids.reshape(1, -1)
            total = input_ids.shape[1]
            cu_seqlens = cu_seqlens.to(device=input_ids.device, dtype=torch.int64)
            bounds = cu_seqlens.tolist()  # the one host read of the forward's checks (a sync on CUDA)
            if not bounds or bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds, bounds[1:])):
                raise ValueError(f"cu_seqlens must rise from 0 to the token count {total}, got {bounds}")
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            if position_ids is None:  # output_size: no second host read
                starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
                position_ids = (torch.arange(total, device=input_ids.device) - starts).reshape(1, -1)
            elif position_ids.dim() == 3:  # M-RoPE rows [3, 1, T]
                position_ids = position_ids.reshape(position_ids.shape[0], 1, -1)
            else:
                position_ids = position_ids.reshape(1, -1)
            if labels is not None:
                labels = labels.reshape(1, -1)
        elif position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        b, s = input_ids.shape
        pad = (-s) % self.groups.tp_size if self.groups.sequence_parallel else 0
        if pad:
            input_ids = F.pad(input_ids, (0, pad))
            position_ids = F.pad(position_ids, (0, pad))  # position 0: leaves dynamic-RoPE length unchanged
            if attention_mask is not None:
                attention_mask = F.pad(attention_mask, (0, pad))
            if cu_seqlens is not None:  # the padding is one more (ignored) sequence
                cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([s + pad])])
        return input_ids, position_ids, attention_mask, labels, cu_seqlens, s

    @staticmethod
    def shift_labels(labels: torch.Tensor, cu_seqlens: torch.Tensor | None, length: int) -> torch.Tensor:
        """Target of token t is label t+1 of the same sequence; the last token of each sequence gets -100."""
        target = torch.full((labels.shape[0], length), IGNORE_INDEX, dtype=torch.long, device=labels.device)
        target[:, : labels.shape[1] - 1] = labels[:, 1:]
        if cu_seqlens is not None:  # a mask, not ends[ends >= 0]: no host read of the ends (a sync on CUDA)
            last = torch.zeros(length + 1, dtype=torch.bool, device=labels.device)
            last[cu_seqlens[1:].to(labels.device)] = True  # entry e + 1 for a sequence ending at e; e = -1 drops out
            target[0].masked_fill_(last[1:], IGNORE_INDEX)
        return target

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                gather_logits: bool = False, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None, return_logits: bool | None = None,
                sequence_plan: SequencePlan | None = None, targets: torch.Tensor | None = None,
                output_router_logits: bool | None = None, multimodal=None) -> CausalLMOutput:
        """Padded batch ``input_ids [b, s]`` (optional ``attention_mask [b, s]``, 1 = token), or a packed
        batch ``input_ids [T]``/``[1, T]`` with ``cu_seqlens [n + 1]``. ``labels`` like ``input_ids``;
        shifted inside, ``-100`` ignored (transformers semantics).

        A training step (the model in training mode, the default after ``build_parallel_model``, with
        ``labels``) computes the loss with the LM head fused into it in chunks of ``loss_chunk_tokens``
        tokens (``head_losses``): no full ``[tokens, vocab/tp]`` logits exist in forward or backward and
        ``out.logits`` is None. Logits are built (and the loss computed from them) in eval mode, without
        labels, or on request: ``return_logits=True``, or ``gather_logits=True`` (which gathers them over
        TP); ``return_logits=False`` forces the fused head. The rule: ``builds_logits``.

        With context/Ulysses parallelism every rank of the group passes the same full batch (the
        model takes its own tokens; logits come back whole), or, with ``sequence_plan``, only its own
        tokens (``plan.token_index``) and their ``targets`` (HF-shifted labels, ``-100`` ignored);
        logits then stay local. See ``models/common/training/sequence_split.py``.

        Mixture-of-experts models: ``output_router_logits`` (default: the HF config's) returns the
        load-balancing loss and router logits and adds ``router_aux_loss_coef * aux_loss`` to the loss,
        as transformers does; with cp/ulysses the loss is the whole batch's, and router-logit rows of
        padding tokens are 0 (padding is not computed there; see ``split_sequence_forward``).

        ``multimodal``: what a multimodal model merges into the token embeddings (``embed_inputs``);
        Qwen2-VL's forward builds it from pixel values."""
        want_aux = self._wants_router_logits(output_router_logits)
        return_logits = builds_logits(return_logits, gather_logits=gather_logits, training=self.training,
                                      has_labels=labels is not None or targets is not None)
        if self.groups.pp_size > 1:
            raise RuntimeError("with pipeline parallelism use model.forward_backward(...) (stages run in a schedule)")
        if self.groups.config.fsdp:
            from parallel.fsdp import set_replica_scale

            set_replica_scale(self, self.groups.dp_size)  # each DP rank's loss is its own mean
        if self.groups.sequence_split or sequence_plan is not None:
            from models.common.training.sequence_split import split_sequence_forward

            return split_sequence_forward(self, input_ids, position_ids, attention_mask, labels, cu_seqlens,
                                          gather_logits, return_logits, sequence_plan, targets, multimodal,
                                          router_logits=want_aux)
        if targets is not None:
            raise ValueError("targets= is for already-sliced inputs (with sequence_plan=); pass labels= instead")
        ids, pos, mask, labels, cu, seq_len = self._prepare(input_ids, position_ids, attention_mask, labels, cu_seqlens)
        blocks = self.moe_blocks() if want_aux else []
        token_mask = None
        if blocks:
            valid = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
            valid[:, :seq_len] = 1 if mask is None else mask[:, :seq_len].to(torch.float32)
            token_mask = valid.t().reshape(-1)  # the layers' token order: [s, b] flattened
        if mask is not None and bool(mask.all()):
            mask = None  # no padding: plain causal kernel
        with recording_routes(blocks, token_mask):
            h = self.embed_inputs(ids, multimodal)  # [s(/tp), b, hidden]
            h = self.run_layers(h, self.layer_ids(), pos, mask, cu, max_seqlen)
            aux_loss = router_logits = None
            if blocks:
                aux_loss = load_balancing_loss(blocks, self.groups)
                router_logits = tuple(full_router_logits(blk, ids.numel(), ids.shape[0], seq_len) for blk in blocks)
        h = self.model.norm(h)
        # Logits are built whole only when returned; a loss alone goes through the chunked, fused head.
        logits = self.lm_head(h) if return_logits else None  # [s, b, V_pad/tp]
        loss = None
        if labels is not None:
            target = self.shift_labels(labels, cu_seqlens, ids.shape[1]).t()  # [s, b]
            count = (target != IGNORE_INDEX).sum()
            per_token = self.token_losses(logits, target) if return_logits else self.head_losses(h, target)
            loss = per_token.sum() / count.clamp(min=1)
            if aux_loss is not None:
                loss = loss + self.config.moe.router_aux_loss_coef * aux_loss
        out_logits = None
        if return_logits:
            logits = logits[:seq_len].transpose(0, 1)  # [b, s, V_pad/tp]
            if gather_logits:
                out_logits = gather_last_dim(logits, self.groups.tp_group)[..., : self.config.vocab_size]
            else:
                out_logits = logits[..., : self.lm_head.valid_columns]
        return CausalLMOutput(loss=loss, logits=out_logits, aux_loss=aux_loss, router_logits=router_logits)

    def moe_blocks(self) -> list:
        """This rank's mixture-of-experts blocks in layer order (empty for dense models)."""
        return [layer.mlp for layer in self.model.layers.values() if isinstance(layer.mlp, ParallelMoE)]

    def _wants_router_logits(self, requested: bool | None) -> bool:
        if self.config.moe is None:
            if requested:
                raise ValueError("output_router_logits=True needs a mixture-of-experts model")
            return False
        if requested is None:
            requested = bool(getattr(getattr(self, "hf_config", None), "output_router_logits", False))
        return requested

    # ------------------------------------------------------------------ pieces (also used by pipeline stages)
    def embed_shard(self, ids: torch.Tensor, shard: SequenceShard, batch=None, multimodal=None) -> torch.Tensor:
        """Embeddings ``[n(/tp), 1, hidden]`` of this cp/ulysses rank's tokens ``ids [n]`` of a sequence-split
        ``batch`` (``FlatBatch``); multimodal models merge their features for those tokens."""
        if multimodal is not None:
            raise ValueError(f"{self.config.architecture} takes no multimodal inputs")
        return self.model.embed_tokens(ids[:, None])

    def embed_microbatch(self, ids: torch.Tensor, inputs: dict | None = None,
                         seq: SequenceShard | None = None) -> torch.Tensor:
        """The first pipeline stage's embedding of a packed micro-batch ``ids [1, T]`` (this rank's
        tokens of it under cp/ulysses, ``seq``) with its per-sample model inputs merged
        (``forward_backward``; Qwen2-VL: pixels and grids, plus ``packed_ids``, the whole micro-batch's
        ids, under cp/ulysses)."""
        if inputs:
            raise ValueError(f"{self.config.architecture} takes no per-sample inputs ({', '.join(inputs)})")
        return self.model.embed_tokens(ids.t())

    def embed_inputs(self, ids: torch.Tensor, multimodal=None) -> torch.Tensor:
        """Token embeddings ``[s(/tp), b, hidden]`` of ``ids [b, s]`` (the first stage's input);
        multimodal models override it to merge their features in (``multimodal``)."""
        if multimodal is not None:
            raise ValueError(f"{self.config.architecture} takes no multimodal inputs")
        return self.model.embed_tokens(ids.t())

    def packed_logits(self, ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None,
                      seq: SequenceShard | None = None, inputs: dict | None = None) -> torch.Tensor:
        """One packed micro-batch ``ids [1, T]`` (this rank's tokens under cp/ulysses) through the whole
        model: vocab-sharded logits ``[T, 1, V_pad/tp]`` (a forward method FSDP2 knows about)."""
        return self.lm_head(self._packed_hidden(ids, position_ids, cu_seqlens, seq, inputs))

    def packed_losses(self, ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None,
                      seq: SequenceShard | None, inputs: dict | None, target: torch.Tensor, entropy: bool = False):
        """``packed_logits`` fused with the loss: per-token cross entropy ``[T]`` against ``target [T, 1]``
        (and the entropy, ``head_losses``) without full logits (a forward method FSDP2 knows about,
        so the head's weight is unsharded while the fused head runs)."""
        return self.head_losses(self._packed_hidden(ids, position_ids, cu_seqlens, seq, inputs), target, entropy)

    def _packed_hidden(self, ids, position_ids, cu_seqlens, seq, inputs) -> torch.Tensor:
        """Final-norm hidden states ``[T(/tp), 1, hidden]`` of one packed micro-batch."""
        h = self.embed_microbatch(ids, inputs, seq)
        h = self.run_layers(h, self.layer_ids(), position_ids, None, None if seq is not None else cu_seqlens, seq=seq)
        return self.model.norm(h)


    def run_layers(self, h: torch.Tensor, layer_ids: list[int], position_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                   max_seqlen: int | None = None, seq: SequenceShard | None = None) -> torch.Tensor:
        """Decoder layers ``layer_ids`` on hidden states ``h [s(/tp), b, hidden]``.

        ``seq``: this rank's share of a sequence-split batch (``position_ids`` are its tokens').
        With ``recompute="full"`` each layer keeps only its input for backward and reruns itself
        (collectives included: every rank of a group recomputes the same layers in the same order).
        """
        cos, sin = self.rotary(position_ids, h.dtype, seq_len=seq.rope_seq_len if seq is not None else None)
        recompute = self.groups.config.recompute == "full" and torch.is_grad_enabled()
        for i in layer_ids:
            layer = self.model.layers[str(i)]
            if recompute:
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, attention_mask, cu_seqlens, max_seqlen, seq,
                                                      use_reentrant=False)
            else:
                h = layer(h, cos, sin, attention_mask, cu_seqlens, max_seqlen, seq)
        return h

    def token_losses(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy ``[s * b]`` of vocab-sharded ``logits [s, b, V/tp]`` against ``target [s, b]``."""
        return vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), vocab_start=self.lm_head.vocab_start,
            valid_columns=self.lm_head.valid_columns, group=self.groups.tp_group, ignore_index=IGNORE_INDEX)

    def head_losses(self, h: torch.Tensor, target: torch.Tensor, entropy: bool = False):
        """Per-token cross entropy ``[s * b]`` of final-norm hidden states ``h [s(/tp), b, hidden]`` against
        ``target [s, b]``: the LM head fused with the loss in chunks of ``loss_chunk_tokens`` tokens
        (``parallel/lm_head_loss.py``), never full logits; ``entropy=True`` returns ``(loss, entropy)``."""
        head = self.lm_head
        return linear_cross_entropy(
            h.reshape(-1, h.shape[-1]), head.shared_weight, target.reshape(-1), vocab_start=head.vocab_start,
            valid_columns=head.valid_columns, group=self.groups.tp_group, sequence_parallel=head.sequence_parallel,
            ignore_index=IGNORE_INDEX, chunk_tokens=self.loss_chunk_tokens, entropy=entropy)

    # ------------------------------------------------------------------ weights
    def layer_ids(self) -> list[int]:
        """Global indices of the decoder layers this rank holds (all its virtual chunks)."""
        return [int(i) for i in self.model.layers.keys()]

    def weight_entries(self) -> list[WeightEntry]:
        """The weight-map entries of this rank's parameters (what it loads and exports)."""
        return self.weight_map.entries(self.layer_ids(), first=self.is_first_stage, last=self.is_last_stage)

    def load_entries(self) -> list[WeightEntry]:
        """``weight_entries`` plus, for tied embeddings split over stages, the last stage's head copy."""
        entries = self.weight_entries()
        if self.config.tie_word_embeddings and self.is_last_stage and not self.is_first_stage:
            embed = self.weight_map.first_entries[0]
            entries.append(WeightEntry("lm_head.weight", embed.hf, embed.rules))
        return entries

    def iter_hf_weights(self, tensors: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` for this rank's layers, gathered over TP with the weight map's rules.

        ``tensors`` maps internal names to what to export (default: the parameters; pass
        ``{n: p.grad}`` to export gradients). Collective over TP: call on every TP rank.
        """
        wmap = self.weight_map
        tensors = tensors if tensors is not None else dict(self.named_parameters())
        tensors = {name: unshard(t) for name, t in tensors.items()}  # FSDP2 shards -> this TP rank's tensor
        yield from export_hf_state(tensors, self.weight_entries(), hf_shapes(self.config, wmap), self.groups.tp_group,
                                   self.groups.ep_group)

    def iter_export(self, format: str = "hf", *, bucket_bytes: int = 512 << 20, dtype: torch.dtype | None = None,
                    merge_lora: bool = False, target_tp: int | None = None, target_rank: int | None = None,
                    transport: str = "collective", quantization: str | None = None):
        """Collective over every rank of the job: the whole model as flat buckets
        (``ExportBucket``: ``.buffer``, ``.metas``, ``.tensors()``), the same on every rank, for any
        tp/pp/vpp/dp/fsdp layout. ``format="hf"``: full HF tensors; ``format="vllm"``: vLLM rank
        ``target_rank``'s shards for an engine with TP ``target_tp``, under vLLM's names.
        ``merge_lora``: with the LoRA adapter merged. ``transport="shm"``: buckets through shared memory
        (one host; a bucket is valid until the next is requested). ``quantization="fp8"``: linear
        weights as block-wise FP8 e4m3 plus ``<name>_scale_inv`` (``models/common/export/fp8.py``).
        See ``models/common/export/buckets.py``."""
        from models.common.export.buckets import iter_export

        return iter_export(self, format, bucket_bytes=bucket_bytes, dtype=dtype, merge_lora=merge_lora,
                           target_tp=target_tp, target_rank=target_rank, transport=transport,
                           quantization=quantization)

    def save_vllm_sharded_state(self, directory, *, tp: int, pp: int = 1, dtype: torch.dtype | None = None,
                                max_shard_size: str | int = "5GB", merge_lora: bool = False,
                                quantization: str | None = None) -> None:
        """Collective over every rank: vLLM's ``sharded_state`` directory for an engine with TP ``tp``
        and PP ``pp`` (loaded with ``load_format="sharded_state"``); atomic; ``quantization="fp8"``:
        block-wise FP8 linear shards with their scales (a ``tp`` cutting a 128 block is refused). See
        ``models/common/export/saving.py``."""
        from models.common.export.saving import save_vllm_sharded_state

        save_vllm_sharded_state(self, directory, tp=tp, pp=pp, dtype=dtype, max_shard_size=max_shard_size,
                                merge_lora=merge_lora, quantization=quantization)

    def save_pretrained(self, directory, *, dtype: torch.dtype | None = None, max_shard_size: str | int = "5GB",
                        merge_lora: bool = False, quantization: str | None = None) -> None:
        """Collective over every rank: an HF checkpoint directory (config.json, safetensors shards and
        index) that transformers loads unchanged; atomic; ``merge_lora``: LoRA merged into the
        weights; ``quantization="fp8"``: block-wise FP8 linear weights with ``weight_scale_inv`` and
        ``quantization_config`` (DeepSeek-V3's format). See ``models/common/export/saving.py``."""
        from models.common.export.saving import save_pretrained

        save_pretrained(self, directory, dtype=dtype, max_shard_size=max_shard_size, merge_lora=merge_lora,
                        quantization=quantization)

    def load_lora_adapter(self, directory) -> None:
        """Fill the LoRA factors (model built with ``lora=``) from a peft adapter directory."""
        from models.common.export.lora_adapter import load_lora_adapter

        load_lora_adapter(self, directory)

    def save_lora_adapter(self, directory) -> None:
        """Collective: write the LoRA adapter as a peft adapter directory (global rank 0 writes)."""
        from models.common.export.lora_adapter import save_lora_adapter

        save_lora_adapter(self, directory)

    # ------------------------------------------------------------------ training
    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                         num_microbatches: int = 1, schedule: str = "1f1b", forward_only: bool = False,
                         cu_seqlens: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                         position_ids: torch.Tensor | None = None,
                         max_tokens_per_microbatch: int | None = None, aux_loss: bool | None = None,
                         return_aux_loss: bool = False, return_entropy: bool = False):
        """One training step's forward and backward over balanced micro-batches (any pp, same API).

        Returns the loss of the whole batch: the token mean over every non-ignored label of the
        global batch (all micro-batches and DP ranks), identical on every rank. When it returns,
        every ``.grad`` is final (TP/SP, replicated KV, tied embedding across stages, DP), so a plain
        ``optimizer.step()`` follows. ``forward_only=True`` instead returns per-token log-probs of the
        labels laid out like ``input_ids`` (``out[..., t] = log p(labels[..., t] | tokens < t)``; 0 where
        ignored), on every rank, in the original sample order; with ``return_entropy=True`` it returns
        ``(logprobs, entropy)``, the entropy of the distribution each log-prob was taken from, laid out
        the same way (at every predicted token, ignored labels included; 0 at first tokens and
        padding). The LM head runs fused with the loss in chunks of ``loss_chunk_tokens`` tokens
        (no full logits), in training and forward-only alike. Schedules: "gpipe", "1f1b",
        "interleaved_1f1b" (chosen for "1f1b" when vpp > 1), "looped_bfs", "interleaved_zero_bubble".

        Mixture-of-experts models: ``aux_loss`` (default: the HF config's ``output_router_logits``,
        when transformers adds it) adds ``router_aux_loss_coef`` times the load-balancing loss, taken
        per micro-batch as transformers computes it for that micro-batch (all sparse layers, across
        pipeline stages, real tokens only) and averaged over the micro-batches of all DP ranks: with
        one micro-batch and one replica it is transformers' own number (unlike cross entropy it depends
        on the split: 1F1B runs at least pp micro-batches, interleaved schedules a multiple of pp, and
        the balancing planner groups samples by length; use "gpipe" for one). ``return_aux_loss=True``
        returns ``(loss, aux_loss)`` (``aux_loss`` unscaled, ``None`` when not added).
        """
        from models.common.training.forward_backward import forward_backward

        return forward_backward(self, input_ids, labels, num_microbatches=num_microbatches, schedule=schedule,
                                forward_only=forward_only, cu_seqlens=cu_seqlens, attention_mask=attention_mask,
                                position_ids=position_ids, max_tokens_per_microbatch=max_tokens_per_microbatch,
                                aux_loss=aux_loss, return_aux_loss=return_aux_loss, return_entropy=return_entropy)

    def finalize_grads(self) -> None:
        """After ``model(...).loss.backward()``: sum SP-partial and replicated-KV gradients over TP, sum
        over cp/ulysses ranks, average over DP (FSDP2 already reduced over the replicas)."""
        groups = self.groups
        finalize_grads(self.parameters(), tp_group=groups.tp_group, replica_group=groups.replica_group,
                       replica_scale=1.0 / groups.dp_size, replicas_reduced=groups.config.fsdp,
                       expert_replica_group=groups.edp_group)

    # ------------------------------------------------------------------ sequence split (cp / ulysses)
    def plan_sequences(self, lengths, total: int | None = None) -> SequencePlan:
        """The token layout of packed sequences of ``lengths`` over this job's cp/ulysses ranks (the
        same on every rank, computed from lengths alone): for callers passing already-sliced input,
        ``plan.token_index(*self.sequence_coordinates)`` says which global tokens this rank takes."""
        return plan_for(self.groups, list(lengths), total)

    @property
    def sequence_coordinates(self) -> tuple[int, int]:
        """This rank's ``(cp_rank, ulysses_rank)``."""
        return self.groups.cp_rank, self.groups.ulysses_rank
