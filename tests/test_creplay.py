"""The compiled replay (vramwidget/allocator/creplay.c) against the Python reference.

The compiled replay runs every default-settings replay where it was built (``caching.COMPILED``);
``CachingAllocator`` (``replay(..., fast=False)``) is the reference, and the Python fast loop
and ``replay_runs``' skip-ahead are what runs without it.  Each test compares every field of
the result (the out-of-memory point included) on: random event streams with every event kind
(property tests), random decode programs (``StepRun`` s whose sizes grow by whole or partial
512-byte blocks, int and float), real training step plans with capacities around their
reserve, generate() runs of small and real models, and the shared H200 cases (training and
inference) that ``vramwidget validate`` judges.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_fast_paths import _fields, _stream
from test_inference_replay import TINY, TINY_SLIDING, _kv_ring

from vramwidget.allocator import caching
from vramwidget.allocator.caching import (AllocatorConfig, StepRun, compiled_program, compiled_replay, expand_runs,
                                          parse_alloc_conf, replay, replay_runs)
from vramwidget.inference.estimate import InferenceSetup
from vramwidget.inference.events import inference_runs, replay_parts
from vramwidget.measure.validate import load_cases, predict_case, predict_inference_case
from vramwidget.model.architecture import from_config, load
from vramwidget.plan import plan_view
from vramwidget.plan.views import program_at
from vramwidget.training import TrainingSetup
from vramwidget.units import MIB

DATA = os.path.join(os.path.dirname(__file__), "..", "vramwidget", "data")

pytestmark = pytest.mark.skipif(bool(os.environ.get("VRAMWIDGET_PURE_PYTHON")),
                                reason="VRAMWIDGET_PURE_PYTHON is set: the compiled replay is off")


def test_the_compiled_replay_is_built_and_on():
    """setup.py builds it wherever there is a C compiler (CI has one): a build that silently
    lost it would leave every answer on the pure-Python replay."""
    assert caching.creplay is not None
    assert caching.COMPILED


@pytest.fixture
def pure_python(monkeypatch):
    """Run the block with the compiled replay off (the Python fast loop and skip-ahead)."""
    monkeypatch.setattr(caching, "COMPILED", False)


def _ref(parts, cap=None):
    """The reference: the written-out stream through CachingAllocator."""
    return replay(expand_runs(parts), None, cap, fast=False)


# -- plain event streams (what a training step plan replays) ----------------------------

_ops = st.lists(st.tuples(st.booleans(), st.integers(min_value=1, max_value=48 * MIB)), min_size=1, max_size=200)


@settings(max_examples=300, deadline=None)
@given(_ops, st.one_of(st.none(), st.integers(min_value=2, max_value=400)))
def test_any_stream_replays_as_the_reference(ops, capacity_mib):
    """Best fit, splits, merges, segment sizes, peak resets, the stop at a repeated step, the
    free-and-retry and the out-of-memory point: every field equal."""
    events = _stream(ops)
    cap = None if capacity_mib is None else capacity_mib * MIB
    assert _fields(compiled_replay([events], capacity_bytes=cap)) == _fields(replay(events, None, cap, fast=False))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "empty_cache", "reset_peak"]),
                          st.floats(min_value=0, max_value=30 * MIB, allow_nan=False)), min_size=1, max_size=120),
       st.one_of(st.none(), st.integers(min_value=25, max_value=200)))
def test_float_sizes_and_empty_cache_replay_as_the_reference(ops, capacity_mib):
    """Sizes given as floats (the plan's bytes are floats: int() then 512-byte rounding, the
    floor read on the float), requests under 512 B, and empty_cache releasing every whole
    cached segment between requests."""
    events, live = [], []
    for j, (kind, nbytes) in enumerate(ops):
        if kind == "free" and live:
            events.append(("free", live.pop(int(nbytes) % len(live)), 0, ""))
        elif kind in ("alloc", "free"):
            live.append(j)
            events.append(("alloc", j, nbytes, ("activations", f"t{j}")))
        else:
            events.append((kind, 0, 0, ""))
    cap = None if capacity_mib is None else capacity_mib * MIB
    assert _fields(compiled_replay([events], capacity_bytes=cap)) == _fields(replay(events, None, cap, fast=False))


def _program(events):
    """A stream as the columns plan.views.program_at makes of a plan's events."""
    import numpy as np

    codes = {"alloc": 0, "free": 1, "step_end": 2, "reset_peak": 3, "empty_cache": 4}
    return (np.array([codes[e[0]] for e in events], dtype=np.int8), np.array([e[1] for e in events], dtype=np.int64),
            np.array([e[2] if e[0] == "alloc" else 0 for e in events], dtype=np.int64), [e[3] for e in events])


@settings(max_examples=300, deadline=None)
@given(_ops, st.one_of(st.none(), st.integers(min_value=2, max_value=400)))
def test_any_stream_as_columns_replays_as_the_reference(ops, capacity_mib):
    """The same streams given as columns (``replay_program``: how a step plan is replayed)."""
    events = _stream(ops)
    cap = None if capacity_mib is None else capacity_mib * MIB
    assert _fields(compiled_program(_program(events), None, cap)) == _fields(replay(events, None, cap, fast=False))


def test_a_bad_stream_raises_what_the_reference_raises():
    with pytest.raises(KeyError):
        compiled_replay([[("free", "never allocated", 0, "")]])
    with pytest.raises(ValueError, match="unknown replay event 'rewind'"):
        compiled_replay([[("rewind", 0, 0, "")]])


@pytest.mark.parametrize("model, kw", [
    ("llama-3.2-1b", dict(method="qlora", batch_size=4, seq_len=2048)),
    ("qwen2.5-0.5b", dict(precision="fp32", grad_accum_steps=2, batch_size=2, seq_len=1000)),
    ("llama-2-7b", dict(method="lora", gradient_checkpointing="full", batch_size=2, seq_len=1024)),
])
def test_a_step_plan_replays_as_the_reference(model, kw):
    """A real training stream (load and three steps), without a capacity and with capacities
    below the allocated peak, between it and the reserve, at the reserve and above it."""
    arch = load(model)
    s = TrainingSetup.from_kwargs(**kw)
    view = plan_view(arch, s)
    events = view.events()
    program = program_at(view.index, *view.sizes)
    assert program is not None
    free = replay(events, None, None, fast=False)
    assert _fields(compiled_replay([events])) == _fields(free)
    assert _fields(compiled_program(program)) == _fields(view.replay()) == _fields(free)
    for cap in (0.9 * free.max_allocated_bytes, (free.max_allocated_bytes + free.max_reserved_bytes) / 2,
                free.max_reserved_bytes, free.max_reserved_bytes + 64 * MIB):
        ref = _fields(replay(events, None, cap, fast=False))
        assert _fields(compiled_replay([events], capacity_bytes=cap)) == ref, cap
        assert _fields(view.replay(cap)) == ref, cap


def test_other_allocator_settings_replay_in_python():
    """The compiled replay models the default settings only: a plan with expandable segments
    or max_split_size_mb goes through the Python replay (its rules are there)."""
    arch = load("llama-3.2-1b")
    for conf in ("expandable_segments:True", "max_split_size_mb:64", "garbage_collection_threshold:0.6"):
        s = TrainingSetup.from_kwargs(batch_size=2, seq_len=512, allocator=conf)
        view = plan_view(arch, s)
        assert compiled_program(program_at(view.index, *view.sizes), parse_alloc_conf(conf)) is None
        assert _fields(view.replay()) == _fields(replay(view.events(), parse_alloc_conf(conf), fast=False))


# -- decode programs (StepRun) ------------------------------------------------------------

@settings(max_examples=120, deadline=None)
@given(L=st.integers(1, 4), tok=st.sampled_from([512, 1000, 2048, 6144, 24.5]), p=st.integers(1, 3000),
       steps=st.integers(1, 400), cap_extra_mib=st.one_of(st.none(), st.integers(-30, 60)))
def test_any_cache_ring_replays_as_the_reference(L, tok, p, steps, cap_extra_mib):
    """The decode step's torch.cat ring: per layer keys then values at S + 1 tokens, the S-token
    ones freed; per-token growth that is a whole, a partial or a fractional 512-byte block,
    caches that cross from the small pool to the large one, with capacities below and above
    what the ring reserves."""
    parts = _kv_ring(L=L, tok=tok, p=p, steps=steps)
    cap = None
    if cap_extra_mib is not None:
        cap = max(1, _ref(parts).max_allocated_bytes + cap_extra_mib * MIB)
    assert _fields(compiled_replay(parts, capacity_bytes=cap)) == _fields(_ref(parts, cap))


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 3), kv_heads=st.sampled_from([1, 2, 8]), head_dim=st.sampled_from([24, 64, 128]),
       window=st.sampled_from([None, 8, 40]), batch=st.integers(1, 3), prompt=st.integers(1, 80),
       new=st.integers(1, 200), attn=st.sampled_from(["sdpa", "eager"]))
def test_any_small_generate_replays_as_the_reference(layers, kv_heads, head_dim, window, batch, prompt, new, attn):
    """generate() laid out op by op (prefill, decode steps as StepRuns with their renames):
    every field, and the growth log of longest_context's search in stream order."""
    cfg = dict(TINY, num_hidden_layers=layers, num_key_value_heads=kv_heads, num_attention_heads=8,
               hidden_size=8 * head_dim, head_dim=head_dim)
    if window:
        cfg.update(model_type="mistral", sliding_window=window)
    arch = from_config(cfg)
    s = InferenceSetup.from_kwargs(batch_size=batch, prompt_len=prompt, context_len=prompt + new,
                                   attn_implementation=attn)
    parts = inference_runs(arch, s)
    log = []
    assert _fields(compiled_replay(parts, growth_log=log)) == _fields(_ref(parts))
    caching.COMPILED = False
    try:
        py_log = []
        replay_runs(parts, AllocatorConfig(), growth_log=py_log)
    finally:
        caching.COMPILED = True
    assert log == sorted(py_log)


def test_a_run_that_frees_what_it_never_held_raises_key_error():
    run = StepRun((("free", "gone", 0, 0, ""),), 2)
    with pytest.raises(KeyError):
        compiled_replay([[], run])


def test_a_decode_of_a_real_model_replays_as_the_pure_python_replay(pure_python):
    """Llama 3.2 1B, 2,048-token context from a 128-token prompt (1,920 decode steps, the
    cache crossing into the large pool): the compiled replay of the runs against the Python
    skip-ahead (``replay_runs``, tested against the written-out stream in
    tests/test_inference_replay.py), with and without a card's capacity."""
    arch = load("llama-3.2-1b")
    s = InferenceSetup.from_kwargs(context_len=2048, prompt_len=128)
    parts = replay_parts(inference_runs(arch, s), AllocatorConfig())
    py = replay_runs(parts, AllocatorConfig())
    caching.COMPILED = True
    c = compiled_replay(parts)
    assert _fields(c) == _fields(py)
    for cap in (py.max_allocated_bytes + 40 * MIB, py.max_allocated_bytes - MIB):
        caching.COMPILED = False
        ref = caching.replay_runs_on_card(parts, AllocatorConfig(), cap)
        caching.COMPILED = True
        got = compiled_replay(parts, capacity_bytes=cap)
        assert (got.max_reserved_bytes, got.reserved_bytes, got.num_alloc_retries, got.num_events) == (
            ref.max_reserved_bytes, ref.reserved_bytes, ref.num_alloc_retries, ref.num_events), cap
        assert (got.oom is None) == (ref.oom is None)
        if got.oom is not None:
            assert (got.oom.index, got.oom.size, got.oom.label) == (ref.oom.index, ref.oom.size, ref.oom.label)


# -- the shared H200 cases ------------------------------------------------------------------

def _predictions(cases, predict):
    _clear_caches()
    return [predict(c) for c in cases]


def _clear_caches():
    from vramwidget.allocator import replays
    from vramwidget.inference import events

    replays.clear_caches()
    events.clear_caches()


def test_the_validation_cases_predict_the_same_with_and_without_it(monkeypatch):
    """``vramwidget validate``'s predictions of the 45 training and 5 inference cases shipped
    in the package (vramwidget/data, copied from the shared H200 set) are equal, field for
    field, compiled and in pure Python."""
    training = load_cases(os.path.join(DATA, "h200_training_a.jsonl"))
    inference = load_cases(os.path.join(DATA, "h200_inference_a.jsonl"))
    assert len(training) == 45 and len(inference) == 5
    compiled = _predictions(training, predict_case), _predictions(inference, predict_inference_case)
    monkeypatch.setattr(caching, "COMPILED", False)
    python = _predictions(training, predict_case), _predictions(inference, predict_inference_case)
    _clear_caches()
    assert compiled == python
