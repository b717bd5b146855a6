"""Mutation check for layout-critical code: break one thing at a time in a copy, see which tests notice.

Each mutation below is a small, realistic regression (QKV / gate-up order, bias placement, vocab
padding, norm names, RoPE base, loss normalisation, ...). For each, the tracked files are copied to a
temporary directory, the mutation is applied there (the exact text must occur: a stale mutation is
reported, not skipped), and the named tests run against the copy with this project's venv. A
mutation is *caught* when those tests fail. Run it before resolving layout or converter work and
record the table it prints in docs/mutation.md (not part of CI: it takes ~15 minutes on 2 cores).

    .venv/bin/python tools/mutation_check.py [--only NAME ...] [--write docs/mutation.md]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    edits: tuple[tuple[str, str, str], ...]  # (file, exact old text, new text)
    tests: tuple[str, ...]  # pytest selections run against the mutated copy


CONTROL = Mutation("control", "no change: the copy must pass (else a 'caught' below means nothing)", (),
                   ("tests/test_microbatch.py", "tests/test_convert_megatron.py"))

MUTATIONS = (
    Mutation("kv-swap-megatron", "k/v swapped identically in the Megatron writer and reader",
             (("converters/layout/megatron.py",
               "parts = [q.reshape(ng, nh // ng * hd, *rest), k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)]",
               "parts = [q.reshape(ng, nh // ng * hd, *rest), v.reshape(ng, hd, *rest), k.reshape(ng, hd, *rest)]"),
              ("converters/layout/megatron.py",
               "q, k, v = grouped.split([nh // ng * hd, hd, hd], dim=1)\n"
               "    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]",
               "q, k, v = grouped.split([nh // ng * hd, hd, hd], dim=1)\n"
               "    return [t.reshape(-1, *rest).contiguous() for t in (q, v, k)]")),
             ("tests/test_convert_megatron.py", "tests/test_convert_roundtrip.py")),
    Mutation("gate-up-swap-megatron", "gate/up order swapped in Megatron linear_fc1 (writer and reader)",
             (("converters/layout/megatron.py",
               "        return torch.cat(list(tensors), dim=0)\n    if layout == VOCAB_PADDED:",
               "        return torch.cat(list(tensors)[::-1], dim=0)\n    if layout == VOCAB_PADDED:"),
              ("converters/layout/megatron.py", "return [t.contiguous() for t in full.split(rows, dim=0)]",
               "return [t.contiguous() for t in full.split(rows, dim=0)][::-1]")),
             # the torch path's tables: dense conversions take the copy path by default, so the
             # megatron-core oracle tests of both paths and the path-against-path ones must run
             ("tests/test_convert_megatron.py", "tests/test_convert_roundtrip.py",
              "tests/test_convert_qwen3_megatron.py")),
    Mutation("row-bias-split", "row-parallel o_proj bias split over TP in the weight map",
             (("models/common/weight_map.py", '(layer + "self_attn.o_proj.bias",), (rep,)',
               '(layer + "self_attn.o_proj.bias",), (col,)'),),
             ("tests/test_tp_parity.py", "tests/test_convert_megatron.py", "tests/test_vllm.py")),
    Mutation("megatron-vocab-padding", "Megatron vocab padded to divisible_by only (not times tp)",
             (("converters/layout/megatron.py", "    multiple = divisible_by * tp\n",
               "    multiple = divisible_by\n"),),
             ("tests/test_convert_megatron.py",)),
    Mutation("vllm-vocab-padding", "vLLM vocabulary padded to 128 instead of 64",
             (("models/common/vllm_format.py", "VOCAB_MULTIPLE = 64", "VOCAB_MULTIPLE = 128"),),
             ("tests/test_vllm.py",)),
    Mutation("te-norm-names", "torch_dist TE norm names swapped (input vs pre-MLP)",
             (("converters/layout/stages.py",
               'TE_NORM_ALIASES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",\n'
               '                   "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}',
               'TE_NORM_ALIASES = {"input_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",\n'
               '                   "pre_mlp_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"}'),),
             ("tests/test_convert_megatron.py",)),
    Mutation("rope-base-from-args", "rotary_base from Megatron args ignored (always 10000)",
             (("converters/formats/megatron_args.py", '"rope_theta": float(arg_value(args, "rotary_base", 10000))}',
               '"rope_theta": 10000.0}'),),
             ("tests/test_convert_megatron.py",)),
    Mutation("loss-per-microbatch-mean", "loss normalised per micro-batch instead of by the global token count",
             (("models/common/training/forward_backward.py", "per_token.sum() / self.global_count",
               "per_token.mean()"),),
             ("tests/test_pipeline.py",)),
    Mutation("rmsnorm-no-upcast", "RMSNorm computed in the activation dtype (no fp32 upcast)",
             (("parallel/fused_ops.py", "    h = x.float()\n", "    h = x\n"),),
             ("tests/test_tp_parity.py -k bf16",)),
    Mutation("microbatch-round-robin", "Karmarkar-Karp replaced by round-robin over sorted lengths",
             (("parallel/microbatch.py", "def karmarkar_karp(weights: Sequence[int], k: int) -> list[list[int]]:\n",
               "def karmarkar_karp(weights: Sequence[int], k: int) -> list[list[int]]:\n"
               "    groups = [[] for _ in range(k)]\n"
               "    for j, i in enumerate(sorted(range(len(weights)), key=lambda i: -weights[i])):\n"
               "        groups[j % k].append(i)\n"
               "    return groups\n\n\ndef _kk_unused(weights: Sequence[int], k: int) -> list[list[int]]:\n"),),
             ("tests/test_microbatch.py",)),
    Mutation("vllm-kv-replica", "vLLM target: replicated KV head chosen by rank % kv instead of rank // (n/kv)",
             (("parallel/sharding.py", "        head = rank // rep\n", "        head = rank % self.num_kv_heads\n"),),
             ("tests/test_sharding_rules.py", "tests/test_tp_parity.py", "tests/test_vllm.py")),
    Mutation("moe-expert-offset", "EP rank r loads experts from r*(E/ep)+1 (off by one expert)",
             (("models/common/weights.py", "entry.expert(ep_rank * local + j)",
               "entry.expert((ep_rank * local + j + 1) % entry.experts)"),),
             ("tests/test_moe.py",)),
    Mutation("moe-no-renormalise", "top-k weights never renormalised (norm_topk_prob ignored)",
             (("parallel/experts.py", "        weights = weights / weights.sum(dim=-1, keepdim=True)\n",
               "        weights = weights\n"),),
             ("tests/test_moe.py",)),
    Mutation("moe-expert-grads-over-replicas", "expert gradients reduced over all replicas instead of the edp group",
             (("parallel/grads.py", '    experts = [p for p in params if getattr(p, "expert_parallel", False)]\n',
               "    experts = []\n"),),
             ("tests/test_moe.py",)),
    Mutation("moe-aux-no-mask", "padding tokens counted in the load-balancing loss",
             (("models/common/blocks/moe.py", "        weight = st.mask[:, None]\n",
               "        weight = torch.ones_like(st.mask)[:, None]\n"),),
             ("tests/test_moe.py",)),
    Mutation("vl-qkv-contiguous", "vision qkv split over TP as contiguous rows of the fused tensor (not per q/k/v)",
             (("models/common/vision/weights.py",
               "    col, row, rep, fused = Split(0), Split(1), Replicated(), Fused(3)\n",
               "    col, row, rep, fused = Split(0), Split(1), Replicated(), Split(0)\n"),),
             ("tests/test_qwen2_vl.py",)),
    Mutation("vl-mrope-one-row", "every M-RoPE frequency section rotates by the temporal row",
             (("models/common/blocks/rope.py",
               "    return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)\n",
               "    return torch.cat([part[0] for i, part in enumerate(parts)], dim=-1)\n"),),
             ("tests/test_qwen2_vl.py",)),
    Mutation("vl-sp-feature-grad", "under SP the vision features' gradient is not summed over the TP ranks",
             (("models/common/vision/language.py",
               "            features = copy_to_group(features, groups.tp_group)  # bwd: the slices' gradients "
               "summed\n", "            pass\n"),),
             ("tests/test_qwen2_vl.py",)),
    Mutation("vl25-window-order-not-inverted", "Qwen2.5-VL's window reordering of the patches not undone after merging",
             (("models/common/blocks/vision.py", "            x = x[torch.argsort(window)]\n", "            pass\n"),),
             ("tests/test_qwen2_5_vl.py",)),
    Mutation("vl-vllm-qkv-per-block", "vLLM's vision qkv written per q/k/v block (our layout) instead of contiguous",
             (("models/common/vllm_format.py",
               "    if not any(isinstance(r, Fused) for r in entry.rules):\n        return entry\n",
               "    if True:\n        return entry\n"),),
             ("tests/test_vllm_vl.py",)),
    Mutation("moe-aux-carry-detached", "pipeline stages pass router statistics without their gradient",
             (("models/common/blocks/moe.py", "    return carry + torch.cat([assignments, probability, rows[None]])\n",
               "    return carry + torch.cat([assignments, probability.detach(), rows[None]])\n"),),
             ("tests/test_moe.py",)),
    Mutation("qk-norm-after-rope", "Qwen3's q/k norm applied after RoPE instead of before",
             (("models/common/blocks/attention.py",
               "        if self.q_norm is not None:\n            q, k = self.q_norm(q), self.k_norm(k)\n"
               "        q, k = apply_rotary(q, k, cos, sin)",
               "        q, k = apply_rotary(q, k, cos, sin)\n"
               "        if self.q_norm is not None:\n            q, k = self.q_norm(q), self.k_norm(k)\n"
               "        pass"),),
             ("tests/test_qwen3.py",)),
    Mutation("qk-norm-grad-not-summed", "q/k norm gradients not summed over TP (each rank saw only its heads)",
             (("models/common/blocks/attention.py", "            partial = groups.tp_size > 1\n",
               "            partial = False\n"),),
             ("tests/test_qwen3.py",)),
    Mutation("qwen3-moe-vllm-router-key", "Qwen3-MoE router written as mlp.gate in vLLM sharded_state (not vLLM's key)",
             (("models/common/vllm_format.py", '_ROUTER_IN_FUSED_MOE = frozenset({"qwen3_moe", "qwen3_vl_moe"})',
               '_ROUTER_IN_FUSED_MOE = frozenset({"qwen3_vl_moe"})'),),
             ("tests/test_qwen3_vllm.py",)),
    Mutation("grouped-gemm-expert-order", "grouped-GEMM experts read as column blocks of weight1 (not its "
             "[E_local, H, 2F/tp] view)",
             (("converters/layout/experts.py", "        return weight.reshape(local, hidden, -1)[slot].t()\n",
               "        cols = weight.shape[1] // local\n"
               "        return weight[:, slot * cols:(slot + 1) * cols].t()\n"),),
             ("tests/test_convert_qwen3_megatron.py",)),
    Mutation("fused-head-no-tp-grad-sum", "the fused LM head's hidden-state gradient not summed over the "
             "vocabulary slices of TP (plain TP)",
             (("parallel/lm_head_loss.py", "                dist.all_reduce(grad_x, group=group)\n",
               "                pass\n"),),
             ("tests/test_fused_loss.py",)),
    Mutation("fp8-scale-not-amax", "FP8 block scale from the block's mean magnitude instead of its amax",
             (("models/common/export/fp8.py", "scale_inv = blocks.abs().amax(dim=(-3, -1)) / FP8_MAX",
               "scale_inv = blocks.abs().mean(dim=(-3, -1)) / FP8_MAX"),),
             ("tests/test_fp8_export.py",)),
    Mutation("moe-aux-no-sequence-sum", "the load-balancing statistics summed over TP only, not over the "
             "cp/Ulysses ranks of a split sequence",
             (("models/common/blocks/moe.py",
               "    for group in (groups.tp_group, groups.cp_group, groups.ulysses_group):",
               "    for group in (groups.tp_group,):"),),
             ("tests/test_qwen3.py -k moe",)),
    Mutation("gdn-out-norm-not-shifted", "the Gated DeltaNet out_norm written to Megatron as HF's value (no minus "
             "one; reading adds none back, so our own round trips stay bitwise)",
             (("converters/layout/megatron.py", "return shifted(tensors[0], -1.0)", "return shifted(tensors[0], 0.0)"),
              ("converters/layout/megatron.py", "hf = shifted(full, 1.0)", "hf = shifted(full, 0.0)")),
             ("tests/test_convert_hybrid.py", "tests/test_copy_path_hybrid.py")),
    Mutation("gdn-in-proj-beta-alpha", "Megatron in_proj's beta and alpha components swapped (writer and reader)",
             (("models/common/hybrid/weights.py", 'IN_PROJ_PARTS = ("query", "key", "value", "z", "beta", "alpha")',
               'IN_PROJ_PARTS = ("query", "key", "value", "z", "alpha", "beta")'),),
             ("tests/test_convert_hybrid.py",)),
    Mutation("gated-qkv-gate-first", "gated linear_qkv with each group's gates before its queries (writer, "
             "reader and row ranges alike)",
             (("converters/layout/megatron.py",
               "parts = [heads[:, :, 0].reshape(ng, per * hd, *rest), heads[:, :, 1].reshape(ng, per * hd, *rest),",
               "parts = [heads[:, :, 1].reshape(ng, per * hd, *rest), heads[:, :, 0].reshape(ng, per * hd, *rest),"),
              ("converters/layout/megatron.py",
               "queries, gates, k, v = full.reshape(ng, (2 * per + 2) * hd, *rest)",
               "gates, queries, k, v = full.reshape(ng, (2 * per + 2) * hd, *rest)"),
              ("converters/layout/megatron.py", "for g in range(ng) for j in range(per) for part in (0, 1)]",
               "for g in range(ng) for j in range(per) for part in (1, 0)]")),
             ("tests/test_convert_hybrid.py", "tests/test_copy_path_hybrid.py")),
    Mutation("tower-qkv-not-per-head", "Qwen3.5's vision qkv written to Megatron as HF's [q; k; v] (no per-head "
             "reorder; reading undoes none, so our own round trips stay bitwise)",
             (("converters/layout/hybrid.py", "((3 * h + part) * hd, (3 * h + part + 1) * hd)",
               "((part * heads + h) * hd, (part * heads + h + 1) * hd)"),),
             ("tests/test_convert_hybrid_vision.py", "tests/test_copy_path_hybrid.py")),
    Mutation("copy-out-norm-not-shifted", "the copy path's out_norm bytes computed without the minus one",
             (("converters/layout/megatron.py", 'r = struct.pack("<f", v + delta)  # fp32 result',
               'r = struct.pack("<f", v + 0.0)  # fp32 result'),),
             ("tests/test_copy_path_hybrid.py", "tests/test_convert_hybrid.py -k bridges")),
    Mutation("vllm-tower-qkv-contiguous", "Qwen3.5's vision qkv split over vLLM's TP ranks as contiguous rows "
             "(not each rank's q, k and v)",
             (("models/common/vllm_format.py", '_TOWER_RULES = ((".attn.qkv.", Fused(3)),',
               '_TOWER_RULES = ((".attn.qkv.", Split(0)),'),),
             ("tests/test_vllm_hybrid_vision.py",)),
    Mutation("gdn-rounds-shortest-first", "packed sequences laid shortest first, so the state scan carries the "
             "wrong sequences into the next round",
             (("parallel/gated_delta_chunk.py", "seqs = sorted(sizes, key=lambda j: -sizes[j])",
               "seqs = sorted(sizes, key=lambda j: sizes[j])"),),
             ("tests/test_gated_delta_rule.py",)),
)


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


def run_mutation(m: Mutation, python: str) -> tuple[str, float, str]:
    """('caught' | 'MISSED' | 'stale', seconds, detail)."""
    with tempfile.TemporaryDirectory(prefix="pmz-mutant-") as tmp:
        for rel in tracked_files():
            dst = Path(tmp) / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst)
        if (ROOT / ".venv-vllm").exists():  # the vLLM client tests look for it beside the tests
            os.symlink(ROOT / ".venv-vllm", Path(tmp) / ".venv-vllm")
        for rel, old, new in m.edits:
            path = Path(tmp) / rel
            text = path.read_text()
            if text.count(old) != 1:
                return "stale", 0.0, f"{rel}: the text to mutate occurs {text.count(old)} times"
            path.write_text(text.replace(old, new))
        env = dict(os.environ, PYTHONPATH=tmp, PYTHONDONTWRITEBYTECODE="1")
        start = time.perf_counter()
        failed = []
        for selection in m.tests:
            proc = subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *selection.split()],
                                  cwd=tmp, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                failed.append(selection)
                break  # one catching selection is enough
        seconds = time.perf_counter() - start
        return ("caught" if failed else "MISSED"), seconds, ", ".join(failed) or "all selected tests passed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--only", nargs="*", metavar="NAME",
                        help=f"mutation names to run (default: all; the control always runs): "
                             f"{', '.join(m.name for m in MUTATIONS)}")
    parser.add_argument("--write", metavar="PATH", help="also write the result table to this markdown file")
    args = parser.parse_args()
    python = str(ROOT / ".venv" / "bin" / "python")
    chosen = [CONTROL] + [m for m in MUTATIONS if not args.only or m.name in args.only]
    rows = []
    for m in chosen:
        verdict, seconds, detail = run_mutation(m, python)
        if m is CONTROL:
            if verdict != "MISSED":
                print(f"control run failed on an unmutated copy: {detail}", file=sys.stderr)
                return 2
            verdict = "passes"
        rows.append(f"| {m.name} | {m.what} | **{verdict}** | {detail} | {seconds:.0f} s |")
        print(rows[-1], flush=True)
    table = "\n".join(["| mutation | what | result | caught by | time |", "|---|---|---|---|---|", *rows])
    if args.write:
        Path(args.write).write_text(
            "# Mutation check (`tools/mutation_check.py`)\n\nEach row: one deliberate regression applied to a "
            "copy of the tree, and the first test selection that failed on it. Last run: "
            f"{time.strftime('%Y-%m-%d')}.\n\n{table}\n")
    return 0 if all("**caught**" in r for r in rows[1:]) else 1


if __name__ == "__main__":
    sys.exit(main())
