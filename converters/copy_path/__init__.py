"""The copy path: conversions that only move bytes, planned from file metadata and executed with
``preadv``/``pwrite`` by worker threads -- no torch, no tensors in Python, memory bounded by one
buffer per thread. Every dense conversion without a dtype change takes it, dense Qwen3.5 (Gated
DeltaNet hybrid, MTP block included) too: its output norms' ``minus_one`` values are the one thing
computed (``ops.Data``, a small vector per layer), the rest are byte ranges.

  sources       a checkpoint as planned byte ranges, over its format's validating reader
  ops           the operations (Copy, Interleave, Zeros) and the blocks of Megatron tensors
  megatron_ops  Megatron tensors and TP shards as operations on the source files
  io            executing operations: the block writer, vector reads and writes
  hf            the HF writer; ``megatron``: the legacy and torch_dist writers
"""
