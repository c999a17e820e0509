"""Issue 27, every door fuzzed: a seeded slice of ``benchmarks/bench_fuzz.py --doors`` (the
whole run, 20,000 calls, is in benchmarks/README.md).  Every door of tests/doors.py is
called; only VramError (one line, naming its field) may come out, the CLI exits 0 or 2 with
one error line, and the widget keeps its last estimate when a value is refused."""

from __future__ import annotations

import collections
import random

import pytest

import doors

#: the slice: the first calls of the run's numbering (seed 0), and one more of each door
N_CALLS = 96


@pytest.fixture(scope="module")
def ctx():
    c = doors.context()
    yield c
    doors.close(c)


def test_every_door_answers_only_vram_errors(ctx):
    calls = doors.schedule(0, N_CALLS) + [(10_000_000 + k, name) for k, name in enumerate(sorted(doors.DOORS))]
    seen = collections.Counter()
    bad = []
    for i, name in calls:
        kind, detail = doors.run_door(name, random.Random(f"0:call:{i}"), ctx)
        seen[(name, kind)] += 1
        if kind == "other":
            bad.append((i, name, detail))
    assert bad == []
    assert {name for name, _ in seen} == set(doors.DOORS)
    assert sum(n for (_, kind), n in seen.items() if kind == "VramError") > 10     # broken calls were made
    assert sum(n for (_, kind), n in seen.items() if kind == "ok") > 10            # and legal ones


@pytest.mark.parametrize("name", sorted(doors.DOORS))
def test_a_broken_call_of_each_door_is_a_vram_error(ctx, name):
    """The door's first draw whose values are broken (some field nasty) raises VramError, not
    anything else; the search is seeded, so the same draw every run."""
    for k in range(200):
        kind, detail = doors.run_door(name, random.Random(f"broken:{name}:{k}"), ctx)
        assert kind != "other", detail
        if kind == "VramError":
            return
    pytest.fail(f"no broken call of {name} in 200 draws")
