"""Reserved memory before its replay has run: events.provisional_reserved_bytes and the
Estimate properties built on it (reserved_exact, provisional_device_total_bytes).

The widget draws its first frame from the provisional value and asks for the exact one in
the background; fit_map uses it for cells far from the capacity line.  What is checked here:
the provisional value IS the exact one once the replay is cached, the fragmentation carried
over comes from the same setup only (at the nearest other size), nothing here runs a
replay, and two threads asking for one setup run one replay.
"""

import json
import math
import statistics
import threading
from importlib import resources

import pytest

import vramwidget as vw
from vramwidget.allocator import replays as events
from vramwidget.allocator.caching import DEFAULT_RESERVED_PER_ALLOCATED
from vramwidget.model.architecture import load
from vramwidget.training import TrainingSetup

MODEL = "llama-3.2-1b"


@pytest.fixture(autouse=True)
def empty_cache():
    """Each test starts with no cached replay (the cache is process-wide)."""
    events.clear_caches()
    yield


@pytest.fixture
def replays(monkeypatch):
    """Counts the replays run (events.replay_training's calls of PlanView.replay)."""
    from vramwidget.plan import PlanView

    calls = []
    real = PlanView.replay

    def counted(view, *a, **k):
        calls.append(1)
        return real(view, *a, **k)

    monkeypatch.setattr(PlanView, "replay", counted)
    return calls


def test_default_ratio_is_the_validation_median():
    """1.0812 = median over the 45 measured H200 cases of max_reserved / peak_allocated."""
    text = resources.files("vramwidget").joinpath("data/h200_training_a.jsonl").read_text()
    rows = [json.loads(line)["measured"] for line in text.splitlines() if line.strip()]
    assert len(rows) == 45
    ratios = [r["max_reserved_mib"] / r["peak_allocated_mib"] for r in rows]
    assert round(statistics.median(ratios), 4) == DEFAULT_RESERVED_PER_ALLOCATED


def test_nothing_cached_uses_the_default_ratio_and_runs_no_replay(replays):
    est = vw.estimate(MODEL, batch_size=2, seq_len=512)
    assert est.reserved_exact is False
    assert est.provisional_reserved_bytes == est.peak_allocated_bytes * DEFAULT_RESERVED_PER_ALLOCATED
    assert est.provisional_device_total_bytes == est.provisional_reserved_bytes + est.cuda_context_bytes
    assert replays == []


def test_provisional_equals_exact_once_cached(replays):
    for kw in (dict(), dict(method="qlora", gradient_checkpointing="full"), dict(method="lora", optimizer="adamw_8bit")):
        est = vw.estimate(MODEL, batch_size=2, seq_len=512, **kw)
        exact = est.device_total_bytes              # runs the replay
        again = vw.estimate(MODEL, batch_size=2, seq_len=512, **kw)
        assert again.reserved_exact is True
        assert again.provisional_device_total_bytes == exact
        arch = load(MODEL)
        s = TrainingSetup.from_kwargs(batch_size=2, seq_len=512, **kw)
        assert events.provisional_reserved_bytes(arch, s, again.peak_allocated_bytes) == (again.reserved_bytes, True)
    assert len(replays) == 3


def test_fragmentation_is_carried_from_the_nearest_size_of_the_same_setup(replays):
    arch = load(MODEL)
    kw = dict(method="lora")
    for b in (1, 16):
        vw.estimate(MODEL, batch_size=b, seq_len=512, **kw).reserved_bytes
    # another setup (full fine-tuning) cached at the very size asked below: never used for lora
    vw.estimate(MODEL, batch_size=2, seq_len=512).reserved_bytes
    n = len(replays)
    est = vw.estimate(MODEL, batch_size=2, seq_len=512, **kw)
    assert not est.reserved_exact
    r1 = events.cached_replay(arch, TrainingSetup.from_kwargs(batch_size=1, seq_len=512, **kw))
    ratio = r1.max_reserved_bytes / r1.max_allocated_bytes
    assert ratio > 1.0
    assert est.provisional_reserved_bytes == est.peak_allocated_bytes * ratio
    # batch 12 is nearer 16 than 1 (log scale)
    r16 = events.cached_replay(arch, TrainingSetup.from_kwargs(batch_size=16, seq_len=512, **kw))
    est12 = vw.estimate(MODEL, batch_size=12, seq_len=512, **kw)
    assert est12.provisional_reserved_bytes == est12.peak_allocated_bytes * max(
        1.0, r16.max_reserved_bytes / r16.max_allocated_bytes)
    # a setup differing in anything but the size gets the default, not lora's ratio
    other = vw.estimate(MODEL, batch_size=2, seq_len=512, method="lora", lora_r=32)
    assert other.provisional_reserved_bytes == other.peak_allocated_bytes * DEFAULT_RESERVED_PER_ALLOCATED
    assert len(replays) == n        # none of the provisional reads replayed


def test_two_threads_run_one_replay(replays):
    est = vw.estimate(MODEL, batch_size=3, seq_len=1024)
    other = vw.estimate(MODEL, batch_size=3, seq_len=1024)      # a second Estimate, same setup
    out = []
    barrier = threading.Barrier(3)

    def read(e):
        barrier.wait()
        out.append(e.reserved_bytes)

    ts = [threading.Thread(target=read, args=(e,)) for e in (est, est, other)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(out) == 3 and len(set(out)) == 1 and out[0] > est.peak_allocated_bytes
    assert len(replays) == 1
    assert est.reserved_exact and other.reserved_exact


def test_provisional_components_run_no_replay(replays):
    """The widget's first frame: the component list with the provisional reserve, no replay;
    once the replay has run, the very list ``components`` gives."""
    est = vw.estimate(MODEL, batch_size=2, seq_len=512, method="lora")
    prov = est.provisional_components
    assert replays == []
    names = [c.name for c in prov]
    assert names[-2:] == ["allocator reserve", "cuda context"]
    assert prov[-2].bytes == pytest.approx(est.provisional_reserved_bytes - est.peak_allocated_bytes)
    assert "provisional" in prov[-2].formula
    assert sum(c.bytes for c in prov) == pytest.approx(est.provisional_device_total_bytes)
    exact = est.components                      # runs the replay
    assert len(replays) == 1
    assert sum(c.bytes for c in exact) == pytest.approx(est.device_total_bytes)
    assert est.provisional_components is exact
    assert [c.name for c in exact] == names and "provisional" not in exact[-2].formula
