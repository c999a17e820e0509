"""Model families as plug-ins (issue 11).

The refactor that moved every family into ``vramwidget/model/families/`` must not change a number:
``validate``'s text and JSON output on the shipped H200 cases are compared byte for byte
with the output recorded from main before the move (tests/data/validate_h200_training_a.*),
and every preset's training and inference estimates with tools/refactor_snapshot.py's
record (tests/data/refactor_snapshot.json).  A change that alters validate's output on
purpose (a new column, a better mechanism) re-records them from the commit before it:
``python -m vramwidget validate vramwidget/data/h200_training_a.jsonl [--json] > tests/data/...``
and ``python tools/refactor_snapshot.py > tests/data/refactor_snapshot.json``.
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


def test_no_model_type_branch_outside_the_family_modules():
    """Only the families compare model types: the other modules ask ``arch.family``."""
    import re

    pat = re.compile(r"model_type\s*(==|!=|in\s*\(|\.startswith)|mt\s*(==|in)\s*[(\"']")
    hits = []
    pkg = os.path.join(ROOT, "vramwidget")
    for here, _dirs, files in sorted(os.walk(pkg)):
        rel = os.path.relpath(here, pkg)
        if rel.split(os.sep)[:2] == ["model", "families"]:
            continue                     # the family modules are where model types are compared
        for fn in sorted(files):
            if fn.endswith(".py"):
                with open(os.path.join(here, fn), encoding="utf-8") as f:
                    for n, line in enumerate(f, 1):
                        if pat.search(line):
                            hits.append(f"{os.path.join(rel, fn)}:{n}: {line.strip()}")
    assert not hits, hits


def test_every_supported_type_has_a_family_that_builds_and_traces():
    from vramwidget.model import architecture as A
    from vramwidget.model.families import REGISTRY, family_for

    assert set(A.SUPPORTED_MODEL_TYPES) == set(REGISTRY)
    for mt in A.SUPPORTED_MODEL_TYPES:
        fam = family_for(mt)
        assert mt in fam.model_types
        assert type(fam).params is not object and callable(fam.block)


def test_unknown_model_type_names_the_supported_ones():
    from vramwidget import VramError
    from vramwidget.model.architecture import from_config

    with pytest.raises(VramError) as e:
        from_config({"model_type": "no_such_family", "hidden_size": 8})
    assert e.value.field == "model_type" and "llama" in str(e.value) and "no_such_family" in str(e.value)


def test_a_family_is_llama_with_x():
    """Mistral is Llama plus a sliding window; Mixtral is Mistral plus experts (inheritance,
    as transformers' modular files write them)."""
    from vramwidget.model.families import family_for
    from vramwidget.model.families.llama import Llama
    from vramwidget.model.families.mistral import Mistral

    assert isinstance(family_for("mistral"), Llama) and family_for("mistral").sliding
    assert isinstance(family_for("mixtral"), Mistral) and family_for("mixtral").moe
    assert not family_for("llama").sliding
