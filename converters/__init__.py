"""Checkpoint formats and conversion (HF, Megatron legacy/torch_dist, vLLM); CPU only, no torch.distributed."""
