"""vLLM ``sharded_state`` directories as a *source*: the validating reader (``VllmShardedCheckpoint``).

What ``pmz convert --to vllm``, ``save_vllm_sharded_state`` and vLLM's own ``save_sharded_state``
write: ``config.json`` (plus tokenizer files) and, per vLLM rank, ``model-rank-{t}-part-{k}.safetensors``
(``model-pp-{p}-tp-{t}-part-{k}.safetensors`` with pipeline stages) holding that rank's shards
under vLLM's internal names (``qkv_proj``, ``gate_up_proj``, fused ``w13``/``w2`` expert stacks,
vocabulary padded to a multiple of 64, attention scale scalars). The layout rules are the ones
the writers use (``models/common/vllm_format.py``, from the architecture's weight map), so reading
is their inverse and nothing about vLLM is written down twice.

Checked once, torch-free, before any conversion writes: the file names (one naming scheme, every
tensor rank ``0..tp-1`` of every stage ``0..pp-1`` present, parts numbered ``0..k-1``, no other
safetensors file), every header (``models/common/hf_files.read_safetensors_header``), the config
(an architecture we know, a layout vLLM can hold at that tp/pp), and each rank's keys: exactly the
keys vLLM's strict loader expects for that rank, each in one part, with the shard shape the
weight map gives at that TP. Errors name the file and the key (CheckpointError, one line).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from converters.formats.hf_config import read_hf_config
from converters.formats.quantized import check_unquantized_tensors
from converters.layout.model import architecture_for, conversion_weight_map
from models.common.errors import CheckpointError
from models.common.hf_files import StoredTensor, read_safetensors_header
from models.common.weight_map import hf_shapes

RANK_FILE = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")
STAGE_FILE = re.compile(r"^model-pp-(\d+)-tp-(\d+)-part-(\d+)\.safetensors$")


def vllm_rank_files(directory: str | os.PathLike) -> dict[tuple[int, int], dict[int, Path]]:
    """``{(pp_rank, tp_rank): {part: path}}`` of a directory's vLLM ``sharded_state`` files ({} if none)."""
    found: dict[tuple[int, int], dict[int, Path]] = {}
    for path in Path(directory).glob("model-*.safetensors"):
        if m := RANK_FILE.match(path.name):
            key, part = (0, int(m.group(1))), int(m.group(2))
        elif m := STAGE_FILE.match(path.name):
            key, part = (int(m.group(1)), int(m.group(2))), int(m.group(3))
        else:
            continue
        found.setdefault(key, {})[part] = path
    return found


def is_vllm_dir(directory: Path) -> bool:
    return (directory / "config.json").is_file() and bool(vllm_rank_files(directory))


class VllmShardedCheckpoint:
    """A vLLM ``sharded_state`` directory, validated once (see the module docstring): ``hf_config``,
    ``arch``, ``cfg``, ``wmap`` (HF conversion map), ``vmap`` (vLLM's), ``tp``, ``pp`` and
    ``tensors[(pp_rank, tp_rank)][key]`` (where each key's bytes are), ``stages[pp_rank]`` (the
    ``VllmTensor`` listing of the stage: key and the weight-map entry it packs)."""

    format = "vllm"

    def __init__(self, path: str | os.PathLike) -> None:
        from models.common import vllm_format  # vLLM's layout rules: loaded when a vLLM directory is read

        self.path = str(path)
        directory = Path(path)
        self.hf_config = read_hf_config(path)
        self.arch = architecture_for(self.hf_config.model_type, self.path)
        self.cfg = self.arch.model_config(self.hf_config)
        files = vllm_rank_files(directory)
        if not files:
            raise CheckpointError(f"{directory}: no vLLM sharded_state files (model-rank-T-part-K.safetensors)")
        self.tp, self.pp = self._grid(directory, files)
        try:
            vllm_format.check_layout(self.cfg, self.tp, self.pp)
            vllm_format.check_hf_config(self.hf_config, self.cfg, self.tp)
        except ValueError as exc:
            raise CheckpointError(f"{directory}: {exc}") from None
        self.wmap = conversion_weight_map(self.arch, self.cfg)
        self.vmap = vllm_format.vllm_map(self.arch, self.cfg)
        shapes = hf_shapes(self.cfg, self.wmap)
        self.stages = [vllm_format.stage_tensors(self.vmap, self.cfg, p, self.pp) for p in range(self.pp)]
        self.tensors: dict[tuple[int, int], dict[str, StoredTensor]] = {}
        for (pp_rank, tp_rank), parts in sorted(files.items()):
            self.tensors[(pp_rank, tp_rank)] = self._check_rank(parts, self.stages[pp_rank], shapes, tp_rank)
        self._check_rank_dtypes()

    def _check_rank_dtypes(self) -> None:
        """Every TP rank of a stage holds each key in the same dtype: merging a BF16 shard with an F32
        one would narrow the F32 values (pmz never narrows silently); two checkpoints mixed, refused
        naming both files and dtypes."""
        for (pp_rank, tp_rank), stage in sorted(self.tensors.items()):
            if tp_rank == 0:
                continue
            first = self.tensors[(pp_rank, 0)]
            for key, t in stage.items():
                if t.dtype != first[key].dtype:
                    raise CheckpointError(f"{t.path}: {key} is {t.dtype}, but {first[key].dtype} in "
                                          f"{first[key].path}: the rank files of one checkpoint share their "
                                          f"dtypes (files of two checkpoints mixed?); pmz does not narrow values")

    def _grid(self, directory: Path, files: dict[tuple[int, int], dict[int, Path]]) -> tuple[int, int]:
        from models.common import vllm_format

        names = [p.name for parts in files.values() for p in parts.values()]
        if any(RANK_FILE.match(n) for n in names) and any(STAGE_FILE.match(n) for n in names):
            raise CheckpointError(f"{directory}: both model-rank-* and model-pp-*-tp-* files: two checkpoints mixed")
        stray = sorted(p.name for p in directory.glob("*.safetensors") if p.name not in names)
        if stray:
            raise CheckpointError(f"{directory}: {stray[0]} is not a vLLM sharded_state file name "
                                  f"(model-rank-T-part-K.safetensors or model-pp-P-tp-T-part-K.safetensors)")
        pp = max(p for p, _ in files) + 1
        named_tp, vocab_tp = max(t for _, t in files) + 1, self._tp_from_vocab(files)
        if named_tp > vocab_tp > 0:  # a rank file beyond the TP rank 0's vocabulary shard implies
            rank, stage = min((t, p) for p, t in files if t >= vocab_tp)
            path = files[(stage, rank)][min(files[(stage, rank)])]
            padded = vllm_format.padded_vocab(self.cfg.vocab_size)
            raise CheckpointError(f"{path}: tensor rank {rank}, but rank 0's vocabulary shard implies tp={vocab_tp} "
                                  f"(the padded vocabulary of {padded} rows split evenly): a stray rank file, from "
                                  f"another checkpoint?")
        tp = max(named_tp, vocab_tp)
        pp_named = any(STAGE_FILE.match(n) for n in names)
        if pp_named and pp == 1:
            raise CheckpointError(f"{directory}: model-pp-* files for a single pipeline stage")
        for p in range(pp):
            for t in range(tp):
                if (p, t) not in files:
                    missing = vllm_format.vllm_file_name(t, 0, p, pp)
                    raise CheckpointError(f"{directory / missing}: missing (the other files are for tp={tp}, "
                                          f"pp={pp})")
                parts = sorted(files[(p, t)])
                if parts != list(range(len(parts))):
                    gap = next(i for i in range(len(parts) + 1) if i not in parts)
                    raise CheckpointError(f"{directory / vllm_format.vllm_file_name(t, gap, p, pp)}: missing "
                                          f"(rank files have parts {parts})")
        return tp, pp

    def _tp_from_vocab(self, files: dict[tuple[int, int], dict[int, Path]]) -> int:
        """The TP size rank 0's vocabulary shard implies (vLLM pads the vocabulary to a multiple of 64
        and splits it evenly), so missing trailing rank files read as missing, not as a smaller TP,
        and a stray one beyond it is named; 0 when it implies none."""
        from models.common import vllm_format

        padded = vllm_format.padded_vocab(self.cfg.vocab_size)
        for part in sorted(files.get((0, 0), {}).values()):
            for key, stored in read_safetensors_header(part).items():
                if key.endswith(("embed_tokens.weight", "lm_head.weight")) and stored.shape and stored.shape[0]:
                    rows = stored.shape[0]
                    return padded // rows if padded % rows == 0 else 0
        return 0  # unknown (rank 0 holds no vocabulary shard, or one of a size no TP gives): the names decide

    def _check_rank(self, parts: dict[int, Path], wanted: list, shapes: dict, tp_rank: int) -> dict[str, StoredTensor]:
        from models.common import vllm_format

        found: dict[str, StoredTensor] = {}
        where: dict[str, Path] = {}
        for part in sorted(parts):
            path = parts[part]
            for key, stored in read_safetensors_header(path).items():
                if key in found:
                    raise CheckpointError(f"{path}: tensor {key} is also in {where[key].name}")
                found[key], where[key] = stored, path
        # FP8 tensors named before the keys are compared (else: "unexpected tensor ..._scale_inv")
        check_unquantized_tensors(self.path, ((key, t.dtype) for key, t in found.items()), where.__getitem__)
        first = parts[0]
        expected = {t.key: t for t in wanted}
        for key in found:
            if key not in expected:
                raise CheckpointError(f"{where[key]}: unexpected tensor {key} (not in vLLM's {self.arch.name} "
                                      f"state at tp={self.tp}, pp={self.pp})")
        for key, t in expected.items():
            if key not in found:
                raise CheckpointError(f"{first}: tensor {key} missing (vLLM's strict loader needs it)")
            want = () if t.entry is None else vllm_format.shard_shape(t.entry, shapes, self.tp)
            if tuple(found[key].shape) != tuple(want):
                raise CheckpointError(f"{where[key]}: tensor {key} has shape {list(found[key].shape)}, expected "
                                      f"{list(want)} for tp rank {tp_rank} of {self.tp}")
        return found

    def locate(self, entry_param: str) -> tuple[int, str]:
        """``(pp_rank, key)`` of the stage that holds the weight-map entry ``entry_param`` (the first)."""
        for pp_rank, stage in enumerate(self.stages):
            for t in stage:
                if t.entry is not None and t.entry.param == entry_param:
                    return pp_rank, t.key
        raise CheckpointError(f"{self.path}: no vLLM tensor holds {entry_param}")


# ---------------------------------------------------------------------------- the MTP block (one rule, both paths)
def declared_mtp_layers(hf_config) -> int:
    """``mtp_num_hidden_layers`` of a config (a conditional-generation one keeps it in ``text_config``), 0 if none:
    real Qwen3.5 / Qwen3-Next configs declare their MTP block there, so a vLLM directory of them is known to lack
    one. Read by both paths' vLLM readers (torch-free)."""
    text = getattr(hf_config, "text_config", None)
    value = text.get("mtp_num_hidden_layers") if isinstance(text, dict) else getattr(text, "mtp_num_hidden_layers",
                                                                                     None)
    value = value if value is not None else getattr(hf_config, "mtp_num_hidden_layers", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def mtp_not_held_note(path: str, declared: int) -> str:
    """What a vLLM source whose config declares an MTP block says (both paths' readers)."""
    return (f"pmz: note: {path}: its config declares an MTP block (mtp_num_hidden_layers={declared}) that vLLM's "
            f"sharded_state does not hold (pmz convert --to vllm leaves it out): read without it")


def mtp_not_written_note(path: str, layers: int) -> str:
    """What ``--to vllm`` of a checkpoint with an MTP block says (both paths' writers)."""
    return (f"pmz convert: note: {path}: its MTP block (mtp.*, {layers} layer) is not written: vLLM's "
            f"sharded_state holds the main model only (vLLM's MTP draft model loads from an HF checkpoint)")
