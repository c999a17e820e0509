"""Fuzz run of issue 14: 100,000 random valid setups and 10,000 random invalid inputs.

Valid setups are drawn (seed 0; setup i from its own generator, so chunks add up to the
whole run) from ``tests/invariants.SPACE`` (every preset, every method
including freeze and norms, every precision, optimizer, checkpointing and attention, batch
1-16, seq 1-4096, ...); a draw the estimator refuses with VramError is counted and redrawn.
Each valid setup is estimated and checked against every invariant of
``tests/invariants.violations`` (7 more estimates and the component trees).

Invalid inputs: 10,000 calls, each one keyword of one public function (or one widget trait)
set to a random value: a near-miss from ``tests/test_fuzz_inputs.NASTY_VALUES``, a random
JSON-like value (nested lists, dicts, huge and non-finite numbers, text) or a choice name in
the wrong place.  Targets and keywords are those of ``tests/test_fuzz_inputs.TARGETS``
(found by introspection).  Only VramError may come out; a value that happens to be legal
is counted as accepted.

    python benchmarks/bench_fuzz.py --strict          # 100,000 + 10,000; exit 1 on any non-VramError or violation
    python benchmarks/bench_fuzz.py --valid 2000 --invalid 500
    python benchmarks/bench_fuzz.py --valid 5000 --invalid 0 --start 5000 --json c1.json   # one chunk
    python benchmarks/bench_fuzz.py --sum c*.json --strict                                 # the chunks' total
    python benchmarks/bench_fuzz.py --valid 0 --invalid 0 --doors 20000 --json doors.json  # issue 27: every other door
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time
import traceback

import _timing  # noqa: F401  (puts the checkout on sys.path)

sys.path.insert(0, os.path.join(_timing.ROOT, "tests"))

from invariants import random_setup, valid, violations  # noqa: E402

from vramwidget import VramError  # noqa: E402


def random_json(rng: random.Random, depth: int = 0):
    """A random JSON-like value (what json.loads could give, plus nan/inf and huge ints)."""
    kind = rng.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([rng.randint(-5, 70000), rng.randint(-2 ** 64, 2 ** 64), 10 ** rng.randint(10, 400)])
    if kind == 3:
        return rng.choice([rng.uniform(-1e6, 1e6), float("nan"), float("inf"), -float("inf"), 1e308, 5e-324])
    if kind in (4, 5):
        n = rng.choice([0, 1, 3, 8, 30, 300, 100000])
        return "".join(rng.choice("ab7BM_- ,./\\n\\x00é{}[]q0") for _ in range(n))
    if kind in (6, 7):
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {str(random_json(rng, 2))[:10]: random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _rng(seed: int, kind: str, i: int) -> random.Random:
    """The generator of draw ``i``: each draw has its own seed, so a run split into chunks
    (``--start``/``--count``) draws exactly what one whole run draws."""
    return random.Random(f"{seed}:{kind}:{i}")


def _matches(d, where) -> bool:
    """Whether drawn setup ``d`` is one ``--where`` asks for: any clause (field, values) whose
    field's value, as text, is one of its values.  No clause: every setup."""
    return not where or any(str(d.get(field)) in values for field, values in where)


def run_valid(start: int, n: int, seed: int, partial=None, where=()):
    """Valid setups number start .. start + n - 1: setup i is the first draw of its own
    generator that the estimator accepts (refused draws are counted).  ``partial(counts,
    examples, seconds, done)`` is called every 100 setups (a long run killed midway keeps
    what it checked).  ``where``: check only the setups that match (:func:`_matches`; the
    others are drawn, so the numbering is the whole run's, counted as not selected)."""
    counts = collections.Counter()
    examples = {}
    t0 = time.perf_counter()
    for i in range(start, start + n):
        rng = _rng(seed, "valid", i)
        while True:
            d = random_setup(rng)
            try:
                est = valid(d)
            except Exception as e:  # noqa: BLE001 - counted: the number that must be 0
                counts["exceptions other than VramError"] += 1
                examples.setdefault(f"{type(e).__name__}: {e}"[:200], (i, d))
                break
            if est is None:
                counts["refused draws (VramError)"] += 1
                continue
            if not _matches(d, where):
                counts["not selected (--where)"] += 1
                break
            counts["valid setups"] += 1
            try:
                for v in violations(d, est=est):
                    counts["invariant violations"] += 1
                    examples.setdefault(v, (i, d))
                    # every violating number (up to 200 a message), to re-check them after a fix
                    nums = examples.setdefault(f"numbers with: {v}", [])
                    if len(nums) < 200:
                        nums.append(i)
            except Exception as e:  # noqa: BLE001 - counted: the number that must be 0
                counts["exceptions other than VramError"] += 1
                examples.setdefault(f"{type(e).__name__}: {e}"[:200], (i, d))
            break
        done = i - start + 1
        if partial is not None and done % 100 == 0:
            partial(counts, examples, time.perf_counter() - t0, done)
        if done % 5_000 == 0:   # progress, for long runs on busy machines
            print(f"  ... {done:,} setups, {dict(counts)} after {time.perf_counter() - t0:.0f} s", flush=True)
    return counts, examples, time.perf_counter() - t0


def run_invalid(start: int, n: int, seed: int):
    from test_fuzz_inputs import NASTY_VALUES, TARGETS

    from vramwidget import CHOICES, Calculator
    from vramwidget.widget.state import INPUTS

    calc = Calculator("gpt2")
    calc.suggestions_delay = None
    targets = dict(TARGETS)
    targets["widget trait"] = (lambda k, v: setattr(calc, k, v), sorted(INPUTS))
    names = sorted(targets)
    choice_names = sorted({c for v in CHOICES.values() for c, _ in v})
    counts = collections.Counter()
    examples = {}
    t0 = time.perf_counter()
    for i in range(start, start + n):
        rng = _rng(seed, "invalid", i)
        target = rng.choice(names)
        fn, keywords = targets[target]
        k = rng.choice(keywords)
        r = rng.random()
        v = rng.choice(NASTY_VALUES) if r < 0.3 else rng.choice(choice_names) if r < 0.4 else random_json(rng)
        try:
            fn(k, v)
            counts["accepted (a legal value)"] += 1
        except VramError as e:
            counts["VramError"] += 1
            if "\n" in str(e):
                counts["multi-line messages"] += 1
            if not e.field or e.field not in str(e):
                counts["messages not naming their field"] += 1
                examples.setdefault(f"{target}({k}=...): field {e.field!r} not in: {e}"[:200], (i, ""))
        except Exception as e:  # noqa: BLE001 - counted: the number that must be 0
            counts["exceptions other than VramError"] += 1
            examples.setdefault(f"{target}({k}=...): {type(e).__name__}: {e}"[:200],
                                (i, traceback.format_exc(limit=3)[-600:]))
        finally:
            if target == "widget trait":   # back to a valid widget for the next call
                try:
                    setattr(calc, k, calc.trait_defaults(k))
                    calc.model, calc.mode = "gpt2", "training"
                except VramError:
                    pass
    calc.close()
    return counts, examples, time.perf_counter() - t0


def run_doors(start: int, n: int, seed: int, partial=None):
    """Calls number start .. start + n - 1 through every door of ``tests/doors.py`` (issue 27):
    suggestions, fit, fit_map, max_batch_size, max_seq_len, estimate_parallel,
    estimate_inference (every engine), longest_context, from_training_config (generated
    configs of each format and junk files), every CLI subcommand and the widget's traits.
    Call i's door and values come from its own generator, so chunks add up to the whole run."""
    import doors

    ctx = doors.context()
    counts = collections.Counter({"exceptions other than VramError": 0})
    examples = {}
    t0 = time.perf_counter()
    try:
        for done, (i, name) in enumerate(doors.schedule(seed, start + n)[start:], 1):
            kind, detail = doors.run_door(name, random.Random(f"{seed}:call:{i}"), ctx)
            counts["calls"] += 1
            counts[f"{name}: {'returned' if kind == 'ok' else kind}"] += 1
            if kind == "other":
                counts["exceptions other than VramError"] += 1
                examples.setdefault(f"{name}: {detail}"[:200], (i, name))
            else:
                counts["VramError" if kind == "VramError" else "returned (a legal call)"] += 1
            if partial is not None and done % 100 == 0:
                partial(counts, examples, time.perf_counter() - t0, done)
            if done % 1_000 == 0:
                print(f"  ... {done:,} calls, {counts['exceptions other than VramError']} other exceptions after "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        doors.close(ctx)
    return counts, examples, time.perf_counter() - t0


def _report(title: str, n: int, counts, examples, secs: float) -> None:
    print(f"{title}: {n:,} in {secs:.0f} s", flush=True)
    for k, v in sorted(counts.items()):
        print(f"  {k:<36} {v:>9,}", flush=True)
    for k, v in list(examples.items())[:10]:
        print(f"  example: {k}\n           {v}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--valid", type=int, default=100_000, help="valid setups to check")
    ap.add_argument("--invalid", type=int, default=10_000, help="invalid inputs to try")
    ap.add_argument("--doors", type=int, default=0,
                    help="calls through every other door (tests/doors.py: suggestions, fit, fit_map, ..., the CLI, "
                         "the widget); issue 27 asks for >= 20,000")
    ap.add_argument("--start", type=int, default=0,
                    help="number of the first setup and first input (a chunk of a longer run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the counts, examples and seconds to this file")
    ap.add_argument("--sum", nargs="+", metavar="JSON", help="add up the --json files of chunks and print the total")
    ap.add_argument("--where", action="append", default=[], metavar="FIELD=V1,V2",
                    help="check only valid setups whose FIELD is one of the values (repeatable: any clause "
                         "matches), e.g. --where method=freeze to re-check one method at a later commit")
    ap.add_argument("--strict", action="store_true", help="exit 1 on any non-VramError, violation or multi-line message")
    a = ap.parse_args(argv)
    where = []
    for clause in a.where:
        field, sep, values = clause.partition("=")
        if not sep or not field or not values:
            ap.error(f"--where: expected FIELD=V1,V2, got {clause!r}")
        where.append((field, set(values.split(","))))
    results = {}
    if a.sum:
        for path in a.sum:
            with open(path) as f:
                for title, r in json.load(f).items():
                    t = results.setdefault(title, {"n": 0, "counts": collections.Counter(), "examples": {},
                                                   "seconds": 0.0, "ranges": []})
                    t["n"] += r["n"]
                    t["counts"].update(r["counts"])
                    t["seconds"] += r["seconds"]
                    t["ranges"].append(r["range"])
                    for k, v in r["examples"].items():
                        t["examples"].setdefault(k, v)
        for title, t in results.items():
            spans = sorted(tuple(x) for x in t["ranges"])
            gaps = [f"{a_[1]:,}-{b[0]:,}" for a_, b in zip(spans, spans[1:]) if b[0] != a_[1]]
            print(f"(numbers {', '.join(f'{x:,}-{y:,}' for x, y in spans)}"
                  f"{'; not contiguous: from-to ' + ', '.join(gaps) if gaps else ''}; seconds summed over chunks)")
            _report(title, t["n"], t["counts"], t["examples"], t["seconds"])
    else:
        def save() -> None:
            if a.json:
                with open(a.json + ".tmp", "w") as f:
                    json.dump({t: dict(r, counts=dict(r["counts"]), examples={k: repr(v) for k, v in r["examples"].items()})
                               for t, r in results.items()}, f, indent=1)
                os.replace(a.json + ".tmp", a.json)

        def partial_of(title):
            def partial(counts, examples, secs, done) -> None:
                results[title] = {"n": done, "counts": counts, "examples": examples, "seconds": secs,
                                  "range": [a.start, a.start + done]}
                save()
            return partial

        for title, fn, n in (("valid setups", run_valid, a.valid), ("invalid inputs", run_invalid, a.invalid),
                             ("doors", run_doors, a.doors)):
            if not n:
                continue
            if fn is run_valid:
                counts, examples, secs = fn(a.start, n, a.seed, partial_of(title), where)
            elif fn is run_doors:
                counts, examples, secs = fn(a.start, n, a.seed, partial_of(title))
            else:
                counts, examples, secs = fn(a.start, n, a.seed)
            _report(title, n, counts, examples, secs)
            results[title] = {"n": n, "counts": counts, "examples": examples, "seconds": secs,
                              "range": [a.start, a.start + n]}
            save()
    bad = sum(r["counts"].get("exceptions other than VramError", 0) + r["counts"].get("invariant violations", 0)
              + r["counts"].get("multi-line messages", 0) + r["counts"].get("messages not naming their field", 0)
              for r in results.values())
    return 1 if a.strict and bad else 0


if __name__ == "__main__":
    sys.exit(main())
