"""Benchmark the answers users wait on (issue 23's table), each as a ratio to one estimate().

Every row runs in a fresh Python process (cold: no plan, replay or verdict cached), timed
after ``import vramwidget``, except the command-line rows, which time the whole
``python -m vramwidget ...`` process (interpreter start and import included, as a user
waits for it).  The unit is one cold ``vw.estimate()`` (Llama 3.1 8B QLoRA, batch 4 x 2048)
timed the same way in the same run, so the ratios carry over between machines better than
the seconds do.

    python benchmarks/bench_answers.py            # every row but the slow ones
    python benchmarks/bench_answers.py --all      # + the 32k-token decode's reserve
    python benchmarks/bench_answers.py --strict   # exit 1 when a row misses its target

The children load the package from compiled bytecode, as an installed wheel does: the
checkout's package is compiled once (``compileall``, into its ``__pycache__``, as Python
does by default) and the children run without ``PYTHONDONTWRITEBYTECODE`` (a process that
recompiles the sources every time, as one started with it does in a checkout, pays
0.15-1.3 s more before it answers: the first fit map compiles every module it imports).

Targets (issue 23, "Must show"): suggestions (both), ``fit`` in the command line,
``max_seq_len`` and ``estimate --gpu`` each <= 1 s on an idle machine of this kind; the 32k
decode's reserve <= 1 s.  The fit map's target is a ratio to 4,096 estimate() calls:
``bench_fitmap.py``.  The widget's settle time: ``bench_widget_update.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: (label, python statement timed after the import, target seconds or None)
ROWS = [
    ("estimate llama-3.1-8b QLoRA b4 x 2048 (the unit)",
     "vw.estimate('llama-3.1-8b', method='qlora', batch_size=4, seq_len=2048).peak_allocated_bytes", None),
    ("the same with gpu='RTX 4090': device total (one replay)",
     "vw.estimate('llama-3.1-8b', method='qlora', batch_size=4, seq_len=2048, gpu='RTX 4090').device_total_bytes",
     1.0),
    ("suggestions Llama-2-7B full, RTX 4090",
     "fit.suggestions('llama-2-7b', 'RTX 4090')", 1.0),
    ("suggestions Llama-2-70B QLoRA, 2 x A100 80GB",
     "fit.suggestions('llama-2-70b', 'A100 80GB', method='qlora', num_gpus=2)", 1.0),
    ("suggestions Llama-3.1-8B QLoRA + full ckpt b5 x 2048, RTX 4090 (the widget's slowest)",
     "fit.suggestions('llama-3.1-8b', 'RTX 4090', method='qlora', gradient_checkpointing='full', "
     "batch_size=5, seq_len=2048)", None),
    ("max_seq_len Llama-3.1-8B QLoRA, RTX 4090",
     "fit.max_seq_len('llama-3.1-8b', 'RTX 4090', method='qlora')", 1.0),
    ("max_batch_size Llama-3.1-8B QLoRA s2048, RTX 4090",
     "fit.max_batch_size('llama-3.1-8b', 'RTX 4090', method='qlora', seq_len=2048)", None),
    ("fit_map 64 x 64 Llama-3.1-8B LoRA + full ckpt, H100",
     "vw.fit_map('llama-3.1-8b', 'H100 80GB', method='lora', gradient_checkpointing='full', "
     "batch_sizes=list(range(1, 65)), seq_lens=[128 * k for k in range(1, 65)])", None),
]
SLOW_ROWS = [
    ("32k-token decode reserve (Llama-3.1-8B, 128-token prompt)",
     "vw.estimate_inference('llama-3.1-8b', context_len=32768, prompt_len=128).reserved_bytes", 1.0),
]
#: (label, command-line arguments after ``python -m vramwidget``, target seconds)
CLI_ROWS = [
    ("CLI estimate llama-3.1-8b --method qlora --gpu 'RTX 4090' (whole process)",
     ["estimate", "llama-3.1-8b", "--method", "qlora", "--batch-size", "4", "--gpu", "RTX 4090"], 1.0),
    ("CLI fit llama-3.1-8b --method qlora --gpu 'RTX 4090' (whole process)",
     ["fit", "llama-3.1-8b", "--method", "qlora", "--gpu", "RTX 4090"], 1.0),
    ("CLI fit llama-2-7b --gpu 'RTX 4090' (full fine-tune; whole process)",
     ["fit", "llama-2-7b", "--gpu", "RTX 4090"], 1.0),
]

_CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
import vramwidget as vw
from vramwidget.fit import solver as fit
t0, c0 = time.perf_counter(), time.process_time()
{stmt}
print(json.dumps([time.perf_counter() - t0, time.process_time() - c0]))
"""


#: the children's environment: bytecode from one compilation (``_compiled``)
ENV = dict(os.environ)


def _compiled() -> None:
    """Compile the checkout's package once (its ``__pycache__``), for the children to read."""
    ENV.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(ROOT, "vramwidget")], env=ENV,
                   check=True, capture_output=True, cwd=ROOT)


def _child(stmt: str) -> tuple:
    out = subprocess.run([sys.executable, "-c", _CHILD.format(root=ROOT, stmt=stmt)], capture_output=True,
                         text=True, check=True, cwd=ROOT, env=ENV)
    wall, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return wall, cpu


def _cli(args: list) -> tuple:
    t0 = time.perf_counter()
    r0 = os.times()
    subprocess.run([sys.executable, "-m", "vramwidget", *args], capture_output=True, text=True, check=True, cwd=ROOT,
                   env=ENV)
    r1 = os.times()
    return time.perf_counter() - t0, (r1.children_user - r0.children_user) + (r1.children_system - r0.children_system)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="also the slow rows (the 32k decode)")
    ap.add_argument("--strict", action="store_true")
    args = ap.parse_args(argv)
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    _compiled()
    print(f"cold process per row (bytecode compiled once); load average {load:.2f} on {os.cpu_count()} cores "
          f"at the start")
    print(f"{'call':74} {'wall':>8} {'cpu':>8} {'x estimate':>11}  target")
    unit = None
    missed = []
    rows = [(label, stmt, target, _child) for label, stmt, target in ROWS + (SLOW_ROWS if args.all else [])]
    rows += [(label, cli, target, _cli) for label, cli, target in CLI_ROWS]
    for label, what, target, run in rows:
        wall, cpu = run(what)
        if unit is None:
            unit = wall
        verdict = ""
        if target is not None:
            verdict = f"<= {target:g} s: " + ("ok" if wall <= target else "MISSED")
            if wall > target:
                missed.append(label)
        print(f"{label:74} {wall:7.2f}s {cpu:7.2f}s {wall / unit:10.1f}x  {verdict}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 1 if (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
