"""Model families as plug-ins (issue 11).

The refactor that moved every family into ``vramwidget/families/`` must not change a number:
``validate``'s text and JSON output on the shipped H200 cases are compared byte for byte
with the output recorded from main before the move (tests/data/validate_h200_training_a.*),
and every preset's training and inference estimates with tools/refactor_snapshot.py's
record (tests/data/refactor_snapshot.json).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
DATA = os.path.join(os.path.dirname(__file__), "data")
CASES = os.path.join(ROOT, "vramwidget", "data", "h200_training_a.jsonl")


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT))
    return subprocess.run([sys.executable, "-m", "vramwidget", *args], capture_output=True, env=env,
                          check=True, cwd=ROOT).stdout


@pytest.mark.parametrize("fmt,recorded", [((), "validate_h200_training_a.txt"),
                                          (("--json",), "validate_h200_training_a.json")])
def test_validate_output_is_byte_identical_to_before_the_move(fmt, recorded):
    with open(os.path.join(DATA, recorded), "rb") as f:
        before = f.read()
    assert _cli("validate", CASES, *fmt) == before


def test_every_preset_estimate_is_unchanged_by_the_move():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from refactor_snapshot import snapshot

    with open(os.path.join(DATA, "refactor_snapshot.json"), encoding="utf-8") as f:
        before = json.load(f)
    now = json.loads(json.dumps(snapshot()))
    for name, row in before.items():
        assert now[name] == row, name
