"""Megatron-Bridge checkpoints: ``iter_*/run_config.yaml`` read as bounded data.

What Megatron-Bridge writes: ``<root>/latest_checkpointed_iteration.txt``, ``iter_XXXXXXX/`` with
megatron-core's torch_dist files (no Megatron args), ``run_config.yaml``, ``train_state.pt``,
``tokenizer/`` and, with ``also_save_hf_checkpoint``, an HF export in ``hf/``. The tensors are read
by ``converters/formats/megatron_dist``; this module only reads the one hint run_config.yaml gives
about the model: the local HF directory it was trained from (``model.hf_model_id``).

run_config.yaml is a Hydra config full of ``_target_`` entries naming classes: it is data here and
nothing is ever instantiated from it. It is read with a safe loader (no Python tags), at most
``MAX_RUN_CONFIG_BYTES``, refusing YAML aliases before anything is built from them (nested aliases
expand exponentially: a 438-byte file can name 10^9 items), and only bounded scalars are taken
from it. CheckpointError naming the file otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.common.errors import CheckpointError
from models.common.hf_files import read_bounded

MAX_RUN_CONFIG_BYTES = 4 << 20  # Bridge writes tens of KB
MAX_MODEL_ID_CHARS = 4096


def _loader() -> type:
    import yaml

    class NoAliasLoader(yaml.SafeLoader):
        """``yaml.SafeLoader`` that refuses aliases (``*name``) when it meets them."""

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(None, None, f"alias *{event.anchor} (YAML aliases are not read)",
                                                  event.start_mark)
            return super().compose_node(parent, index)

    return NoAliasLoader


def read_run_config(path: Path) -> dict[str, Any]:
    """The data of a Bridge ``run_config.yaml`` (a mapping); CheckpointError naming the file when it is
    too large, not UTF-8, not YAML data, holds aliases or Python tags, or is not a mapping."""
    import yaml

    raw = read_bounded(path, MAX_RUN_CONFIG_BYTES, "a Megatron-Bridge run_config.yaml is tens of KB; pass "
                       "--hf-config DIR to convert without it")
    try:
        data = yaml.load(raw.decode("utf-8"), Loader=_loader())  # a SafeLoader subclass: data only
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text ({exc})") from exc
    except (yaml.YAMLError, RecursionError) as exc:
        raise CheckpointError(f"{path}: not read as YAML data: {' '.join(str(exc).split())}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: a YAML {type(data).__name__}, not a mapping (not a Megatron-Bridge "
                              f"run_config.yaml)")
    return data


def bridge_hf_model_id(run_config: Path) -> str | None:
    """``model.hf_model_id`` (or ``model.extra_checkpoint_metadata.hf_model_id``) of a Bridge
    run_config.yaml: a string of at most ``MAX_MODEL_ID_CHARS`` characters, or None when absent."""
    try:
        import yaml  # noqa: F401
    except ImportError:  # without PyYAML the hint is lost; --hf-config still works
        return None
    data = read_run_config(run_config)
    model = data.get("model")
    if not isinstance(model, dict):
        return None
    extra = model.get("extra_checkpoint_metadata")
    for where, value in (("model.extra_checkpoint_metadata.hf_model_id",
                          extra.get("hf_model_id") if isinstance(extra, dict) else None),
                         ("model.hf_model_id", model.get("hf_model_id"))):
        if value is None or value == "":
            continue
        if not isinstance(value, str) or len(value) > MAX_MODEL_ID_CHARS or "\0" in value:
            shown = f"a {type(value).__name__}" if not isinstance(value, str) else f"{len(value)} characters"
            raise CheckpointError(f"{run_config}: {where} is {shown}, not a model path or id (pass --hf-config DIR)")
        return value
    return None
