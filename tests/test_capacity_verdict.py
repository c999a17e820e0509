"""The verdict on a card with the caching allocator's free-and-retry at the card's limit
(``gpus.judge_on``).

A replay without a limit keeps every segment it ever reserved; on a card, when a new
segment cannot be had, PyTorch frees its cached whole segments and retries before it raises
the out-of-memory error (c10/cuda/CUDACachingAllocator.cpp, ``DeviceCachingAllocator::malloc``:
``alloc_block`` || ``release_available_cached_blocks`` + ``alloc_block`` ||
``release_cached_blocks`` + ``alloc_block``).  So a run whose unlimited reserve is over the
card but whose allocated peak is not is replayed with the card's capacity, and that replay's
out-of-memory error (or its absence) decides.
"""

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

import vramwidget as vw
from vramwidget import fit, gpus, verdict
from vramwidget.allocator import replay
from vramwidget.inference import estimate_inference
from vramwidget.units import MIB

#: the card of the cases: an H100's generation (its Hopper CUDA context, 620.8 MiB) with its
#: CUDA total moved so that torch may reserve ``torch_mib`` MiB on it
BASE = "H100-80GB"


def _card(torch_mib: float):
    g = gpus.get_gpu(BASE)
    return replace(g, name=f"test card ({torch_mib:g} MiB for torch)",
                   cuda_total_mib=torch_mib + gpus.context_bytes(g)[0] / MIB)


# Llama-2-7B in bf16, generate() of a 512-token prompt to a 2,048-token context (the case of
# the report: its DynamicCache grows by one token a step and leaves cached segments behind)
LLAMA2 = dict(weights="bf16", context_len=2048, prompt_len=512)


def _llama2():
    return estimate_inference("llama-2-7b", **LLAMA2)


def test_llama2_generate_fits_14200_mib_once_the_allocator_frees_its_cache():
    """On a card where torch may reserve 14,200 MiB: the unlimited replay reserves more than
    that (the old rule said "does not fit"), the allocated peak is below it, and a replay with
    that capacity runs without an out-of-memory error: it fits, reserving at most 14,200 MiB."""
    est = _llama2()
    card = _card(14200)
    cap = gpus.capacity_bytes(card)
    ctx = gpus.context_bytes(card)[0]
    # the figures of the case (this package's replay of the event stream, unlimited)
    assert est.peak_allocated_bytes + ctx <= cap < est.reserved_bytes + ctx
    assert not gpus.fits(est.reserved_bytes + ctx, cap)         # the old rule: does not fit
    limited = est.replay(capacity_bytes=cap - ctx)
    assert limited.oom is None
    assert est.peak_allocated_bytes <= limited.max_reserved_bytes <= 14200 * MIB < est.reserved_bytes
    judged = gpus.judge_on(est, card)
    assert judged["fits"] and judged["case"] == "capacity_replay" and judged["oom"] is None
    assert judged["reserved_bytes"] == limited.max_reserved_bytes
    assert judged["unlimited_reserved_bytes"] == est.reserved_bytes
    assert judged["need_bytes"] == limited.max_reserved_bytes + ctx <= cap
    v = verdict.verdict(est, card)
    # within the estimator's band of the line (a few MiB to spare): tight, no longer does_not_fit
    assert v["state"] in ("fits", "tight") and v["headroom_bytes"] >= 0
    assert v["reserved_bytes"] == limited.max_reserved_bytes
    assert "frees its cached blocks" in v["allocator_note"] and "without a limit" in v["allocator_note"]


def test_the_peak_over_the_card_does_not_fit_without_a_replay():
    """Torch may reserve 13,900 MiB, below the 13,957 MiB allocated peak: does not fit
    whatever the allocator frees (reserved >= allocated)."""
    est = _llama2()
    card = _card(13900)
    assert est.peak_allocated_bytes > 13900 * MIB
    judged = gpus.judge_on(est, card)
    assert judged["fits"] is False and judged["case"] == "peak"
    assert verdict.verdict(est, card)["state"] == "does_not_fit"


class _Stream:
    """An estimate made of a hand-written event stream: what judge_on reads of one."""

    def __init__(self, events):
        self.events = events
        free = replay(events)
        self.peak_allocated_bytes = float(free.max_allocated_bytes)
        self.reserved_bytes = float(free.max_reserved_bytes)
        self.cuda_context_bytes = gpus.context_bytes(BASE)[0]
        self._replay_fn = self.replay

    def replay(self, capacity_bytes=None, record=False):
        return replay(self.events, None, capacity_bytes, record)


def _fragmented():
    """Three 6 MiB tensors in one 20 MiB segment (the large pool's segment for requests under
    10 MiB, ``get_allocation_size``), the first and last freed; then a 16 MiB tensor (its own
    16 MiB segment).  With the middle one still alive the 20 MiB segment cannot be
    released: 22 MiB allocated at the peak, 36 MiB reserved with or without freeing the cache."""
    ev = [("alloc", "a", 6 * MIB, "a"), ("alloc", "b", 6 * MIB, "b"), ("alloc", "c", 6 * MIB, "c"),
          ("free", "a", 0, ""), ("free", "c", 0, "")]
    return _Stream(ev + [("alloc", "d", 16 * MIB, "d")])


def test_fragmentation_that_freeing_the_cache_cannot_undo_does_not_fit():
    card = _card(30)          # torch may reserve 30 MiB: the peak (22 MiB) fits, 36 MiB does not
    est = _fragmented()
    assert est.peak_allocated_bytes == 22 * MIB and est.reserved_bytes == 36 * MIB
    judged = gpus.judge_on(est, card)
    assert judged["case"] == "capacity_replay" and judged["fits"] is False
    assert judged["oom"] is not None and judged["oom"].size == 16 * MIB
    assert verdict.verdict(est, card)["state"] == "does_not_fit"


_SIZES_MIB = st.sampled_from([0.5, 1, 2, 6, 9, 12, 16, 24, 40])


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), _SIZES_MIB, st.integers(0, 7)), min_size=1, max_size=40),
       torch_mib=st.integers(2, 200))
def test_never_fits_over_the_peak_never_refused_under_the_reserve(ops, torch_mib):
    """Property: the capacity-aware verdict never says fits when the allocated peak + the
    context is over the card, never does_not_fit when the unlimited reserve + the context is
    under it, and where it fits the reserve it shows is within the card."""
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


def test_fit_answers_take_the_capacity_replay_for_training_too():
    """Training (Llama 3.2 1B QLoRA + full checkpointing, seq 2048) on an RTX 4090: the largest
    batch, fit.check and the verdict agree at the answer and one above it, and the answer is
    at least the one of the unlimited reserve."""
    kw = dict(method="qlora", gradient_checkpointing="full", seq_len=2048)
    b = fit.max_batch_size("llama-3.2-1b", "RTX 4090", **kw)
    for batch, ok in ((b, True), (b + 1, False)):
        est = vw.estimate("llama-3.2-1b", gpu="RTX 4090", batch_size=batch, **kw)
        assert fit.check("llama-3.2-1b", "RTX 4090", batch_size=batch, **kw).fits is ok
        assert gpus.judge_on(est, "RTX 4090")["fits"] is ok
        state = verdict.verdict(est, "RTX 4090")["state"]
        assert state != "does_not_fit" if ok else state != "fits"
    unlimited = vw.estimate("llama-3.2-1b", gpu="RTX 4090", batch_size=b, **kw)
    if unlimited.device_total_bytes > gpus.capacity_bytes("RTX 4090"):
        assert gpus.judge_on(unlimited, "RTX 4090")["case"] == "capacity_replay"
