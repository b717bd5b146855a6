"""The copy path: conversions that only move bytes, planned from file metadata and executed with
``preadv``/``pwrite`` by worker threads -- no torch, no tensors in Python, memory bounded by one
buffer per thread. Every conversion without a dtype change or quantization takes it, HF, Megatron
(legacy, torch_dist; any TP/PP/VPP/EP, per-expert or grouped-GEMM experts) and vLLM ``sharded_state``
alike, dense, MoE and the Gated DeltaNet hybrids (MTP block and vision tower included): the hybrids'
output norms' ``minus_one`` values are the one thing computed (``ops.Data``, a small vector per
layer), grouped-GEMM expert blocks are transposed in bounded blocks, the rest are byte ranges.

  raw_source    the sources' base class (RawSource): units, minus-one values, the one-dtype check
  sources       a checkpoint as planned byte ranges, over its format's validating reader
  vllm_source   a vLLM ``sharded_state`` directory as a source (every rank's shards planned back)
  grouped_moe   grouped-GEMM (``GroupedMLP``) expert sources as transposed blocks
  ops           the operations (Copy, Interleave, Zeros, Transposed) and the blocks of Megatron tensors
  megatron_ops  Megatron tensors and TP shards as operations on the source files
  io            executing operations: the block writer (``fill_file``), preallocation
  vectored      vector reads and writes (``preadv``/``pwritev``), rows read into their columns, thread buffers
  transpose     bounded, cache-friendly transposes (padded rows, tiles) straight into the writer's block
  hf            the HF writer; ``megatron`` / ``megatron_moe``: the legacy and torch_dist writers;
  vllm          the vLLM ``sharded_state`` writer (rank files laid out from ``vllm_format``'s rules)
"""
