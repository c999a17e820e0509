"""The ``vramwidget`` command line.

    vramwidget estimate MODEL [setup options] [--json] [--units gib|gb]
    vramwidget validate [CASES.jsonl] [--json]
    vramwidget measure ...                 (see ``vramwidget measure --help``)
    vramwidget presets                     (alias: ``vramwidget models``)

MODEL is anything :func:`vramwidget.architecture.load` accepts: a preset name
(``llama-3.1-8b``), a config.json path or folder, a Hub id, or a parameter count (``7B``).

Bad input never prints a traceback: one line ``vramwidget: error: <message>`` on stderr
and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from .errors import VramError
from .units import GB, GIB

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
    ("--seq-len", "seq_len", "int", "sequence length in tokens (default 2048)"),
    ("--grad-accum-steps", "grad_accum_steps", "int", "gradient accumulation steps (default 1)"),
    ("--lora-r", "lora_r", "int", "LoRA rank (default 16)"),
    ("--lora-alpha", "lora_alpha", "float", "LoRA alpha (default 32)"),
    ("--lora-dropout", "lora_dropout", "float", "LoRA dropout in [0, 1) (default 0)"),
    ("--lora-targets", "lora_targets", "list", "LoRA target modules, comma-separated, or all-linear "
                                               "(default: every linear layer of the blocks)"),
    ("--trainable-layers", "trainable_layers", "int", "with --method freeze: how many last layers train"),
    ("--backend", "backend", "choice", "auto (analytic where modelled, else traced), analytic or trace"),
)


class _UsageError(Exception):
    """A bad command line (argparse's complaint, turned into one line)."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting (one line, exit 2)."""

    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(message)


def _int_arg(text: str) -> int:
    s = text.strip()
    try:
        return int(s)
    except ValueError:
        pass
    try:
        f = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if f != f or f in (float("inf"), float("-inf")) or f != int(f):
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}")
    return int(f)


def _float_arg(text: str) -> float:
    try:
        return float(text.strip())  # nan/inf pass through: TrainingSetup names the field
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every subcommand."""
    from .training import CHOICES, QUANT_GROUPS, STATE_DTYPES

    parser = _Parser(prog=PROG, description="How much GPU memory a training step needs, and where it goes.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    est = sub.add_parser("estimate", help="estimate the memory of one training step",
                         description="Estimate the GPU memory of one training step of MODEL.")
    est.add_argument("model", metavar="MODEL",
                     help="a preset name (see `vramwidget presets`), a config.json path, a Hub id, or a "
                          "parameter count like 7B")
    for flag, dest, kind, text in _SETUP_OPTIONS:
        if kind == "choice":
            est.add_argument(flag, dest=dest, default=None, metavar="{" + ",".join(c for c, _ in CHOICES[dest]) + "}",
                             help=text)
        elif kind == "int":
            est.add_argument(flag, dest=dest, default=None, type=_int_arg, metavar="N", help=text)
        elif kind == "float":
            est.add_argument(flag, dest=dest, default=None, type=_float_arg, metavar="X", help=text)
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
    est.add_argument("--json", action="store_true", help="print the estimate as JSON")
    est.add_argument("--units", choices=("gib", "gb"), default="gib",
                     help="units of the component table: GiB (2**30 B, default) or GB (10**9 B)")
    est.add_argument("--inference", action="store_true",
                     help="estimate inference (weights, KV cache, prefill) instead of a training step; "
                          "the options below apply")
    from . import inference

    inference.add_arguments(est.add_argument_group("inference (with --inference)"), model=False)

    inf = sub.add_parser("infer", help="estimate inference memory: weights in any format, KV cache, serving",
                         description="GPU memory of running MODEL for inference.")
    inference.add_arguments(inf)

    from . import fit

    fit_p = sub.add_parser("fit", help="what fits a GPU: largest batch, longest sequence, fewest GPUs, and "
                                       "the changes that make a setup fit",
                           description="Answer 'does it fit, and what do I change' for MODEL on a GPU.")
    fit.add_arguments(fit_p)

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
    for dest in ("double_quant", "prepare_kbit"):
        v = getattr(args, dest)
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


def estimate_json(arch, est) -> Dict[str, Any]:
    """The JSON object ``estimate --json`` prints."""
    d = est.to_dict()
    a = arch.to_dict()
    a.pop("tensors", None)
    d["architecture"] = a
    d["inventory"] = inventory(arch)
    d["phases_gib"] = {k: round(v / GIB, 4) for k, v in est.phases_bytes.items()}
    d["phases_gb"] = {k: round(v / GB, 4) for k, v in est.phases_bytes.items()}
    d["device_total_gib"] = round(est.device_total_bytes / GIB, 3)
    d["device_total_gb"] = round(est.device_total_bytes / GB, 3)
    return d


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


def format_estimate(arch, est, units: str = "gib") -> str:
    """The table ``estimate`` prints."""
    unit_div, unit_name = (GIB, "GiB") if units == "gib" else (GB, "GB")
    s = est.setup
    lines: List[str] = []
    title = arch.name + (f"  ({arch.hub_id})" if arch.hub_id and arch.hub_id != arch.name else "")
    lines.append(f"model             {title}")
    lines.append(f"                  {arch.model_type}, h={arch.hidden_size}, L={arch.num_layers}, "
                 f"heads={arch.num_heads}/{arch.num_kv_heads} kv, V={arch.vocab_size}"
                 + (f", {arch.num_experts} experts (top-{arch.experts_per_token})" if arch.num_experts else ""))
    lines.append(f"params total      {_count(est.params_total)}" + ("" if arch.exact else "  (stated count)"))
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
    lines.append(f"{'':18}(device total = reserved + CUDA context {est.cuda_context_bytes / GIB:.2f} GiB)")
    if est.flops_per_step:
        lines.append(f"compute           {est.flops_per_step:.3g} FLOPs per step"
                     + (f", +{est.recompute_overhead * 100:.0f}% recomputation" if est.recompute_overhead else ""))
    lines.append("")
    total = sum(c.bytes for c in est.components) or 1.0
    lines.append(f"at the peak ({_PHASE_LABELS.get(est.peak_phase, est.peak_phase)}):")
    lines.append(f"{'component / module group':40} {unit_name:>9} {'share':>7}  formula")
    for c in est.components:
        if c.bytes <= 0:
            continue
        lines.append(f"{c.name[:40]:40} {c.bytes / unit_div:9.3f} {c.bytes / total * 100:6.1f}%  "
                     f"{c.formula if not c.children else ''}")
        for g in c.children:
            if g.bytes <= 0:
                continue
            lines.append(f"  {g.name[:38]:38} {g.bytes / unit_div:9.3f} {g.bytes / total * 100:6.1f}%  "
                         f"{_group_formula(g)}")
    if est.notes:
        lines.append("")
        lines.append("notes:")
        for n in est.notes:
            lines.append(f"  - {n}")
    return "\n".join(lines)


def _quiet_hub(model: str) -> None:
    """Before a Hub download: silence huggingface_hub's retry warnings (our error is the one line)."""
    from . import presets

    key = model.strip()
    if "/" not in key or os.path.exists(key) or presets.find(key) is not None:
        return
    try:
        from huggingface_hub.utils import logging as hf_logging
    except Exception:  # not installed: fetch_config says so
        return
    hf_logging.set_verbosity_error()


def _cmd_estimate(args: argparse.Namespace, out) -> int:
    from .architecture import load
    from .estimate import estimate_setup
    from .training import TrainingSetup

    _quiet_hub(args.model)
    if args.inference:
        training_only = sorted(set(setup_kwargs(args)) - {"batch_size", "attn_implementation"})
        if training_only:
            raise _UsageError(f"--{training_only[0].replace('_', '-')} is a training option; with --inference "
                              f"use the inference options (see vramwidget infer --help)")
        from . import inference

        return inference.run(args, out)
    arch = load(args.model)
    setup = TrainingSetup.from_kwargs(**setup_kwargs(args))
    est = estimate_setup(arch, setup)
    if args.json:
        out.write(json.dumps(estimate_json(arch, est)) + "\n")
    else:
        out.write(format_estimate(arch, est, args.units) + "\n")
    return 0


# ----------------------------------------------------------------------------------------
# validate, presets
# ----------------------------------------------------------------------------------------

def _cmd_validate(args: argparse.Namespace, out) -> int:
    from . import validate as V

    path = args.cases if args.cases is not None else V.BUILTIN_CASES
    if os.path.isdir(path):
        raise VramError(f"cases: {path!r} is a folder; give a .jsonl file", field="cases")
    result = V.validate(V.load_cases(path), backend=args.backend)
    if args.json:
        out.write(json.dumps(V.to_json_rows(result)) + "\n")
    else:
        out.write(V.format_report(result) + "\n")
    return 0


def _cmd_presets(args: argparse.Namespace, out) -> int:
    from . import presets as P

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

def _one_line(message: str) -> str:
    return " ".join(str(message).split())


def _fail(message: str) -> int:
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 bad input or usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out = sys.stdout
    if argv and argv[0] == "measure":
        from .measure import main as measure_main

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
            from .measure_inference import measure_inference_file

            n = measure_inference_file(args.cases, args.out, device=args.device)
            out.write(f"{n} case(s) measured; records appended to {args.out}\n")
            return 0
        if args.command == "fit":
            from . import fit

            _quiet_hub(args.model)
            return fit.run(args, out)
        if args.command == "infer":
            from . import inference

            _quiet_hub(args.model)
            return inference.run(args, out)
        raise _UsageError(f"unknown command {args.command!r}")  # pragma: no cover
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
