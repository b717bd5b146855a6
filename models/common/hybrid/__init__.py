"""The Gated DeltaNet hybrid room: the Qwen3.5 / Qwen3-Next language model, config, weights and its vision build."""
