"""The vision-language room: the Qwen2-VL / Qwen3-VL model wrapper, its M-RoPE positions, config and weight maps."""
