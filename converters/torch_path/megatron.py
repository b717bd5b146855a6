"""Writing Megatron checkpoints (legacy ``torch`` and ``torch_dist``) at any TP/PP/VPP/EP from any reader.

The target layout is validated against the model before anything is written
(``megatron_target.plan_megatron_target``). Legacy output is written one rank file per task
(``megatron_legacy.write_legacy_rank``), torch_dist output a few data files of whole units
(``megatron_dist.write_dist``); the HF config is kept beside the iterations.
"""

from __future__ import annotations

from pathlib import Path

from converters.formats.hf_config import write_config_dir
from converters.formats.megatron_args import HF_CONFIG_DIR, iteration_folder
from converters.runtime.tasks import run_tasks
from converters.torch_path.megatron_dist import write_dist
from converters.torch_path.megatron_legacy import write_legacy_rank
from converters.torch_path.megatron_target import MegatronTarget, plan_megatron_target  # noqa: F401
from converters.torch_path.reader import CheckpointReader


def write_megatron(reader: CheckpointReader, target: MegatronTarget, directory: str, *, fmt: str, workers: int,
                   progress: bool, hf_config_dir: str | None = None) -> None:
    root = Path(directory)
    folder = iteration_folder(root, target.iteration)
    if fmt == "megatron":
        tasks = [(write_legacy_rank, (reader.reopen_args(), target, str(folder), p, t, e))
                 for p in range(target.pp) for e in range(target.ep) for t in range(target.tp)]
        run_tasks(tasks, workers, "writing Megatron rank files", progress)
    else:
        write_dist(reader, target, str(folder), workers=workers, progress=progress)
    # The HF config beside the iteration folders keeps what Megatron args cannot say (real vocab size,
    # RoPE scaling, token ids); our readers pick it up, Megatron ignores it.
    hf_dir = root / HF_CONFIG_DIR
    hf_dir.mkdir()
    write_config_dir(reader.hf_config, hf_dir)  # with generation config, tokenizer files, chat template
