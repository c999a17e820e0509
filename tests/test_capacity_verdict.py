"""The reserve on a card with the caching allocator's free-and-retry at the card's limit
(``gpus.judge_on``, carried by ``Estimate.reserved_bytes`` on its own card).

A replay without a limit keeps every segment it ever reserved; on a card, when a new
segment cannot be had, PyTorch frees its cached whole segments and retries before it raises
the out-of-memory error (c10/cuda/CUDACachingAllocator.cpp, ``DeviceCachingAllocator::malloc``:
``alloc_block`` || ``release_available_cached_blocks`` + ``alloc_block`` ||
``release_cached_blocks`` + ``alloc_block``).  So a training step whose unlimited reserve is
over the card but whose allocated peak is not is replayed with the card's capacity, and that
replay's out-of-memory error (or its absence) decides; the estimate made on the card, its
headline, its tree, the verdict, fit.check, fit_map and the largest batch all carry that reserve.
"""

import copy
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vramwidget as vw
from vramwidget.fit import solver as fit, verdict
from vramwidget import gpus
from vramwidget.allocator.caching import replay
from vramwidget.fit.fitmap import fit_map
from vramwidget.inference.estimate import estimate_inference
from vramwidget.result import EstimateSources
from vramwidget.units import MIB

#: Llama 3.2 1B full fine-tuning (AdamW, bf16), batch 2 x 1,024 tokens, on a T4 (15 GiB):
#: this package's replay puts the allocated peak at 13,569.6 MiB and the reserve without a
#: limit at 14,874 MiB; the T4's CUDA total is 14,909 MiB and its context 274 MiB, so the
#: unlimited reserve + context (15,148 MiB) is over the card while the peak + context is not
MODEL, SETUP, T4 = "llama-3.2-1b", dict(batch_size=2, seq_len=1024), "T4"


def test_a_training_step_over_the_t4_only_by_its_cached_blocks_fits():
    est = vw.estimate(MODEL, gpu=T4, **SETUP)
    cap, ctx = gpus.capacity_bytes(T4), gpus.context_bytes(T4)[0]
    assert (cap, ctx) == (14909 * MIB, 274 * MIB)
    assert est.peak_allocated_bytes / MIB == pytest.approx(13569.6, abs=0.1)
    assert est.unlimited_reserved_bytes == 14874 * MIB
    assert est.peak_allocated_bytes + ctx <= cap < est.unlimited_reserved_bytes + ctx   # the old rule: over
    limited = est.replay(capacity_bytes=cap - ctx)
    assert limited.oom is None
    # the reserve on the card: the capacity replay's, 694 MiB of cached blocks fewer
    assert est.reserved_bytes == limited.max_reserved_bytes == 14180 * MIB
    assert est.device_total_bytes == (14180 + 274) * MIB <= cap
    judged = gpus.judge_on(est, T4)
    assert judged["case"] == "capacity_replay" and judged["fits"]
    assert judged["need_bytes"] == est.device_total_bytes
    v = verdict.verdict(est, T4)
    # 455 MiB under the line, more than the band (267 MiB), yet tight: it fits only because the
    # allocator frees its cached blocks at the limit, so that room is not a margin
    assert v["headroom_bytes"] == 455 * MIB > v["band_bytes"] and est.squeezed
    assert v["state"] == "tight" and v["need_bytes"] == est.device_total_bytes
    assert v["reserved_bytes"] == est.reserved_bytes and v["unlimited_reserved_bytes"] == 14874 * MIB
    assert "frees its cached blocks" in v["allocator_note"] and "14.53 GiB without a limit" in v["allocator_note"]
    c = fit.check(MODEL, T4, **SETUP)
    assert c.fits and c.device_total_bytes == est.device_total_bytes
    df = fit_map(MODEL, T4, batch_sizes=[2], seq_lens=[1024], exact=True)
    assert df["device_total_bytes"][0] == est.device_total_bytes and df["state"][0] == "tight"
    # the tree's boxes add up to the headline, the reserve's formula says where it comes from
    assert sum(c.bytes for c in est.components) == pytest.approx(est.device_total_bytes, rel=1e-9)
    box = [c for c in est.components if c.name == "allocator reserve"][0]
    assert box.bytes == est.reserved_bytes - est.peak_allocated_bytes and est.allocator_note in box.formula
    assert fit.max_batch_size(MODEL, T4, seq_len=1024) == 2


def test_the_peak_over_the_card_does_not_fit_without_a_capacity_replay(monkeypatch):
    """Batch 3: the allocated peak (16,787 MiB) alone is over the T4; no capacity replay runs."""
    est = vw.estimate(MODEL, gpu=T4, batch_size=3, seq_len=1024)
    calls = []
    real = est.sources.replay
    monkeypatch.setattr(est.sources, "replay", lambda capacity_bytes=None, record=False: (
        calls.append(capacity_bytes), real(capacity_bytes=capacity_bytes, record=record))[1])
    assert est.peak_allocated_bytes / MIB == pytest.approx(16786.8, abs=0.1)
    judged = gpus.judge_on(est, T4)
    assert judged["fits"] is False and judged["case"] == "peak"
    assert est.reserved_bytes == est.unlimited_reserved_bytes and est.allocator_note == ""
    assert verdict.verdict(est, T4)["state"] == "does_not_fit"
    assert all(c is None for c in calls)


def test_a_drawn_copy_with_a_provisional_reserve_is_judged_by_it_without_a_replay(monkeypatch):
    """The widget draws a copy of the estimate with a provisional reserve while the replay
    runs in the background (widget/background.py ``_view``): the verdict of that copy takes
    its reserve as given and runs no replay on the update path."""
    est = vw.estimate(MODEL, gpu=T4, **SETUP)
    view = copy.copy(est)
    view.reserved_bytes = 14_000 * MIB
    monkeypatch.setattr(est.sources, "replay", None)   # view, a shallow copy, shares est's sources
    assert verdict.verdict(view, T4)["need_bytes"] == (14_000 + 274) * MIB == view.device_total_bytes


def test_a_decode_is_judged_by_its_capacity_replay():
    """Inference is judged as a training step is: Llama-2-7B generate() of a 512-token prompt to
    2,048 tokens on a card where torch may reserve 14,200 MiB: its unlimited reserve is over that,
    its allocated peak is not, and the replay with that capacity runs without an error, so it
    fits, tight (the allocator freeing its cached blocks at the limit)."""
    g = gpus.get_gpu("H100-80GB")
    card = replace(g, name="test card (14,200 MiB for torch)", cuda_total_mib=14200 + gpus.context_bytes(g)[0] / MIB)
    est = estimate_inference("llama-2-7b", weights="bf16", context_len=2048, prompt_len=512)
    assert est.unlimited_reserved_bytes > 14200 * MIB > est.peak_allocated_bytes
    judged = gpus.judge_on(est, card)
    assert judged["case"] == "capacity_replay" and judged["fits"] is True and judged["squeezed"] is True
    assert est.replay(capacity_bytes=14200 * MIB).oom is None
    assert judged["reserved_bytes"] == est.replay(capacity_bytes=14200 * MIB).max_reserved_bytes


class _Stream:
    """An estimate made of a hand-written event stream: what judge_on reads of one."""

    capacity_judged = True

    def __init__(self, events):
        self.events = events
        free = replay(events)
        self.peak_allocated_bytes = float(free.max_allocated_bytes)
        self.reserved_bytes = float(free.max_reserved_bytes)
        self.cuda_context_bytes = gpus.context_bytes("H100-80GB")[0]
        self.sources = EstimateSources(replay=self.replay)

    def replay(self, capacity_bytes=None, record=False):
        return replay(self.events, None, capacity_bytes, record)


def _card(torch_mib):
    g = gpus.get_gpu("H100-80GB")
    return replace(g, name=f"test card ({torch_mib:g} MiB for torch)",
                   cuda_total_mib=torch_mib + gpus.context_bytes(g)[0] / MIB)


def test_fragmentation_that_freeing_the_cache_cannot_undo_does_not_fit():
    """Three 6 MiB tensors in one 20 MiB segment (the large pool's segment for requests
    under 10 MiB, ``get_allocation_size``), the first and last freed; then a 16 MiB tensor.
    With the middle one alive the 20 MiB segment cannot be released: 22 MiB allocated at the
    peak, 36 MiB reserved with or without freeing the cache, so 30 MiB is not enough."""
    ev = [("alloc", "a", 6 * MIB, "a"), ("alloc", "b", 6 * MIB, "b"), ("alloc", "c", 6 * MIB, "c"),
          ("free", "a", 0, ""), ("free", "c", 0, ""), ("alloc", "d", 16 * MIB, "d")]
    est = _Stream(ev)
    assert est.peak_allocated_bytes == 22 * MIB and est.reserved_bytes == 36 * MIB
    judged = gpus.judge_on(est, _card(30))
    assert judged["case"] == "capacity_replay" and judged["fits"] is False
    assert judged["oom"] is not None and judged["oom"].size == 16 * MIB
    assert verdict.verdict(est, _card(30))["state"] == "does_not_fit"


_SIZES_MIB = st.sampled_from([0.5, 1, 2, 6, 9, 12, 16, 24, 40])


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), _SIZES_MIB, st.integers(0, 7)), min_size=1, max_size=40),
       torch_mib=st.integers(2, 200))
def test_never_fits_over_the_peak_never_refused_under_the_reserve(ops, torch_mib):
    """Property: never fits when the allocated peak + the context is over the card, never
    refused when the unlimited reserve + the context is under it, and where it fits the
    reserve on the card is between the peak and both the card and the unlimited reserve."""
    events, live, n = [], [], 0
    for is_alloc, size_mib, pick in ops:
        if is_alloc or not live:
            events.append(("alloc", n, size_mib * MIB, "t"))
            live.append(n)
            n += 1
        else:
            events.append(("free", live.pop(pick % len(live)), 0, ""))
    est = _Stream(events)
    card = _card(torch_mib)
    cap, ctx = gpus.capacity_bytes(card), gpus.context_bytes(card)[0]
    judged = gpus.judge_on(est, card)
    state = verdict.verdict(est, card)["state"]
    if est.peak_allocated_bytes + ctx > cap:
        assert not judged["fits"] and state != "fits"
    if est.reserved_bytes + ctx <= cap:
        assert judged["fits"] and state != "does_not_fit"
    if judged["fits"]:
        assert est.peak_allocated_bytes <= judged["reserved_bytes"] <= cap - ctx + 1e-6
        assert judged["reserved_bytes"] <= est.reserved_bytes


def test_fit_answers_take_the_capacity_replay():
    """Llama 3.2 1B QLoRA + full checkpointing, seq 2048, on an RTX 4090: at the largest
    batch (7) the unlimited reserve (28,210 MiB) is over the card and the reserve there
    (23,710 MiB) is not; the estimate, fit.check, fit_map and the verdict agree at the answer
    and one above it."""
    kw = dict(method="qlora", gradient_checkpointing="full", seq_len=2048)
    b = fit.max_batch_size(MODEL, "RTX 4090", **kw)
    assert b == 7
    for batch, ok in ((b, True), (b + 1, False)):
        est = vw.estimate(MODEL, gpu="RTX 4090", batch_size=batch, **kw)
        c = fit.check(MODEL, "RTX 4090", batch_size=batch, **kw)
        df = fit_map(MODEL, "RTX 4090", batch_sizes=[batch], seq_lens=[2048], exact=True,
                     method="qlora", gradient_checkpointing="full")
        assert c.fits is ok and gpus.judge_on(est, "RTX 4090")["fits"] is ok
        assert c.device_total_bytes == est.device_total_bytes == df["device_total_bytes"][0]
        state = verdict.verdict(est, "RTX 4090")["state"]
        assert df["state"][0] == state and (state != "does_not_fit" if ok else state != "fits")
    at = vw.estimate(MODEL, gpu="RTX 4090", batch_size=b, **kw)
    assert at.unlimited_reserved_bytes == 28210 * MIB and at.reserved_bytes == 23710 * MIB


def test_the_widget_carries_the_reserve_on_the_card_in_every_figure():
    """The widget on the RTX 4090 at batch 7 (the case above): its headline, the tallest
    phase bar, the tree, the verdict and Python agree on the reserve there (23,710 MiB + 426
    MiB of context), and without a GPU the 4090's chip, worked out by the worker, says the same."""
    from vramwidget.widget import Calculator

    kw = dict(method="qlora", gradient_checkpointing="full", seq_len=2048, batch_size=7)
    want = vw.estimate(MODEL, gpu="RTX 4090", **kw)
    assert want.device_total_bytes == (23710 + 426) * MIB
    c = Calculator(MODEL, gpu="RTX 4090", **kw)
    c.wait()
    assert c.estimate.device_total_bytes == want.device_total_bytes == c.summary["device_total_bytes"]
    assert c.verdict["need_bytes"] == want.device_total_bytes and not c.verdict.get("provisional")
    assert c.verdict["state"] == verdict.verdict(want, "RTX 4090")["state"] != "does_not_fit"
    assert "frees its cached blocks" in c.verdict["allocator_note"]
    top = max(r["bytes"] for r in c.rows["phases"] if r["level"] == "total")
    assert top == pytest.approx(want.device_total_bytes)
    c.gpu = ""
    c.wait()
    chip = [g for g in c.summary["gpu_row"] if g["gpu"] == "RTX 4090"][0]
    assert not chip.get("provisional")
    assert chip["need_bytes"] == want.device_total_bytes
    assert chip["state"] == verdict.verdict(want, "RTX 4090")["state"]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), where=st.floats(0.0, 1.0))
def test_every_figure_on_a_card_agrees_with_the_reserve_judged_there(seed, where):
    """Property over random valid setups (tests/invariants.py's space), each on a card whose
    capacity falls between its allocated peak and its reserve without a limit (the band where
    the allocator's free-and-retry decides): the reserve on the card is between the peak and
    the unlimited reserve; where the replay with the card's capacity ran out of memory the
    unlimited reserve stays (over the line); the tree adds up to the device total; the
    verdict, fit.check and the estimate give one need; a need under the line is never
    called does_not_fit and one over it never fits."""
    import random

    from invariants import kwargs, random_setup, valid

    d = random_setup(random.Random(seed))
    est = valid(d)
    if est is None:
        return
    ctx = gpus.context_bytes("H100-80GB")[0]
    lo, hi = est.peak_allocated_bytes + ctx, est.unlimited_reserved_bytes + ctx
    card = _card((lo + (hi - lo) * where - ctx) / MIB)
    est.set_gpu(card)
    cap = gpus.capacity_bytes(card)
    r = est.reserved_bytes
    assert est.peak_allocated_bytes <= r <= est.unlimited_reserved_bytes
    judged = gpus.judge_on(est, card)
    if judged["oom"] is not None:
        assert r == est.unlimited_reserved_bytes and not judged["fits"]
    if judged["case"] == "capacity_replay":
        assert f"at {card.name}'s limit the allocator frees its cached blocks" in est.allocator_note
    assert judged["need_bytes"] == est.device_total_bytes == r + ctx
    assert judged["fits"] is (est.device_total_bytes <= cap)
    assert sum(c.bytes for c in est.components) == pytest.approx(est.device_total_bytes, rel=1e-9)
    v = verdict.verdict(est, card)
    assert v["need_bytes"] == est.device_total_bytes
    assert v["state"] != ("does_not_fit" if judged["fits"] else "fits")
    if judged["squeezed"]:
        assert judged["fits"] and v["state"] == "tight" and est.squeezed
    c = fit.check(d["model"], card, **kwargs(d))
    assert c.device_total_bytes == est.device_total_bytes and c.fits is judged["fits"]
