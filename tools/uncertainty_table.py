"""Regenerate vramwidget/data/uncertainty.json: the verdict's error band, from validate.

The band is the 90th percentile of |predicted / measured - 1| of ``max_reserved`` over the
shipped H200 training cases (vramwidget/data/h200_training_a.jsonl).  The package reads the
table (``verdict.uncertainty``) instead of validating every case in every process;
tests/test_verdict.py checks that the table is what ``validate`` gives today.

usage: python tools/uncertainty_table.py > vramwidget/data/uncertainty.json
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def table() -> dict:
    from vramwidget.measure import validate as V
    from vramwidget.fit.verdict import FIELD, QUANTILE

    stats = V.validate(V.BUILTIN_CASES)["summary"][FIELD]
    return {"field": FIELD, "quantile": QUANTILE, "rel_error": stats["p90"], "median": stats["median"],
            "max": stats["max"], "n_cases": stats["n"],
            "source": "vramwidget/data/h200_training_a.jsonl (measured on an H200, PyTorch's caching allocator)"}


if __name__ == "__main__":
    json.dump(table(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
