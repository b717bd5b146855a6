"""The sizes of an HF config against the global shapes a ``torch_dist`` checkpoint lists (``.metadata``), checked
before anything sized by the config is built (``DistCheckpoint`` calls it first). Torch-free."""

from __future__ import annotations

from typing import Any, Mapping

from converters.formats.megatron_bridge import check_bridge_vision
from converters.layout.model import BRIDGE_TEXT_PREFIX, is_qwen3_vl
from models.common.errors import CheckpointError
from models.common.hybrid.vision import TOWER_DEEPSTACK, TOWER_LAYERS

# torch_dist entries that are not model weights: skipped by both paths (their bytes are never read)
NON_MODEL_PREFIXES = ("optimizer.", "rng_state", "rerun_state")
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"


def is_model_key(key: str) -> bool:
    return not key.startswith(NON_MODEL_PREFIXES)


def check_config_against_dist(cfg: Any, shapes: Mapping[str, tuple], config_path: str, where: str) -> None:
    """The sizes of an HF config (``cfg``: ModelConfig) against the global shapes of the tensors a
    torch_dist checkpoint holds (name -> shape), before per-layer tables are built from the config.
    A vision-language model's text tensors (and a Gated DeltaNet hybrid's conditional-generation checkpoint's,
    ``cfg.carried``: Bridge's ``Qwen3VLModel``) are looked for under Megatron-Bridge's ``language_model.``.

    One CheckpointError naming the config file, the config values and the tensor shapes."""
    model = {k: tuple(s) for k, s in shapes.items() if is_model_key(k)}
    vision = getattr(cfg, "vision", None)
    pre = BRIDGE_TEXT_PREFIX if vision is not None or getattr(cfg, "carried", ()) else ""
    emb_key, out_key, layers = pre + EMBEDDING, pre + OUTPUT, pre + "decoder.layers."
    adapters = sorted(k for k in model if ".adapter." in k or "lora" in k.lower())
    if adapters:
        only = "" if emb_key in model else " (an adapter-only checkpoint: the base weights are not in it)"
        raise CheckpointError(f"{where}: LoRA adapter tensors ({adapters[0]}, ... {len(adapters)} in all){only}; "
                              f"pmz converts full models: merge the adapters first or convert the base checkpoint")
    if not any(k.startswith((pre + "embedding.", pre + "decoder.")) for k in model):
        groups = sorted({k.split("/", 1)[0].split(".", 1)[0] for k in shapes})
        raise CheckpointError(f"{where}: .metadata lists no model tensors ({pre}embedding.*, {pre}decoder.*), only "
                              f"{', '.join(groups[:6]) or 'nothing'}")
    problems = []

    def bad(claim: str, key: str, detail: str) -> None:
        problems.append(f"{claim}, but {key} has shape {model[key]}{detail}")

    L, H = cfg.num_hidden_layers, cfg.hidden_size
    index = [(k, k[len(layers):].split(".", 1)[0]) for k in model if k.startswith(layers)]
    stacked = sorted(k for k, i in index if not i.isdigit())
    numbered = {int(i) for _, i in index if i.isdigit()}
    qkv = _find(model, "self_attention.linear_qkv.weight", layers)
    if stacked:
        key = qkv if qkv in stacked else stacked[0]
        if model[key][0] != L:
            bad(f"num_hidden_layers={L}", key, f" ({model[key][0]} stacked layers)")
    elif len(numbered) != L or (numbered and max(numbered) != L - 1):
        problems.append(f"num_hidden_layers={L}, but .metadata holds {len(numbered)} numbered layer(s) "
                        f"({layers}0..{max(numbered) if numbered else -1})")
    if emb_key in model:
        rows, cols = model[emb_key][0], model[emb_key][-1]
        if cols != H:
            bad(f"hidden_size={H}", emb_key, "")
        elif rows < cfg.vocab_size:
            bad(f"vocab_size={cfg.vocab_size}", emb_key, f" ({rows} rows, fewer than the vocabulary)")
    if out_key in model and model[out_key][0] == 1:
        problems.append(f"{out_key} has shape {model[out_key]}: a value head (a verl critic or reward model), not "
                        f"a language-model head")
    nh, ng, hd, ffn = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    gate = 2 if getattr(cfg, "attn_output_gate", False) else 1  # the hybrids' query output gate per head
    if qkv and model[qkv][-2:] != ((gate * nh + 2 * ng) * hd, H):
        gated = " with an output gate per head" if gate == 2 else ""
        bad(f"num_attention_heads={nh}{gated}, num_key_value_heads={ng}, head_dim={hd}, hidden_size={H} imply "
            f"{(gate * nh + 2 * ng) * hd} qkv rows of {H}", qkv, "")
    proj = _find(model, "self_attention.linear_proj.weight", layers)
    if proj and model[proj][-1] != nh * hd:
        bad(f"num_attention_heads={nh}, head_dim={hd} imply {nh * hd} attention-output columns", proj, "")
    fc1 = _find(model, "mlp.linear_fc1.weight", layers)
    if fc1 and model[fc1][-2] != 2 * ffn:
        bad(f"intermediate_size={ffn} implies {2 * ffn} gate+up rows", fc1, "")
    fc2 = _find(model, "mlp.linear_fc2.weight", layers)
    if fc2 and model[fc2][-1] != ffn:
        bad(f"intermediate_size={ffn}", fc2, "")
    if problems:
        raise CheckpointError(f"{config_path} does not describe the checkpoint {where}: {'; '.join(problems[:4])}")
    if vision is not None:  # Qwen3-VL: Bridge's Qwen3VLModel tower (vision_model.*); Qwen2(.5)-VL: visual.*
        check = check_qwen3_vl_tower if is_qwen3_vl(cfg) else check_bridge_vision
        check(vision, model, config_path, f"{where}/.metadata")


def _find(model: Mapping[str, tuple], suffix: str, layers: str = "decoder.layers.") -> str | None:
    """The stacked key ``<layers><suffix>``, else layer 0's."""
    for key in (f"{layers}{suffix}", f"{layers}0.{suffix}"):
        if key in model:
            return key
    return None


def check_qwen3_vl_tower(vis: Any, shapes: Mapping[str, tuple], config_path: str, metadata: str) -> None:
    """Qwen3-VL's tower in a torch_dist checkpoint (Bridge's ``Qwen3VLModel``: ``vision_model.*``, blocks and
    DeepStack mergers stacked) against ``vision_config``, before anything sized by it is listed: the stacked block
    count against ``depth``, the stacked DeepStack mergers against ``deepstack_visual_indexes`` (every tensor's
    shape is then checked with the rest). One CheckpointError naming the file, the tensor and the numbers."""
    if any(k.startswith("visual.") for k in shapes):
        raise CheckpointError(f"{metadata}: the vision tower is stored as visual.* (transformers' names, Bridge's "
                              f"Qwen2.5-VL layout); Megatron-Bridge's Qwen3-VL keeps it as vision_model.*")
    for stack, key, want, what in (
            (TOWER_LAYERS, "self_attention.linear_qkv.weight", vis.depth, "vision_config.depth"),
            (TOWER_DEEPSTACK, "linear_fc1.weight", vis.deepstack_count,
             f"vision_config.deepstack_visual_indexes={list(vis.deepstack_visual_indexes)}")):
        key = stack + key
        got = shapes.get(key)
        per_block = sorted(k for k in shapes if k.startswith(stack) and k[len(stack):].split(".", 1)[0].isdigit())
        if per_block:
            raise CheckpointError(f"{metadata}: {per_block[0]}: the tower's modules are stacked in Bridge's "
                                  f"Qwen3VLModel checkpoints ({key} [n, ...]), not numbered")
        if got is None and want:
            raise CheckpointError(f"{metadata}: missing tensor {key} ({what}: {want} stacked)")
        if got is not None and got[0] != want:
            raise CheckpointError(f"{config_path}: {what} implies {want} stacked, but {metadata} has {key} of shape "
                                  f"{tuple(got)}")
