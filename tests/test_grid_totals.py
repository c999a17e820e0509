"""plan.grid_totals (the fit map's totals over a whole grid at once) equals plan.totals (what
estimate() reads) at every cell and in every phase, to the byte.

grid_totals reads the plan through its few distinct size polynomials and only at the events
where a level can be a range's largest (plan/views.py); totals takes the cumulative sum over
every event at one size: the definition.  The setups cover sizes in b x s only (SDPA), in
b x s^2 (eager attention's scores), a target length (an encoder-decoder), gradient
accumulation, and the allocator's power-of-two rounding (a rounding that is not linear).
"""

import numpy as np
import pytest

from vramwidget.allocator.caching import parse_alloc_conf
from vramwidget.model.architecture import load
from vramwidget.plan import grid_totals, symbolic_plan
from vramwidget.plan.views import totals
from vramwidget.training import TrainingSetup

SETUPS = [
    ("llama-3.2-1b", dict(method="qlora", gradient_checkpointing="full")),
    ("gemma-2-2b", dict(attn_implementation="eager", method="lora")),                 # b x a x s^2 scores
    ("qwen2.5-0.5b", dict(precision="fp32", grad_accum_steps=3, optimizer="adamw_8bit")),
    ("llama-3.2-1b", dict(allocator="roundup_power2_divisions:4")),                  # power-of-two rounding
    ("flan-t5-base", dict(target_len=64)),                                             # a target length
]


@pytest.mark.parametrize("model, kw", SETUPS)
def test_grid_totals_equal_totals_at_every_cell(model, kw):
    arch = load(model)
    s = TrainingSetup.from_kwargs(**kw)
    ix = symbolic_plan(arch, s)
    assert ix is not None, "these setups have a symbolic plan"
    cfg = parse_alloc_conf(s.allocator)
    rng = np.random.default_rng(0)
    # random cells, with repeats and equal tokens b x s (cells computed once must be spread back)
    b = np.concatenate([rng.integers(1, 33, 10), [2, 4, 1, 8]])
    sq = np.concatenate([rng.integers(1, 3000, 10), [512, 256, 1024, 128]])
    t = np.full(len(b), 64 if s.target_len is not None else 1)
    grid = grid_totals(ix, cfg, b, sq, t, chunk=5)       # a small chunk: several chunks are joined
    for i in range(len(b)):
        one = totals(ix, cfg, int(b[i]), int(sq[i]), int(t[i]))
        for name, value in one.phases_bytes.items():
            assert grid[name][i] == value, (model, kw, name, int(b[i]), int(sq[i]))
        assert grid["peak_allocated_bytes"][i] == one.peak_allocated_bytes


def test_distinct_rows_is_numpy_unique_even_where_hashes_collide(monkeypatch):
    """views._distinct_rows (the grid's dedup of cells and of each phase's (const, count) rows)
    by a row hash, checked: the same rows as np.unique(axis=0); with multipliers that make
    many different rows share a hash (0, 2, 4, ...: [2, 0] and [0, 1] both hash to 0 ... 2),
    the check falls back to np.unique."""
    from vramwidget.plan import views

    rng = np.random.default_rng(1)
    for hashes in (views._ROW_HASH, (0, 0, 0, 0)):
        monkeypatch.setattr(views, "_ROW_HASH", hashes)
        for shape in ((0, 3), (1, 1), (50, 1), (400, 3), (300, 13)):
            m = rng.integers(0, 3, shape).astype(np.int64)
            first, inv = views._distinct_rows(m)
            assert len(first) == len(np.unique(m, axis=0)) if len(m) else len(first) == 0
            assert (m[first][inv] == m).all()
            assert len({tuple(r) for r in m[first]}) == len(first)     # each distinct row once
