"""Real Megatron-Bridge as a test oracle for Qwen3.5 / Qwen3.5-MoE conditional-generation checkpoints
(``Qwen3_5ForConditionalGeneration``: Bridge's ``Qwen35VLBridge`` / ``Qwen35VLMoEBridge`` build megatron-core's
``Qwen3VLModel``, text GPT under ``language_model.``, ViT tower under ``vision_model.``), run under
``.venv-bridge``: ``python tests/bridge_qwen35_vl_oracle.py JOBS.json RESULT.json``. Nothing of the project is
imported here.

The jobs and results are ``tests/bridge_gdn_oracle.py``'s (``write``: Bridge imports the HF directory and
``save_megatron_model``s it -> checkpoint keys and shapes; ``load``: a checkpoint loaded strictly into the model
Bridge builds (``"via": "dist_checkpointing"``: megatron-core ``dist_checkpointing.load(strict=RAISE_ALL)`` and
``load_state_dict(strict=True)``) and compared bitwise with what Bridge imports from the HF directory; ``export``:
Bridge's Megatron -> HF export), run by that module with its CPU stand-ins for the text model. A ``load`` of a
checkpoint with run_config.yaml (pmz's ``--to megatron-bridge`` output) goes through Bridge's own loader, which
instantiates the ``Qwen35VLModelProvider`` / ``Qwen35VLMoEModelProvider`` the file names and builds its
Qwen3VLModel with the same stand-ins (``config_diff`` against the provider Bridge derives from HF). On top of them,
this process stands in for the tower's Transformer-Engine modules the same way, with LayerNorm: megatron-core's
``get_vit_layer_with_transformer_engine_spec`` takes ``TELayerNormColumnParallelLinear`` (a LayerNorm fused in
as ``layer_norm_weight`` + ``layer_norm_bias``, then the column-parallel ``weight`` + ``bias``),
``TERowParallelLinear`` and ``TEDotProductAttention`` (megatron's local core attention) from here, and the
patch merger (``Qwen3VLModel`` builds its spec) ``TENorm`` (LayerNorm ``weight`` + ``bias``),
``TEColumnParallelLinear`` / ``TERowParallelLinear``; each keeps TE's empty ``_extra_state``. Only the
parameter names, shapes and checkpoint layout matter for the jobs (no vision forward is run).

Measured (megatron-bridge 0.6.2, megatron-core 0.19.2): Bridge's Qwen3VLModel checkpoint holds the tower's
blocks stacked, ``vision_model.decoder.layers.<param>`` ``[depth, ...]`` (linear_qkv / linear_proj / linear_fc1 /
linear_fc2 weight and bias, the fused LayerNorms' ``layer_norm_weight`` / ``layer_norm_bias``, ``_extra_state``
``shard_{b}_{depth}``), ``vision_model.merger.{patch_norm,linear_fc1,linear_fc2}.*``, ``vision_model.patch_embed.
proj.{weight,bias}``, ``vision_model.pos_embed.weight``, and the text model per layer under ``language_model.``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import bridge_gdn_oracle as gdn  # noqa: E402  (bridge_oracle's import guard, shims and stubs come first)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


class _TELayerNorm(torch.nn.Module):
    """Stand-in for ``TENorm`` with ``normalization="LayerNorm"`` (te.pytorch.LayerNorm): ``weight``, ``bias``,
    TE's ``_extra_state``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        if config.normalization != "LayerNorm":
            raise ValueError(f"stand-in vision TENorm does LayerNorm only, not {config.normalization}")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x):
        return _layer_norm(x, self.weight, self.bias, self.eps)

    get_extra_state, set_extra_state = gdn._extra_state, gdn._ignore_extra_state


def _vision_linears():
    column, row, _ = gdn._te_linears()

    class TELayerNormColumnParallelLinear(column):
        """Stand-in for TE's ``LayerNormLinear`` with a LayerNorm: ``layer_norm_weight``, ``layer_norm_bias``,
        then the column-parallel ``weight`` (+ ``bias``)."""

        def __init__(self, input_size, output_size, *, config, **kwargs):
            kwargs.pop("skip_weight_param_allocation", None)
            super().__init__(input_size, output_size, config=config, **kwargs)
            if config.normalization != "LayerNorm":
                raise ValueError(f"stand-in vision LayerNormLinear does LayerNorm only, not {config.normalization}")
            self.eps = config.layernorm_epsilon
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))

        def forward(self, x, *args, **kwargs):
            return super().forward(_layer_norm(x, self.layer_norm_weight, self.layer_norm_bias, self.eps), *args,
                                   **kwargs)

    return column, row, TELayerNormColumnParallelLinear


def _install_vision() -> None:
    """The tower's TE modules -> the stand-ins, where megatron-core's ViT spec and Bridge's Qwen3.5-VL provider
    look them up (module globals, read when the specs are built)."""
    from megatron.bridge.models.qwen_vl import qwen35_vl_provider
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as qwen3_vl_model
    from megatron.core.models.vision import vit_layer_specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    column, row, ln_column = _vision_linears()
    vit_layer_specs.TELayerNormColumnParallelLinear = ln_column
    vit_layer_specs.TERowParallelLinear = row
    vit_layer_specs.TEDotProductAttention = DotProductAttention
    for module in (qwen35_vl_provider, qwen3_vl_model):  # Qwen3VLModel builds the tower's merger spec itself
        module.TEColumnParallelLinear = column
        module.TERowParallelLinear = row
        module.TENorm = _TELayerNorm


if __name__ == "__main__":
    _install_vision()
    gdn.main(sys.argv[1], sys.argv[2])
