"""The ``vramwidget`` command line.

    vramwidget estimate MODEL [setup options] [--json] [--units gib|gb]
    vramwidget validate [CASES.jsonl] [--json]
    vramwidget measure ...                 (see ``vramwidget measure --help``)
    vramwidget presets                     (alias: ``vramwidget models``)

MODEL is anything :func:`vramwidget.model.architecture.load` accepts: a preset name
(``llama-3.1-8b``), a config.json path or folder, a Hub id, or a parameter count (``7B``).

Bad input never prints a traceback: one line ``vramwidget: error: <message>`` on stderr
and exit code 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from .errors import VramError
from .inputs import shown
from .units import GB, GIB, fmt_bytes

PROG = "vramwidget"

#: setup options of ``estimate``: (flag, TrainingSetup field, kind, help)
#: kind: "choice" (validated by TrainingSetup, which also knows the aliases), "int", "float", "list"
_SETUP_OPTIONS = (
    ("--method", "method", "choice", "training method"),
    ("--precision", "precision", "choice", "weights/compute precision"),
    ("--quantization", "quantization", "choice", "quantization of the frozen base"),
    ("--quantized-groups", "quantized_groups", "list", "module groups to quantize, comma-separated"),
    ("--optimizer", "optimizer", "choice", "optimizer"),
    ("--optimizer-state-dtypes", "optimizer_state_dtypes", "list",
     "dtype of each optimizer state, comma-separated (e.g. bf16,fp32)"),
    ("--gradient-checkpointing", "gradient_checkpointing", "choice", "activation checkpointing"),
    ("--attn-implementation", "attn_implementation", "choice", "attention implementation"),
    ("--batch-size", "batch_size", "int", "micro-batch size (default 1)"),
    ("--seq-len", "seq_len", "int", "sequence length in tokens (default 2048); an encoder-decoder's input length"),
    ("--target-len", "target_len", "int", "an encoder-decoder's target length in tokens, what its decoder, head "
                                          "and loss read (T5, BART; default: the sequence length)"),
    ("--grad-accum-steps", "grad_accum_steps", "int", "gradient accumulation steps (default 1)"),
    ("--lora-r", "lora_r", "int", "LoRA rank (default 16)"),
    ("--lora-alpha", "lora_alpha", "float", "LoRA alpha (default 32)"),
    ("--lora-dropout", "lora_dropout", "float", "LoRA dropout in [0, 1) (default 0)"),
    ("--lora-targets", "lora_targets", "list", "LoRA target modules, comma-separated, or all-linear "
                                               "(default: every linear layer of the blocks)"),
    ("--trainable-layers", "trainable_layers", "int", "with --method freeze: how many last layers train"),
    ("--backend", "backend", "choice", "auto (analytic where modelled, else traced), analytic or trace"),
    ("--stack", "stack", "choice", "training stack whose defaults and code paths to assume (default hf)"),
    ("--loss", "loss", "choice", "cross-entropy implementation"),
    ("--loss-chunks", "loss_chunks", "int", "with --loss chunked: number of chunks (default 8)"),
    ("--lora-variant", "lora_variant", "choice", "LoRA or DoRA"),
    ("--modules-to-save", "modules_to_save", "list", "modules trained in full beside the adapters "
                                                     "(lm_head, embed_tokens)"),
    ("--galore-rank", "galore_rank", "int", "GaLore projection rank (default 128)"),
    ("--versions", "versions", "versions", "library releases, e.g. bitsandbytes=0.41.1,transformers=4.40 "
                                           "(default: current releases)"),
)

#: on/off setup switches: (flag, TrainingSetup field, help)
_SETUP_SWITCHES = (
    ("--activation-offloading", "activation_offloading", "move saved activations to the CPU (torchtune)"),
    ("--optimizer-in-backward", "optimizer_in_backward", "step each parameter as its gradient is ready"),
    ("--packing", "packing", "packed sequences with varlen attention (no padding)"),
    ("--compile", "compile", "torch.compile (needs --gradient-checkpointing full)"),
    ("--tf32", "tf32", "fp32 matmuls on TF32 tensor cores (PyTorch's default is off); changes the time only"),
)


#: setup fields the command line does not offer (every other ``training.FIELDS`` entry is a
#: flag: hand-written above, or derived by :func:`derived_setup_flags`)
_NOT_FLAGS = ("images_per_sample", "image_patches", "allocator")


def derived_setup_flags() -> List[tuple]:
    """(flag, field, kind, help) for each ``training.FIELDS`` entry that has no hand-written
    flag above: ``--the-field-name``, typed by the field's kind (choice, int, float, list, or
    bool: ``--name`` / ``--no-name``), its help the field's description and default.  A knob
    declared in FIELDS is on the command line without an edit here."""
    from .training import FIELDS

    written = ({d for _, d, _, _ in _SETUP_OPTIONS} | {d for _, d, _ in _SETUP_SWITCHES}
               | {"double_quant", "prepare_kbit"} | set(_NOT_FLAGS))
    kinds = {"choice": "choice", "int": "int", "number": "float", "names": "list", "bool": "bool"}
    out = []
    for name, f in FIELDS.items():
        if name in written:
            continue
        default = ("on" if f.default else "off") if f.kind == "bool" else f.default
        text = f"{f.doc} (default {default})" if default not in (None, ()) else f.doc
        out.append(("--" + name.replace("_", "-"), name, kinds.get(f.kind, "text"), text))
    return out


def _add_derived_setup_flags(parser: Any) -> None:
    """The flags of :func:`derived_setup_flags` on ``parser`` (``estimate`` and ``fit``)."""
    from .training import CHOICES

    for flag, dest, kind, text in derived_setup_flags():
        if kind == "bool":
            parser.add_argument(flag, dest=dest, action="store_const", const=True, default=None, help=text)
            parser.add_argument("--no-" + flag[2:], dest=dest, action="store_const", const=False,
                                help=f"the opposite of {flag}")
        elif kind == "choice":
            parser.add_argument(flag, dest=dest, default=None, help=text,
                                metavar="{" + ",".join(c for c, _ in CHOICES[dest]) + "}")
        else:
            parser.add_argument(flag, dest=dest, default=None, help=text,
                                **{"int": dict(type=_int_arg, metavar="N"), "float": dict(type=_float_arg, metavar="X"),
                                   "list": dict(metavar="A,B")}.get(kind, dict(metavar="TEXT")))


class _UsageError(Exception):
    """A bad command line (argparse's complaint, turned into one line)."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting (one line, exit 2)."""

    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(message)


def _int_arg(text: str) -> int:
    s = text.strip()
    if len(s) > 40:   # more digits than any real count (2**53 has 16); int() of 5,000 digits raises
        raise argparse.ArgumentTypeError(f"must be a whole number of at most 40 digits, got {shown(text)}")
    try:
        return int(s)
    except ValueError:
        pass
    try:
        f = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {shown(text)}") from None
    if f != f or f in (float("inf"), float("-inf")) or f != int(f):
        raise argparse.ArgumentTypeError(f"must be a whole number, got {shown(text)}")
    return int(f)


def _versions_arg(text: str) -> Dict[str, str]:
    out = {}
    for part in text.split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise argparse.ArgumentTypeError(f"expected PACKAGE=VERSION, got {part.strip()!r}")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _float_arg(text: str) -> float:
    try:
        return float(text.strip())  # nan/inf pass through: TrainingSetup names the field
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {shown(text)}") from None


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every subcommand."""
    from .training import CHOICES, QUANT_GROUPS, STATE_DTYPES

    parser = _Parser(prog=PROG, description="How much GPU memory a training step needs, and where it goes.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    est = sub.add_parser("estimate", help="estimate the memory of one training step",
                         description="Estimate the GPU memory of one training step of MODEL.")
    est.add_argument("model", metavar="MODEL", nargs="?", default=None,
                     help="a preset name (see `vramwidget presets`), a config.json path, a Hub id, or a "
                          "parameter count like 7B; may be left out with --from when the file names the model")
    est.add_argument("--from", dest="from_config", default=None, metavar="FILE",
                     help="read the setup from your training config: HF TrainingArguments/TRL JSON, axolotl, "
                          "torchtune, LLaMA-Factory or LitGPT YAML, a DeepSpeed JSON or an accelerate YAML; "
                          "options given here override the file")
    for flag, dest, kind, text in _SETUP_OPTIONS:
        if kind == "choice":
            est.add_argument(flag, dest=dest, default=None, metavar="{" + ",".join(c for c, _ in CHOICES[dest]) + "}",
                             help=text)
        elif kind == "int":
            est.add_argument(flag, dest=dest, default=None, type=_int_arg, metavar="N", help=text)
        elif kind == "float":
            est.add_argument(flag, dest=dest, default=None, type=_float_arg, metavar="X", help=text)
        elif kind == "versions":
            est.add_argument(flag, dest=dest, default=None, type=_versions_arg, metavar="PKG=VER,...", help=text)
        else:
            extra = ""
            if dest == "quantized_groups":
                extra = f" (allowed: {', '.join(QUANT_GROUPS)})"
            elif dest == "optimizer_state_dtypes":
                extra = f" (allowed: {', '.join(STATE_DTYPES)})"
            est.add_argument(flag, dest=dest, default=None, metavar="A,B", help=text + extra)
    est.add_argument("--no-double-quant", dest="double_quant", action="store_const", const=False, default=None,
                     help="4-bit quantization without double quantization of the constants")
    est.add_argument("--double-quant", dest="double_quant", action="store_const", const=True,
                     help="4-bit quantization with double quantization (the default)")
    est.add_argument("--prepare-kbit", dest="prepare_kbit", action="store_const", const=True, default=None,
                     help="prepare_model_for_kbit_training: upcast the non-quantized parameters to fp32")
    for flag, dest, text in _SETUP_SWITCHES:
        est.add_argument(flag, dest=dest, action="store_const", const=True, default=None, help=text)
    _add_derived_setup_flags(est)
    est.add_argument("--gpu", dest="gpu", default=None, metavar="GPU",
                     help="a GPU from the catalogue (e.g. H100-80GB): the step time, tokens/s, MFU and a run's "
                          "cost on it (with --inference: the fit check)")
    est.add_argument("--tokens", dest="tokens", default=None, type=_float_arg, metavar="N",
                     help="with --gpu: the run's cost for N training tokens (default 1e9)")
    est.add_argument("--usd-per-gpu-hour", dest="usd_per_gpu_hour", default=None, type=_float_arg, metavar="X",
                     help="with --gpu: the price per GPU-hour (default: the catalogue's indicative on-demand price)")
    add_parallel_arguments(est.add_argument_group(
        "several GPUs (the estimate is then per GPU, the worst one; with --from these override the file)"))
    est.add_argument("--json", action="store_true", help="print the estimate as JSON")
    est.add_argument("--units", choices=("gib", "gb"), default="gib",
                     help="units of the component table: GiB (2**30 B, default) or GB (10**9 B)")
    est.add_argument("--inference", action="store_true",
                     help="estimate inference (weights, KV cache, prefill) instead of a training step; "
                          "the options below apply")
    from .inference import estimate as inference

    inference.add_arguments(est.add_argument_group("inference (with --inference)"), model=False)

    inf = sub.add_parser("infer", help="estimate inference memory: weights in any format, KV cache, serving",
                         description="GPU memory of running MODEL for inference.")
    inference.add_arguments(inf)
    add_split_arguments(inf.add_argument_group("generate() split over several GPUs"))

    fit_p = sub.add_parser("fit", help="what fits a GPU: largest batch, longest sequence, fewest GPUs, and "
                                       "the changes that make a setup fit",
                           description="Answer 'does it fit, and what do I change' for MODEL on a GPU.")
    add_fit_arguments(fit_p)

    val = sub.add_parser("validate", help="compare estimates with measured training steps",
                         description="Estimate each case of a validation file (JSONL) and compare with its "
                                     "measurement. Without CASES: the built-in H200 cases.")
    val.add_argument("cases", nargs="?", default=None, metavar="CASES.jsonl",
                     help="cases in the validation format (default: the built-in H200 cases)")
    val.add_argument("--json", action="store_true", help="print a JSON list of {id, predicted, error}")
    val.add_argument("--backend", default="analytic", choices=("analytic", "trace", "auto"),
                     help="analytic (default), trace (needs the [trace] extra) or auto")

    sub.add_parser("measure", help="measure real training steps on a GPU (see `vramwidget measure --help`)",
                   add_help=False)
    mi = sub.add_parser("measure-inference", help="measure real generate() runs on a GPU (cases with 'inference')",
                        description="Run prefill + generate() for each case of CASES.jsonl and append records "
                                    "that `vramwidget validate` reads.")
    mi.add_argument("cases", metavar="CASES.jsonl")
    mi.add_argument("--out", required=True, metavar="OUT.jsonl")
    mi.add_argument("--device", default="cuda")
    mi.add_argument("--snapshots", metavar="DIR", help="folder for each case's generate() allocator snapshot, "
                                                      "<id>.pickle (CUDA only)")

    for name in ("presets", "models"):
        p = sub.add_parser(name, help="list the built-in model presets" + (" (alias of presets)" if name == "models"
                                                                            else ""))
        p.add_argument("--json", action="store_true", help="print a JSON list")
    return parser


# ----------------------------------------------------------------------------------------
# estimate
# ----------------------------------------------------------------------------------------

def setup_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """The setup keywords given on the command line (unset ones keep TrainingSetup's defaults)."""
    kw: Dict[str, Any] = {}
    for _, dest, _, _ in _SETUP_OPTIONS:
        v = getattr(args, dest)
        if v is not None:
            kw[dest] = v
    for dest in (("double_quant", "prepare_kbit") + tuple(d for _, d, _ in _SETUP_SWITCHES)
                 + tuple(d for _, d, _, _ in derived_setup_flags())):
        v = getattr(args, dest, None)
        if v is not None:
            kw[dest] = v
    return kw


def inventory(arch) -> Dict[str, Dict[str, Any]]:
    """The architecture's parameter tensors grouped by role: role -> {params, tensors}."""
    out: Dict[str, Dict[str, Any]] = {}
    for t in arch.tensors:
        entry = out.setdefault(t.role, {"group": t.group, "params": 0, "tensors": []})
        entry["params"] += t.numel
        entry["tensors"].append({"name": t.name, "shape": list(t.shape), "count": t.repeat, "numel": t.numel,
                                 "linear": t.linear, "module": t.module})
    return out


def estimate_json(arch, est, tokens: Optional[float] = None,
                  usd_per_gpu_hour: Optional[float] = None) -> Dict[str, Any]:
    """The JSON object ``estimate --json`` prints (with ``time`` and ``run_cost`` when a GPU is set)."""
    d = est.to_dict()
    if est.step_seconds is not None:
        d["run_cost"] = est.run_cost(tokens=tokens or DEFAULT_RUN_TOKENS, usd_per_gpu_hour=usd_per_gpu_hour)
    if arch is not None:
        a = arch.to_dict()
        a.pop("tensors", None)
        d["architecture"] = a
        d["inventory"] = inventory(arch)
    else:   # traced: no analytic architecture, the transformers model was built instead
        d["architecture"] = {"name": est.model_name, "backend": "trace"}
        d["inventory"] = {}
    d["phases_gib"] = {k: round(v / GIB, 4) for k, v in est.phases_bytes.items()}
    d["phases_gb"] = {k: round(v / GB, 4) for k, v in est.phases_bytes.items()}
    d["device_total_gib"] = round(est.device_total_bytes / GIB, 3)
    d["device_total_gb"] = round(est.device_total_bytes / GB, 3)
    if est.gpu is not None:
        from .fit.verdict import verdict as judge

        d["verdict"] = judge(est, est.gpu)
    return d


#: the run whose cost ``estimate --gpu`` prints when --tokens is not given
DEFAULT_RUN_TOKENS = 1e9


def _fmt_seconds(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:,.3g} s" if x < 1000 else f"{x:,.0f} s"


def format_time(est, tokens: Optional[float] = None, usd_per_gpu_hour: Optional[float] = None) -> List[str]:
    """The step-time and run-cost lines of ``estimate --gpu`` and ``fit`` (empty without a GPU)."""
    if est.step_seconds is None:
        return []
    b = est.time_breakdown
    ph = b["phases_seconds"]
    parts = ", ".join(f"{k.replace('_', ' ')} {_fmt_seconds(v)}" for k, v in ph.items())
    lines = [f"step time         {_fmt_seconds(est.step_seconds)} on {est.gpu.name} ({parts})",
             f"throughput        {est.tokens_per_second:,.0f} tokens/s, MFU {est.mfu * 100:.0f}%",
             f"dominated by      {b['dominant']} ({b['dominant_share'] * 100:.0f}% of the step)"]
    c = est.run_cost(tokens=tokens or DEFAULT_RUN_TOKENS, usd_per_gpu_hour=usd_per_gpu_hour)
    cost = (f", ${c['dollars']:,.2f} at ${c['usd_per_gpu_hour']:g}/GPU-hour ({c['price_source']})"
            if c["dollars"] is not None else " (no price known: give --usd-per-gpu-hour)")
    on = f" on {c['gpus']} GPUs ({c['gpu_hours']:,.1f} GPU-hours)" if c["gpus"] > 1 else ""
    lines.append(f"run cost          {c['tokens']:.3g} tokens: {c['steps']:,} steps, {c['hours']:,.2f} h{on}" + cost)
    for n in b.get("notes") or []:
        lines.append(f"                  ({n})")
    return lines


_PHASE_LABELS = {
    "after_load": "after load",
    "forward": "end of forward",
    "backward": "backward peak",
    "optimizer_step": "optimizer step",
    "first_step": "first step (states created)",
    "persistent": "between steps",
}


def _count(n: Optional[int]) -> str:
    if n is None:
        return "unknown"
    for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n:,} ({n / div:.3g}{suf})"
    return f"{n:,}"


def _group_formula(node) -> str:
    if node.formula:
        return node.formula
    kids = node.children
    if len(kids) == 1:
        return _group_formula(kids[0])
    if kids:
        big = max(kids, key=lambda k: k.bytes)
        return f"{len(kids)} parts, largest {big.name}: {_group_formula(big)}"
    return ""


def format_verdict(est, model: str = "MODEL") -> List[str]:
    """The ``verdict`` lines of ``estimate --gpu``: the device total on the GPU (reserved + its
    own CUDA context) against what CUDA reports as its total, with the margin and the
    estimator's own uncertainty (:mod:`vramwidget.fit.verdict`)."""
    from .fit.verdict import verdict as judge

    v = judge(est, est.gpu)
    room = v["headroom_bytes"]
    word = {"fits": "FITS", "tight": "TIGHT", "does_not_fit": "DOES NOT FIT"}[v["state"]]
    out = [f"verdict           {word} on {v['gpu']}: needs {fmt_bytes(v['need_bytes'])} of "
           f"{fmt_bytes(v['capacity_bytes'])} CUDA total ({fmt_bytes(abs(room))} {'free' if room >= 0 else 'over'}, "
           f"{abs(v['headroom_pct']):.0f}%; uncertainty ±{fmt_bytes(v['band_bytes'])})",
           f"{'':18}({v['context_note']})"]
    if v.get("allocator_note"):
        out.append(f"{'':18}({v['allocator_note']})")
    if v["state"] != "fits":
        out.append(f"{'':18}`vramwidget fit {model} --gpu \"{v['gpu']}\" ...` lists changes that fit, "
                   "with their cost")
    return out


def format_estimate(arch, est, units: str = "gib", tokens: Optional[float] = None,
                    usd_per_gpu_hour: Optional[float] = None) -> str:
    """The table ``estimate`` prints."""
    unit_div, unit_name = (GIB, "GiB") if units == "gib" else (GB, "GB")
    s = est.setup
    lines: List[str] = []
    if arch is None:   # traced (backend='trace'): the transformers model was built, not a family module
        lines.append(f"model             {est.model_name}")
        lines.append("                  traced: one training step of the transformers model on fake tensors")
    else:
        title = arch.name + (f"  ({arch.hub_id})" if arch.hub_id and arch.hub_id != arch.name else "")
        lines.append(f"model             {title}")
        lines.append(f"                  {arch.model_type}, h={arch.hidden_size}, L={arch.num_layers}, "
                     f"heads={arch.num_heads}/{arch.num_kv_heads} kv, V={arch.vocab_size}"
                     + (f", {arch.num_experts} experts (top-{arch.experts_per_token})" if arch.num_experts else ""))
    lines.append(f"params total      {_count(est.params_total)}"
                 + ("" if arch is None or arch.exact else "  (stated count)"))
    lines.append(f"params trainable  {_count(est.params_trainable)}")
    setup_bits = [f"{s['method']}", f"{s['precision']}"]
    if s.get("quantization") not in (None, "none"):
        setup_bits.append(f"{s['quantization']}{'+dq' if s.get('double_quant') else ''}")
    setup_bits += [s["optimizer"], f"checkpointing {s['gradient_checkpointing']}", s["attn_implementation"],
                   f"batch {s['batch_size']} x seq {s['seq_len']}"]
    if s.get("grad_accum_steps", 1) > 1:
        setup_bits.append(f"accum {s['grad_accum_steps']}")
    if s["method"] in ("lora", "qlora"):
        setup_bits.append(f"LoRA r={s['lora_r']}")
    lines.append(f"setup             {', '.join(setup_bits)}")
    lines.append("")
    lines.append(f"{'phase':30} {'GiB':>10} {'GB':>10}")
    for k, v in est.phases_bytes.items():
        mark = "  <- peak" if k == est.peak_phase else ""
        lines.append(f"{_PHASE_LABELS.get(k, k):30} {v / GIB:10.2f} {v / GB:10.2f}{mark}")
    lines.append("")
    lines.append(f"peak phase        {_PHASE_LABELS.get(est.peak_phase, est.peak_phase)}")
    for label, v in (("peak allocated", est.peak_allocated_bytes), ("predicted reserved", est.reserved_bytes),
                     ("device total", est.device_total_bytes)):
        lines.append(f"{label:18}{v / GIB:9.2f} GiB {v / GB:9.2f} GB")
    where = f"{est.gpu.name}'s" if est.gpu is not None else "no GPU chosen: the H200's measured"
    lines.append(f"{'':18}(device total = reserved + CUDA context {est.cuda_context_bytes / GIB:.2f} GiB, {where})")
    if est.gpu is not None:
        lines.extend(format_verdict(est, arch.name if arch is not None else est.model_name))
    if est.flops_per_step:
        lines.append(f"compute           {est.flops_per_step:.3g} FLOPs per step"
                     + (f", +{est.recompute_overhead * 100:.0f}% recomputation" if est.recompute_overhead else ""))
    lines.extend(format_time(est, tokens, usd_per_gpu_hour))
    lines.append("")
    total = sum(c.bytes for c in est.components) or 1.0
    lines.append(f"at the peak ({_PHASE_LABELS.get(est.peak_phase, est.peak_phase)}):")
    # the name column is as wide as the longest name (never cut): a name is what tells two rows apart
    shown_rows = [(c.name, c) for c in est.components if c.bytes > 0]
    width = max([40] + [len(c.name) for _, c in shown_rows]
                + [len(g.name) + 2 for _, c in shown_rows for g in c.children if g.bytes > 0])
    lines.append(f"{'component / module group':{width}} {unit_name:>9} {'share':>7}  formula")
    for _, c in shown_rows:
        lines.append(f"{c.name:{width}} {c.bytes / unit_div:9.3f} {c.bytes / total * 100:6.1f}%  "
                     f"{c.formula if not c.children else ''}")
        for g in c.children:
            if g.bytes <= 0:
                continue
            lines.append(f"  {g.name:{width - 2}} {g.bytes / unit_div:9.3f} {g.bytes / total * 100:6.1f}%  "
                         f"{_group_formula(g)}")
    if est.notes:
        lines.append("")
        lines.append("notes:")
        for n in est.notes:
            lines.append(f"  - {n}")
    return "\n".join(lines)


def _quiet_hub(model: str) -> None:
    """Before a Hub download: silence huggingface_hub's retry warnings (our error is the one line)."""
    from .model import presets

    key = model.strip()
    if "/" not in key or os.path.exists(key) or presets.find(key) is not None:
        return
    try:
        from huggingface_hub.utils import logging as hf_logging
    except Exception:  # not installed: fetch_config says so
        return
    hf_logging.set_verbosity_error()


def _fewest_gpus_text(min_gpus: Dict[str, Optional[int]]) -> str:
    """fit's fewest-GPU counts; the strategies no count fits are named with the reason."""
    from .fit.solver import MAX_GPUS_SEARCHED

    found = [f"{k} {v:,}" for k, v in min_gpus.items() if v]
    from .parallel.strategies import BY_NAME

    never = [f"{k} ({BY_NAME[k].why_no_count_fits()})" for k, v in min_gpus.items() if not v]
    text = ", ".join(found) if found else "none"
    if never:
        text += f"; no count up to {MAX_GPUS_SEARCHED:,} GPUs fits with " + ", ".join(never)
    return text


def _architecture(model: Any, est: Any) -> Any:
    """The analytic Architecture an estimate was made of, or None for a traced one (its
    model has no family module: the output says what the trace read instead)."""
    from .model.architecture import load

    return None if getattr(est, "backend", "analytic") == "trace" else load(model)


def _cmd_estimate(args: argparse.Namespace, out) -> int:
    from .estimate import estimate
    from .training import TrainingSetup

    if args.from_config is not None:
        return _cmd_estimate_from(args, out)
    if args.model is None:
        raise _UsageError("estimate: give MODEL (or --from FILE with a config that names the model)")
    _quiet_hub(args.model)
    if args.inference and parallel_kwargs(args):
        raise _UsageError(f"--{next(iter(parallel_kwargs(args))).replace('_', '-')} is a training layout option; "
                          "for serving on several GPUs use vramwidget infer --engine ... --tensor-parallel N")
    if args.inference:
        training_only = sorted(set(setup_kwargs(args)) - {"batch_size", "attn_implementation"})
        if training_only:
            raise _UsageError(f"--{training_only[0].replace('_', '-')} is a training option; with --inference "
                              f"use the inference options (see vramwidget infer --help)")
        from .inference import estimate as inference

        return inference.run(args, out)
    if parallel_kwargs(args):
        return _cmd_estimate_parallel(args, out)
    kw = setup_kwargs(args)
    TrainingSetup.from_kwargs(**kw)    # a bad option is named before any model is read
    _time_options(args)
    # estimate() chooses the backend before it loads anything (a traced model has no
    # analytic family to load), checks the physics and applies the practitioner defaults
    est = estimate(args.model, **kw)
    if args.gpu is not None:
        est.set_gpu(args.gpu)
    arch = _architecture(args.model, est)
    if args.json:
        out.write(json.dumps(estimate_json(arch, est, args.tokens, args.usd_per_gpu_hour)) + "\n")
    else:
        out.write(format_estimate(arch, est, args.units, args.tokens, args.usd_per_gpu_hour) + "\n")
    return 0


def _time_options(args: argparse.Namespace) -> None:
    if args.gpu is None and (args.tokens is not None or args.usd_per_gpu_hour is not None):
        raise _UsageError("--tokens and --usd-per-gpu-hour need --gpu (the GPU the step is timed on)")


def _layout_line(lay: Dict[str, Any]) -> str:
    return "per GPU, the worst one (" + ", ".join(f"{k}={v}" for k, v in lay.items()) + "):"


def _cmd_estimate_parallel(args: argparse.Namespace, out) -> int:
    """``estimate MODEL --num-gpus N [--strategy S ...]``: the per-GPU estimate of a sharded run."""
    from .model.architecture import load
    from .parallel.estimate import estimate_parallel

    kw = {**setup_kwargs(args), **parallel_kwargs(args)}   # no strategy given: estimate_parallel's default, said
    _time_options(args)
    result = estimate_parallel(args.model, **kw)
    lay = {"strategy": result.strategy, **{k: v for k, v in kw.items() if k in parallel_kwargs(args)}}
    if args.gpu is not None:
        result.set_gpu(args.gpu)   # every stage, with its communication
    est = result.per_gpu
    arch = load(args.model)
    if args.json:
        d = estimate_json(arch, est, args.tokens, args.usd_per_gpu_hour)
        d["parallel"] = lay
        out.write(json.dumps(d) + "\n")
        return 0
    out.write(_layout_line(lay) + "\n" + format_estimate(arch, est, args.units, args.tokens, args.usd_per_gpu_hour)
              + "\n")
    if "gpu_of_stage" in result.layout:
        for st, gpu in zip(result.stages, result.layout["gpu_of_stage"]):
            extra = (" + embedding" if st.embedding else "") + (" + head" if st.head else "")
            out.write(f"GPU {gpu}: layers {st.layers[0]}-{st.layers[1]}{extra}: "
                      f"{fmt_bytes(st.estimate.device_total_bytes)} device total\n")
    return 0


def _cmd_estimate_from(args: argparse.Namespace, out) -> int:
    """``estimate [MODEL] --from FILE``: the user's training config, with command-line overrides."""
    from .readers import from_training_config

    if args.inference:
        raise _UsageError("--from reads a training config; it does not go with --inference")
    cfg = from_training_config(args.from_config)
    overrides = {**setup_kwargs(args), **parallel_kwargs(args)}
    model = args.model if args.model is not None else cfg.model
    if isinstance(model, str):
        _quiet_hub(model)
    try:
        result = cfg.estimate(model, **overrides)
    except VramError as e:
        if args.model is None and getattr(e, "field", None) == "model":
            # the file's model could not be loaded (offline, a private or mirrored repo): the
            # command line may name it (a preset or a local config.json) and keep the file's setup
            raise VramError(f"{e} (or name the model before --from: vramwidget estimate MODEL --from "
                            f"{os.path.basename(str(args.from_config))})", field="model") from None
        raise
    per_gpu = getattr(result, "per_gpu", None)
    est = per_gpu if per_gpu is not None else result
    _time_options(args)
    if args.gpu is not None:
        result.set_gpu(args.gpu)   # a parallel run: every stage, with its communication
    arch = _architecture(model, est)
    if args.json:
        d = estimate_json(arch, est, args.tokens, args.usd_per_gpu_hour)
        d["config"] = cfg.to_dict()
        if per_gpu is not None:
            d["parallel"] = {"strategy": "ddp", **cfg.parallel, **parallel_kwargs(args)}
        out.write(json.dumps(d) + "\n")
        return 0
    article = "an" if cfg.format[:1].lower() in "aeiou" else "a"
    lines = [f"read {cfg.source} as {article} {cfg.format} config: {len(cfg.mapped)} field(s) used, "
             f"{len(cfg.ignored)} ignored"]
    for f, k, v in cfg.mapped:
        lines.append(f"  {f} -> {k}={v!r}")
    from .readers._common import QUIET_REASONS

    for f, why in cfg.ignored:
        if why not in QUIET_REASONS:
            lines.append(f"  ignored {f}: {why}")
    quiet = sum(1 for _, why in cfg.ignored if why in QUIET_REASONS)
    if quiet:
        lines.append(f"  ({quiet} more field(s) with no effect on memory ignored; --json lists them)")
    for n in cfg.notes:
        lines.append(f"  note: {n}")
    if per_gpu is not None:
        lines.append(_layout_line({"strategy": "ddp", **cfg.parallel, **parallel_kwargs(args)}))
    out.write("\n".join(lines) + "\n" + format_estimate(arch, est, args.units, args.tokens, args.usd_per_gpu_hour)
              + "\n")
    return 0


# ----------------------------------------------------------------------------------------
# validate, presets
# ----------------------------------------------------------------------------------------

def _cmd_validate(args: argparse.Namespace, out) -> int:
    from .measure import validate as V

    path = args.cases if args.cases is not None else V.BUILTIN_CASES
    if os.path.isdir(path):
        raise VramError(f"cases: {shown(path)} is a folder; give a .jsonl file", field="cases")
    result = V.validate(V.load_cases(path), backend=args.backend)
    if args.json:
        out.write(json.dumps(V.to_json_rows(result)) + "\n")
    else:
        out.write(V.format_report(result) + "\n")
    return 0


def _cmd_presets(args: argparse.Namespace, out) -> int:
    from .model import presets as P

    rows = []
    for name in P.list_presets():
        p = P.get(name)
        rows.append({"name": name, "hub_id": p.get("hub_id") or "", "params_label": p.get("params_label") or "",
                     "family": p.get("family") or ""})
    if args.json:
        out.write(json.dumps(rows) + "\n")
        return 0
    out.write(f"{'preset':24} {'hub id':44} params\n")
    for r in rows:
        out.write(f"{r['name']:24} {r['hub_id']:44} {r['params_label']}\n")
    return 0


# ----------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------
# vramwidget fit: the answers come from vramwidget.fit.solver (pure); the flags and text are here
# ----------------------------------------------------------------------------------

_PARALLEL_FLAGS = (
    ("--strategy", "strategy", "choice", "data-parallel strategy: {strategies}"),
    ("--num-gpus", "num_gpus", "int", "GPUs of the run (default 1)"),
    ("--gpus-per-node", "gpus_per_node", "int", "GPUs per node (default 8)"),
    ("--tensor-parallel", "tensor_parallel", "int", "tensor-parallel size"),
    ("--pipeline-parallel", "pipeline_parallel", "int", "pipeline stages"),
    ("--context-parallel", "context_parallel", "int", "context-parallel size"),
    ("--expert-parallel", "expert_parallel", "int", "expert-parallel size"),
    ("--micro-batches", "micro_batches", "int", "pipeline micro-batches per step"),
)


def add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fit`` command's arguments: MODEL, --gpu, the estimate's setup options, the
    parallel layout, --json."""
    from .parallel.estimate import STRATEGIES
    from .training import CHOICES

    parser.add_argument("model", metavar="MODEL",
                        help="a preset name, a config.json path, a Hub id, or a parameter count like 7B")
    parser.add_argument("--gpu", required=True, metavar="GPU",
                        help="a card of the catalog, e.g. H100-80GB, A100 40GB, RTX 4090, T4 (aliases accepted)")
    for flag, dest, kind, text in _SETUP_OPTIONS:
        if kind == "choice":
            parser.add_argument(flag, dest=dest, default=None,
                                metavar="{" + ",".join(c for c, _ in CHOICES[dest]) + "}", help=text)
        elif kind == "int":
            parser.add_argument(flag, dest=dest, default=None, type=_int_arg, metavar="N", help=text)
        elif kind == "float":
            parser.add_argument(flag, dest=dest, default=None, type=_float_arg, metavar="X", help=text)
        else:
            parser.add_argument(flag, dest=dest, default=None, metavar="A,B", help=text)
    for flag, dest, text in _SETUP_SWITCHES:
        parser.add_argument(flag, dest=dest, action="store_const", const=True, default=None, help=text)
    _add_derived_setup_flags(parser)
    parser.add_argument("--no-double-quant", dest="double_quant", action="store_const", const=False, default=None,
                        help="4-bit quantization without double quantization")
    parser.add_argument("--prepare-kbit", dest="prepare_kbit", action="store_const", const=True, default=None,
                        help="prepare_model_for_kbit_training")
    add_parallel_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the answers as JSON")


def add_parallel_arguments(parser: Any) -> None:
    """The parallel layout's flags (``fit`` and ``estimate``)."""
    from .parallel.estimate import STRATEGIES

    for flag, dest, kind, text in _PARALLEL_FLAGS:
        text = text.format(strategies=", ".join(STRATEGIES))
        if kind == "int":
            parser.add_argument(flag, dest=dest, default=None, type=_int_arg, metavar="N", help=text)
        else:
            parser.add_argument(flag, dest=dest, default=None, metavar="NAME", help=text)
    parser.add_argument("--bucket-mb", dest="bucket_mb", default=None, type=_float_arg, metavar="MB",
                        help="gradient reduce bucket in MB (DDP bucket_cap_mb, default 25; DeepSpeed "
                             "reduce_bucket_size, default 5e8 elements = 1000 MB in 16-bit)")
    parser.add_argument("--sequence-parallel", dest="sequence_parallel", action="store_true", default=None,
                        help="Megatron sequence parallel (with --tensor-parallel)")
    parser.add_argument("--offload-optimizer", dest="offload_optimizer", action="store_true", default=None,
                        help="DeepSpeed: optimizer states on the CPU")
    parser.add_argument("--offload-params", dest="offload_params", action="store_true", default=None,
                        help="ZeRO-3 / FSDP: parameters on the CPU")
    add_split_arguments(parser)
    parser.add_argument("--fsdp-version", dest="fsdp_version", default=None, type=_int_arg, metavar="{1,2}",
                        help="FSDP1 flat parameters (default) or FSDP2 fully_shard")
    parser.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_const",
                        const=False, default=None, help="FSDP: keep each unit gathered from its forward to its backward")
    parser.add_argument("--zero", dest="zero_config", action="append", default=None, metavar="KEY=VALUE",
                        help="a DeepSpeed zero_optimization key, e.g. --zero sub_group_size=1e8 "
                             "--zero stage3_max_live_parameters=3e8 (repeatable)")


def _run_infer_split(args: argparse.Namespace, out) -> int:
    """``infer MODEL --device-map auto --max-memory ...``: each GPU's share of generate()."""
    from .inference.split import estimate_inference_split

    skip = {"model", "command", "json", "units", "device_map", "max_memory", "func"}
    setup = {k: v for k, v in vars(args).items() if k not in skip and v is not None and not k.startswith("_")}
    from .inference.estimate import InferenceSetup

    known = set(InferenceSetup.__dataclass_fields__)
    setup = {k: v for k, v in setup.items() if k in known}
    kw = _split_kwargs(args)
    r = estimate_inference_split(args.model, kw.get("device_map", "auto"), kw.get("max_memory"), **setup)
    if getattr(args, "json", False):
        out.write(json.dumps(r.to_dict()) + "\n")
        return 0
    out.write(f"{r.model_name}: generate() split by device_map ({args.device_map or 'auto'})\n")
    for d, e in r.per_device.items():
        out.write(f"GPU {d}: weights {fmt_bytes(e.weights_bytes)}, KV cache {fmt_bytes(e.kv_cache_bytes)}, "
                  f"peak {fmt_bytes(e.peak_allocated_bytes)}, device total {fmt_bytes(e.device_total_bytes)}\n")
    for n in r.notes:
        out.write(f"note: {n}\n")
    return 0


def add_split_arguments(parser: Any) -> None:
    """``--device-map`` and ``--max-memory``: transformers' layer split over several GPUs."""
    parser.add_argument("--device-map", dest="device_map", default=None,
                        choices=("auto", "balanced", "balanced_low_0", "sequential"),
                        help="split the layers over the GPUs as from_pretrained(device_map=...) does")
    parser.add_argument("--max-memory", dest="max_memory", default=None, metavar="0=20GiB,1=20GiB,cpu=64GiB",
                        help="memory per device for --device-map")


def _split_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    kw: Dict[str, Any] = {}
    if getattr(args, "device_map", None) is not None:
        kw["device_map"] = args.device_map
    mm = getattr(args, "max_memory", None)
    if mm is not None:
        out: Dict[Any, Any] = {}
        for part in str(mm).split(","):
            key, _, val = part.partition("=")
            if not val:
                raise _UsageError(f"--max-memory: {part!r} is not DEVICE=SIZE (e.g. 0=20GiB,cpu=64GiB)")
            key = key.strip()
            out[int(key) if key.isdigit() else key] = val.strip()
        kw["max_memory"] = out
    return kw


def _zero_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    items = getattr(args, "zero_config", None)
    if not items:
        return {}
    out: Dict[str, Any] = {}
    for item in items:
        key, _, val = str(item).partition("=")
        if not val:
            raise _UsageError(f"--zero: {item!r} is not KEY=VALUE (e.g. sub_group_size=1e8)")
        v: Any = val.strip()
        if v.lower() in ("true", "false"):
            v = v.lower() == "true"
        else:
            try:
                v = float(v) if any(c in v for c in ".eE") else int(v)
            except ValueError:
                pass
        out[key.strip()] = v
    return {"zero_config": out}


def parallel_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """The parallel layout's keywords among parsed flags (only those given)."""
    kw: Dict[str, Any] = {}
    for dest in [d for _, d, _, _ in _PARALLEL_FLAGS] + ["sequence_parallel", "offload_optimizer",
                                                          "offload_params", "bucket_mb", "fsdp_version",
                                                          "reshard_after_forward"]:
        v = getattr(args, dest, None)
        if v is not None:
            kw[dest] = v
    kw.update(_split_kwargs(args))
    kw.update(_zero_kwargs(args))
    return kw


def fit_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """The keyword arguments of :func:`vramwidget.fit.solver.answers` for parsed ``fit`` flags (a
    parallel layout without a strategy gets DDP when it has several replicas)."""
    from .defaults import strategy_for
    from .parallel.estimate import PARALLEL_KEYS

    kw = {**setup_kwargs(args), **parallel_kwargs(args)}
    if "device_map" in kw and "strategy" not in kw:
        kw["strategy"] = "none"      # one replica, its layers split over the GPUs
    if any(k in kw for k in PARALLEL_KEYS) and "strategy" not in kw:
        # the one default (defaults.strategy_for), as estimate_parallel and the widget choose it
        kw["strategy"] = strategy_for(kw.get("num_gpus", 1), kw.get("tensor_parallel", 1),
                                      kw.get("pipeline_parallel", 1), kw.get("context_parallel", 1))[0]
    return kw


def format_fit_answers(a: Dict[str, Any]) -> str:
    """The ``fit`` answers as the text the CLI prints."""
    g = a["gpu"]
    c = a["check"]
    lines = [f"model             {a['model']}",
             f"GPU               {g['name']}: {fmt_bytes(c['usable_bytes'])} CUDA total "
             f"({fmt_bytes(g['usable_bytes'])} in nvidia-smi)"
             + ("" if g["bf16"] else " (no bf16)")]
    s = a["setup"]
    bits = [s["method"], s["precision"], s["optimizer"], f"checkpointing {s['gradient_checkpointing']}",
            f"batch {s['batch_size']} x seq {s['seq_len']}"]
    if a["parallel"]:
        p = a["parallel"]
        bits.append(f"{p.get('strategy', 'none')} on {p.get('num_gpus', 1)} GPUs")
    lines.append(f"setup             {', '.join(bits)}")
    if not a["precision_supported"]:
        lines.append(f"warning           {a['precision_note']}")
    for n in a.get("notes") or []:
        lines.append(f"note              {n}")
    v = a["verdict"]
    verdict = {"fits": "FITS", "tight": "TIGHT", "does_not_fit": "DOES NOT FIT"}[v["state"]]
    room = v["headroom_bytes"]
    lines.append(f"verdict           {verdict}: device total {fmt_bytes(v['need_bytes'])} of "
                 f"{fmt_bytes(v['capacity_bytes'])} CUDA total ({fmt_bytes(abs(room))} {'free' if room >= 0 else 'over'}, "
                 f"{abs(v['headroom_pct']):.0f}%; uncertainty ±{fmt_bytes(v['band_bytes'])})")
    lines.append("                  (device total = predicted reserved memory + the card's CUDA context, the worst"
                 " GPU; tight = within the uncertainty)")
    lines.append(f"                  ({v['context_note']})")
    if v.get("allocator_note"):
        lines.append(f"                  ({v['allocator_note']})")
    lines.append(f"largest batch     {a['max_batch_size']} (at seq {s['seq_len']})")
    mp = a.get("max_position_embeddings")
    lines.append(f"longest sequence  {a['max_seq_len']:,} tokens (at batch {s['batch_size']})"
                 + (f"; the model's position limit is {mp:,}" if mp else ""))
    lines.append("fewest GPUs       " + _fewest_gpus_text(a["min_gpus"]))
    t = a.get("time")
    if t:
        b = t["breakdown"]
        lines.append(f"step time         {t['step_seconds']:.3g} s, {t['tokens_per_second']:,.0f} tokens/s, "
                     f"MFU {t['mfu'] * 100:.0f}% ({b['dominant']} {b['dominant_share'] * 100:.0f}% of the step)")
        c = a.get("run_cost")
        if c:
            lines.append(f"run cost          {c['tokens']:.3g} tokens: {c['hours']:,.2f} h on {c['gpus']} GPU(s)"
                         + (f", ${c['dollars']:,.2f} at ${c['usd_per_gpu_hour']:g}/GPU-hour ({c['price_source']})"
                            if c["dollars"] is not None else " (no price known)"))
    sug = a["suggestions"]
    if sug:
        lines.append("")
        lines.append("changes that lower the memory, alone or up to 3 combined (fitting with margin first; on the "
                     "GPUs the run has first; those that train the same way first; each by GPU time per token):")
        for i, x in enumerate(sug, 1):
            mark = {"fits": "fits", "tight": "tight"}.get(x.get("state"), "fits" if x["fits"] else "not enough")
            lines.append(f"{i:3}. {x['title']}: -{fmt_bytes(x['saved_bytes'])} -> {fmt_bytes(x['device_total_bytes'])} "
                         f"[{mark}]")
            costs = x.get("costs") or {}
            by_axis = "; ".join(f"{k}: {costs[k]}" for k in ("quality", "time", "hardware") if costs.get(k))
            lines.append(f"     cost: {by_axis or x['cost']}")
    return "\n".join(lines)


def run_fit(args: argparse.Namespace, out=None) -> int:
    """Run a parsed ``fit`` command; raises :class:`VramError` on bad input."""
    out = sys.stdout if out is None else out
    from .fit.solver import answers

    kw = fit_kwargs(args)
    a = answers(args.model, args.gpu, **kw)
    if getattr(args, "strategy", None) is None and kw.get("strategy") not in (None, "none"):
        from .defaults import strategy_for

        a["notes"].insert(0, strategy_for(kw.get("num_gpus", 1), kw.get("tensor_parallel", 1),
                                          kw.get("pipeline_parallel", 1), kw.get("context_parallel", 1))[1])
    if args.json:
        out.write(json.dumps(a) + "\n")
    else:
        out.write(format_fit_answers(a) + "\n")
    return 0


def fit_main(argv: Optional[Sequence[str]] = None) -> int:
    """``vramwidget fit MODEL --gpu GPU [options]``: exit 0, or 2 with one error line."""
    parser = _Parser(prog="vramwidget fit", description="What fits a GPU: largest batch, longest sequence, "
                                                         "fewest GPUs, and changes that make a setup fit.")
    add_fit_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:   # --help
            return int(exc.code or 0) if not isinstance(exc.code, str) else 2
        return run_fit(args)
    except (_UsageError, VramError) as exc:
        return _fail(str(exc))


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


def _fail(message: str) -> int:
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)
    return 2


#: the commands that answer once and end the process (:func:`run`)
ONE_SHOT_COMMANDS = ("estimate", "fit", "infer")


def run() -> None:
    """The ``vramwidget`` console script and ``python -m vramwidget``: :func:`main` as the
    process's own command, its exit code the process's.  A command that answers once
    (:data:`ONE_SHOT_COMMANDS`) runs with Python's cyclic garbage collector off: every plan
    and replay it makes stays cached until the process ends, so a collection only walks
    them (the solvers pause it while they search, ``allocator.collector.gc_paused``, and the
    one it runs when they turn it back on walked all of them).  Measured, idle 2-core
    machine: ``fit llama-3.1-8b --method qlora --gpu 'RTX 4090'`` 1.32-1.41 -> 1.11-1.18 s,
    ``fit llama-2-7b`` 3.9 -> 3.4 s, the same peak memory (204 / 448 MB: what is cyclic and
    dropped there is small).  ``main`` called as a function leaves the collector alone.

    Once such a command has printed, the process ends without freeing its caches object by
    object (``os._exit`` after flushing stdout and stderr; nothing here registers an atexit
    handler or leaves a file open): tearing down the plans of ``fit`` took 0.15-0.17 s of
    the 1.15-1.18 s above."""
    argv = sys.argv[1:]
    one_shot = bool(argv) and argv[0] in ONE_SHOT_COMMANDS
    if one_shot:
        gc.disable()
    code = main(argv)
    if not one_shot:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):     # a closed pipe (| head): what was written is all there is
            pass
    os._exit(code)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 bad input or usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out = sys.stdout
    if argv and argv[0] == "measure":
        from .measure.training import main as measure_main

        return int(measure_main(argv[1:]) or 0)
    parser = build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help
            return int(exc.code or 0) if not isinstance(exc.code, str) else 2
        if args.version:
            from . import __version__

            out.write(f"{PROG} {__version__}\n")
            return 0
        if args.command is None:
            raise _UsageError("give a command: estimate, fit, infer, validate, measure or presets (see vramwidget --help)")
        if args.command == "estimate":
            return _cmd_estimate(args, out)
        if args.command == "validate":
            return _cmd_validate(args, out)
        if args.command in ("presets", "models"):
            return _cmd_presets(args, out)
        if args.command == "measure-inference":
            from .measure.inference import measure_inference_file

            n = measure_inference_file(args.cases, args.out, device=args.device, snapshot_dir=args.snapshots)
            out.write(f"{n} case(s) measured; records appended to {args.out}\n")
            if n == 0:   # every case failed: say so in the exit status, not only inside the file
                raise _UsageError(f"measure-inference: no case could be measured (each failure is recorded in "
                                  f"{args.out} under \"error\")")
            return 0
        if args.command == "fit":
            _quiet_hub(args.model)
            return run_fit(args, out)
        if args.command == "infer":
            from .inference import estimate as inference

            _quiet_hub(args.model)
            if getattr(args, "device_map", None) is not None or getattr(args, "max_memory", None) is not None:
                return _run_infer_split(args, out)
            return inference.run(args, out)
        raise _UsageError(f"unknown command {shown(args.command)}")  # pragma: no cover
    except _UsageError as exc:
        return _fail(str(exc))
    except VramError as exc:
        return _fail(str(exc))
    except BrokenPipeError:  # `vramwidget ... | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: still one line; VRAMWIDGET_DEBUG=1 shows the traceback
        if os.environ.get("VRAMWIDGET_DEBUG"):
            raise
        print(f"{PROG}: internal error: {type(exc).__name__}: {_one_line(str(exc))} "
              f"(set VRAMWIDGET_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
