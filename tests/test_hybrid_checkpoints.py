"""What real Gated DeltaNet hybrid checkpoints hold beyond transformers' CausalLM model, read by
``build_parallel_model`` as transformers reads them: the MTP block (``mtp.*``, one multi-token-prediction
layer that transformers' CausalLM classes leave unread and pmz converts) is not loaded and does not stop
the load; the model's logits are still transformers' own."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.workers_qwen3_5 import configs, write_model


def _add_mtp(path: str, hidden: int) -> list[str]:
    """Write MTP-block tensors (names as in real Qwen3.5 checkpoints) into the checkpoint's one shard."""
    shard = f"{path}/model.safetensors"
    tensors = load_file(shard)
    g = torch.Generator().manual_seed(3)
    extra = {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.norm.weight": (hidden,),
             "mtp.pre_fc_norm_embedding.weight": (hidden,), "mtp.pre_fc_norm_hidden.weight": (hidden,),
             "mtp.layers.0.input_layernorm.weight": (hidden,)}
    for name, shape in extra.items():
        tensors[name] = torch.randn(shape, generator=g).to(tensors["model.norm.weight"].dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    return sorted(extra)


@pytest.mark.parametrize("name", ["mixed"])
def test_mtp_block_is_left_unread(tmp_path, name):
    from transformers import AutoModelForCausalLM

    from models.qwen3_5 import build_parallel_model

    config = configs()[name]
    path = write_model(tmp_path, name, config, seed=5)
    added = _add_mtp(path, config.hidden_size)
    assert not json.loads((tmp_path / name / "config.json").read_text()).get("mtp_num_hidden_layers")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = build_parallel_model(path).eval()
    assert not any(n.startswith("mtp") for n, _ in model.named_parameters())
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, return_logits=True).logits
        ref = hf(ids).logits
    assert (ours - ref).abs().max().item() < 1e-5, added
