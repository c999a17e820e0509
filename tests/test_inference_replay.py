"""generate()'s allocations replayed through the caching-allocator model
(vramwidget/inference/events.py, allocator.replay_runs): the skip-ahead equals the full replay,
the replay's invariants hold on inference streams, and the estimate's reserved memory is the
replay's, not a rule of thumb."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import vramwidget as vw
from vramwidget.allocator import caching as allocator
from vramwidget.allocator.caching import (CachingAllocator, StepRun, expand_runs, parse_alloc_conf, replay, replay_runs)
from vramwidget.model.architecture import from_config, load
from vramwidget.inference.estimate import InferenceSetup
from vramwidget.inference.events import inference_events, inference_runs, replay_inference
from vramwidget.units import MIB

@pytest.fixture(autouse=True)
def _pure_python(monkeypatch):
    """These tests are of the Python replays (the skip-ahead of ``replay_runs``, the fast loop,
    ``CachingAllocator``): what runs where the compiled replay is not built.  The compiled one
    is compared with them in tests/test_creplay.py."""
    monkeypatch.setattr(allocator, "COMPILED", False)


#: a tiny Llama (the shape tests/test_inference_trace.py runs through transformers' generate())
TINY = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000, "max_position_embeddings": 4096}
#: the same with a 64-token sliding window (Mistral v0.1's mechanism): the cache stops growing
TINY_SLIDING = dict(TINY, model_type="mistral", sliding_window=64)
CONFS = ("default", "expandable_segments", "max_split_size_mb:64")


def _kv_ring(L=8, tok=2048, p=512, steps=600):
    """Only the cache's torch.cat: per layer keys then values at S + 1 tokens, the S-token
    ones dropped (tok bytes per token and layer), with a small constant transient per layer."""
    pre = [("alloc", (x, l), p * tok, x) for l in range(L) for x in "kv"]
    ev = []
    for l in range(L):
        ev.append(("alloc", ("t", l), 8192, 0, "t"))
        for x in "kv":
            ev.append(("alloc", (x, l, "new"), (p + 1) * tok, tok, x))
            ev.append(("free", (x, l), 0, 0, ""))
        ev.append(("free", ("t", l), 0, 0, ""))
    return [pre, StepRun(tuple(ev), steps, tuple(((x, l, "new"), (x, l)) for l in range(L) for x in "kv"))]


@pytest.mark.parametrize("conf", CONFS)
@pytest.mark.parametrize("shape", [
    (TINY, dict(batch_size=2, prompt_len=48, context_len=400)),
    (TINY, dict(batch_size=1, prompt_len=1, context_len=700, attn_implementation="eager")),
    (TINY_SLIDING, dict(batch_size=2, prompt_len=40, context_len=300)),
    (TINY, dict(batch_size=3, prompt_len=100, context_len=350, weights="nf4")),
])
def test_skip_ahead_equals_the_full_replay(shape, conf):
    """replay_runs (decode steps as StepRuns, skipped where provably equal) gives every field of
    the full replay of the written-out stream, byte for byte."""
    cfg, kw = shape
    arch = from_config(cfg)
    s = InferenceSetup.from_kwargs(allocator=conf, **kw)
    parts = inference_runs(arch, s)
    c = parse_alloc_conf(conf)
    assert replay_runs(parts, c) == replay(expand_runs(parts), c)


@pytest.mark.parametrize("conf", CONFS)
@pytest.mark.parametrize("ring", [dict(L=4, tok=6144, p=3000, steps=800), dict(L=2, tok=4096, p=256, steps=800),
                                  dict(L=3, tok=1024, p=2000, steps=800), dict(L=4, tok=512, p=64, steps=800)])
def test_skip_ahead_on_the_cache_ring_is_exact_and_skips(ring, conf, monkeypatch):
    """The cache tensors rotate through a segment and come back to the same layout after
    about L + 1 steps; where the recorded comparisons allow it the replay jumps, and the
    result is still the full replay's."""
    jumps = []
    orig = allocator._set_sizes
    monkeypatch.setattr(allocator, "_set_sizes", lambda *a: (jumps.append(1), orig(*a)))
    parts = _kv_ring(**ring)
    c = parse_alloc_conf(conf)
    assert replay_runs(parts, c) == replay(expand_runs(parts), c)
    assert jumps, "no skip happened: the test would not exercise the shortcut"


def test_constant_steps_skip_to_the_end():
    """Steps whose sizes do not grow leave the allocator as they found it: one probe and the
    rest is skipped (a million events replayed as a handful)."""
    ev = (("alloc", "a", 5 * MIB, 0, "a"), ("alloc", "b", 3000, 0, "b"), ("free", "a", 0, 0, ""),
          ("free", "b", 0, 0, ""))
    parts = [[("alloc", "w", 100 * MIB, "w")], StepRun(ev, 250_000)]
    res = replay_runs(parts)
    assert res.num_events == 1 + 4 * 250_000
    assert res == replay(expand_runs(parts))


@pytest.mark.parametrize("conf", CONFS)
def test_reserved_is_allocated_plus_cached_at_every_event(conf):
    """The replay's invariant on an inference stream: reserved >= allocated after every event,
    and reserved = allocated + the cached free blocks (the fragmentation as the replay counts it)."""
    arch = from_config(TINY_SLIDING)
    s = InferenceSetup.from_kwargs(batch_size=2, prompt_len=40, context_len=120, allocator=conf)
    al = CachingAllocator(parse_alloc_conf(conf))
    live = {}
    for kind, key, nbytes, label in inference_events(arch, s):
        if kind == "alloc":
            live[key] = al.malloc(nbytes, label)
        else:
            al.free(live.pop(key))
        assert al.reserved >= al.allocated
        assert al.reserved == al.allocated + al.cached_bytes()


def test_decode_cache_grows_by_torch_cat():
    """transformers cache_utils.py DynamicLayer.update: self.keys = torch.cat([self.keys,
    key_states], dim=-2), then the values: per layer and decode step, keys at S + 1 tokens are
    allocated before the S-token ones go, then the values the same way."""
    arch = from_config(TINY)
    b, p, ctx = 2, 48, 51
    s = InferenceSetup.from_kwargs(batch_size=b, prompt_len=p, context_len=ctx)
    per_token = 2 * 32 * 2        # kv heads x head_dim x 2 B (bf16), keys or values of one layer
    sizes = {}
    cache = []
    for kind, key, nbytes, label in inference_events(arch, s):
        if kind == "alloc":
            sizes[key] = nbytes
        if kind == "alloc" and "cache" in str(label):
            cache.append(("alloc", nbytes // (b * per_token)))
            sizes[("lbl", key)] = label
        elif kind == "free" and ("lbl", key) in sizes:
            cache.append(("free", sizes[key] // (b * per_token)))
    prefill = [("alloc", p)] * 4            # 2 layers x keys, values
    decode = []
    for S in range(p, ctx):
        decode += [("alloc", S + 1), ("free", S)] * 4
    returned = [("free", ctx)] * 4          # generate() returns: the cache is dropped
    assert cache == prefill + decode + returned


def test_estimate_reserved_is_the_replay():
    """Llama-3.1-8B generate(): reserved memory is the replay's max_memory_reserved (at least
    the allocated peak), computed lazily; the allocator reserve's formula says so."""
    arch = load("llama-3.1-8b")
    est = vw.estimate_inference(arch, context_len=4096, prompt_len=4000)
    assert not est.reserved_exact                         # nothing replayed yet
    res = est.replay()
    assert est.reserved_bytes == max(res.max_reserved_bytes, est.peak_allocated_bytes)
    assert est.reserved_exact
    reserve = next(n for n in est.components if n.name == "allocator reserve")
    assert "replay" in reserve.formula
    assert reserve.bytes == est.reserved_bytes - est.peak_allocated_bytes
    # the estimate's peak sums the rounded requests live at once (inference_events.phase_peaks);
    # the replay's memory_allocated counts whole blocks, and a large block is not split when at
    # most 1 MiB would remain (should_split): at most 1 MiB more per large tensor live then
    # (the 32 layers' keys and values)
    assert est.peak_allocated_bytes <= res.max_allocated_bytes <= est.peak_allocated_bytes + 64 * MIB


def test_expandable_segments_reserve_less_than_default_segments():
    """Expandable segments map 20 MiB pages at the end of one segment instead of a segment
    per large request: on generate() the reserve over the allocated peak shrinks."""
    arch = load("llama-3.1-8b")
    kw = dict(context_len=2048, prompt_len=1900, batch_size=2)
    d = vw.estimate_inference(arch, **kw)
    e = vw.estimate_inference(arch, allocator="expandable_segments", **kw)
    assert d.peak_allocated_bytes == e.peak_allocated_bytes
    assert e.peak_allocated_bytes <= e.reserved_bytes < d.reserved_bytes
    # one segment per pool grows by pages (20 MiB large, 2 MiB small); what is mapped beyond
    # the allocated peak is the pages' rounding and the holes freed tensors leave inside the
    # segment: here under 4 pages, against 340 MiB of cached whole blocks with default segments
    assert e.reserved_bytes - e.peak_allocated_bytes < 3 * 20 * MIB + 2 * 2 * MIB
    assert d.reserved_bytes - d.peak_allocated_bytes > 5 * (e.reserved_bytes - e.peak_allocated_bytes)


def test_allocator_field_is_checked():
    with pytest.raises(vw.VramError, match="allocator"):
        vw.estimate_inference("llama-3.2-1b", allocator="max_split_size_mb:banana")


def test_replay_is_cached_per_setup():
    arch = from_config(TINY)
    s = InferenceSetup.from_kwargs(batch_size=2, prompt_len=48, context_len=80)
    assert replay_inference(arch, s) is replay_inference(arch, s)


def test_widget_inference_update_runs_no_replay(monkeypatch):
    """Issue 10's rule in inference mode: the update draws the provisional device total at
    once (the verdict says so) and the worker replaces it with the replayed one.  The replay
    is held until the update's outputs are checked, so the check cannot race the worker."""
    from vramwidget.inference import events as inference_events
    from vramwidget.widget import Calculator

    import threading

    gate = threading.Event()
    real = inference_events.replay_runs
    on_update_path = []

    def held(*a, **k):
        if threading.current_thread() is threading.main_thread():
            on_update_path.append(1)
            return real(*a, **k)
        gate.wait(30)
        return real(*a, **k)

    calc = Calculator("llama-3.2-1b", gpu="RTX 4090")
    calc.wait()
    inference_events.clear_caches()
    monkeypatch.setattr(inference_events, "replay_runs", held)
    calc.mode = "inference"
    calc.context_len = 3072
    assert not on_update_path
    assert calc.status == "refining"
    assert calc.verdict["provisional"] is True
    est = calc.estimate
    assert calc.verdict["need_bytes"] == est.provisional_device_total_bytes
    reserve = [r for r in calc.rows["detail"] if r["component"] == "allocator reserve"]
    assert reserve and reserve[0]["formula"].startswith("provisional")
    gate.set()
    calc.wait()
    assert "provisional" not in calc.verdict and calc.status == "idle"
    assert calc.verdict["need_bytes"] == calc.estimate.device_total_bytes
    reserve = [r for r in calc.rows["detail"] if r["component"] == "allocator reserve"]
    assert reserve and reserve[0]["formula"].startswith("caching allocator")


@settings(max_examples=25, deadline=None)
# the cache crosses from the small pool (<= 1 MiB) to the large one mid-decode: 8 x 128 x 2 B x 3
# sequences = 6 KiB per token and layer, past 1 MiB at 171 tokens
@example(layers=2, kv_heads=8, head_dim=128, window=None, batch=3, prompt=80, new=200, conf="default", attn="sdpa")
@example(layers=2, kv_heads=8, head_dim=128, window=None, batch=3, prompt=80, new=200,
         conf="expandable_segments", attn="eager")
@example(layers=3, kv_heads=8, head_dim=128, window=None, batch=3, prompt=160, new=120,
         conf="max_split_size_mb:64", attn="sdpa")
@given(layers=st.integers(1, 3), kv_heads=st.sampled_from([1, 2, 8]), head_dim=st.sampled_from([24, 64, 128]),
       window=st.sampled_from([None, 8, 40]), batch=st.integers(1, 3), prompt=st.integers(1, 80),
       new=st.integers(1, 200), conf=st.sampled_from(CONFS), attn=st.sampled_from(["sdpa", "eager"]))
def test_any_small_generate_replays_exactly(layers, kv_heads, head_dim, window, batch, prompt, new, conf, attn):
    """Property: for any small shape (GQA/MQA, head sizes whose per-token bytes are not a
    multiple of 512, sliding windows that fill mid-decode, caches that cross from the small
    pool to the large one), replay_runs equals the full replay field by field, and
    reserved >= allocated = reserved - cached after every event of the written-out stream."""
    cfg = dict(TINY, num_hidden_layers=layers, num_key_value_heads=kv_heads, num_attention_heads=8,
               hidden_size=8 * head_dim, head_dim=head_dim)
    if window:
        cfg.update(model_type="mistral", sliding_window=window)
    arch = from_config(cfg)
    s = InferenceSetup.from_kwargs(batch_size=batch, prompt_len=prompt, context_len=prompt + new, allocator=conf,
                                   attn_implementation=attn)
    parts = inference_runs(arch, s)
    c = parse_alloc_conf(conf)
    events = expand_runs(parts)
    assert replay_runs(parts, c) == replay(events, c)
    al = CachingAllocator(c)
    live = {}
    for kind, key, nbytes, label in events:
        if kind == "alloc":
            live[key] = al.malloc(nbytes, label)
        else:
            al.free(live.pop(key))
        assert al.reserved >= al.allocated == al.reserved - al.cached_bytes()


def test_a_card_smaller_than_the_unbounded_reserve_frees_cached_segments():
    """Without a capacity the growing cache leaves cached segments behind (reserved far above
    allocated); on a card just above the allocated peak, the replay takes CUDACachingAllocator's
    free-and-retry path (release_cached_blocks, then cudaMalloc again) and finishes; below the
    peak the first allocation that cannot be placed is reported."""
    cfg = dict(TINY, num_hidden_layers=2, num_key_value_heads=8, num_attention_heads=8, hidden_size=1024,
               head_dim=128)
    arch = from_config(cfg)
    s = InferenceSetup.from_kwargs(batch_size=3, prompt_len=80, context_len=400)
    free = replay_inference(arch, s)
    assert free.max_reserved_bytes > free.max_allocated_bytes + 20 * MIB
    cap = free.max_allocated_bytes + 22 * MIB       # room for one 20 MiB segment past the peak
    tight = replay_inference(arch, s, capacity_bytes=cap)
    assert tight.oom is None and tight.max_reserved_bytes <= cap < free.max_reserved_bytes
    short = replay_inference(arch, s, capacity_bytes=free.max_allocated_bytes - MIB)
    assert short.oom is not None and short.oom.capacity == free.max_allocated_bytes - MIB


def test_provisional_carries_the_ratio_of_a_replayed_size():
    """Before its replay, an inference setup's reserve is its allocated peak x the reserved /
    allocated ratio of the last replayed setup that differs only in batch, context or prompt
    (else the training median, 1.0812); nothing is replayed for it."""
    from vramwidget.inference import events as inference_events
    from vramwidget.allocator.caching import DEFAULT_RESERVED_PER_ALLOCATED

    inference_events.clear_caches()
    arch = load("llama-3.2-1b")
    a = vw.estimate_inference(arch, context_len=2048, batch_size=2)
    b = vw.estimate_inference(arch, context_len=3072, batch_size=2)
    assert b.provisional_reserved_bytes == b.peak_allocated_bytes * DEFAULT_RESERVED_PER_ALLOCATED
    ratio = a.reserved_bytes / a.peak_allocated_bytes
    assert not b.reserved_exact
    assert b.provisional_reserved_bytes == b.peak_allocated_bytes * ratio
    assert not b.reserved_exact                      # still not replayed
    other = vw.estimate_inference(arch, context_len=3072, batch_size=2, weights="nf4")
    assert other.provisional_reserved_bytes == other.peak_allocated_bytes * DEFAULT_RESERVED_PER_ALLOCATED


@pytest.mark.parametrize("cfg", [TINY, TINY_SLIDING])
def test_reserved_by_decode_steps_is_each_shorter_call_replayed(cfg):
    """One replay read at every prefix (longest_context's search) gives what each shorter
    generate() call's own replay gives."""
    from vramwidget.inference.events import reserved_by_decode_steps

    arch = from_config(dict(cfg, num_key_value_heads=8, num_attention_heads=8, hidden_size=1024, head_dim=128))
    p, ctx = 60, 260
    at = reserved_by_decode_steps(arch, InferenceSetup.from_kwargs(batch_size=3, prompt_len=p, context_len=ctx))
    for k in (1, 7, 64, 111, 150, 200):
        own = replay_inference(arch, InferenceSetup.from_kwargs(batch_size=3, prompt_len=p, context_len=p + k))
        assert at(k) == own.max_reserved_bytes


def test_a_decode_step_cached_for_another_architecture_is_not_reused():
    """The decode steps are cached per ``id(arch)``; a garbage-collected architecture's id is
    given to the next one made.  Found by CI (tests/test_creplay.py's generate() property
    test, flaky): a 2-layer model's decode got a 1-layer model's cached step, and its renames
    named a layer-1 key the step never made (KeyError ('k', 1, 'new')).  Simulated here by
    re-keying a 1-layer model's cached steps to the 2-layer model's id: they are not used."""
    from vramwidget.inference import events as E

    one, two = from_config(dict(TINY, num_hidden_layers=1)), from_config(dict(TINY, num_hidden_layers=2))
    s = InferenceSetup.from_kwargs(batch_size=2, prompt_len=44, context_len=81)
    E.clear_caches()
    want = expand_runs(inference_runs(two, s))
    E.clear_caches()
    inference_runs(one, s)
    assert E._STEPS
    for key in list(E._STEPS):
        E._STEPS[(id(two),) + key[1:]] = E._STEPS[key]
    assert expand_runs(inference_runs(two, s)) == want
    E.clear_caches()


def test_a_stage_slice_cached_for_another_architecture_is_not_reused():
    """The same for a pipeline stage's slice (``parallel.estimate.stage_slice``), which was
    checked by the model's name only: two configs of one family share it."""
    from vramwidget.parallel import estimate as P

    small = from_config(dict(TINY, num_hidden_layers=4))
    big = from_config(dict(TINY, num_hidden_layers=4, hidden_size=256, intermediate_size=512))
    assert small.name == big.name
    want = P.stage_slice(big, 0, 1, True, False, 2, 1)
    P._SLICE_CACHE.clear()
    P.stage_slice(small, 0, 1, True, False, 2, 1)
    for key in list(P._SLICE_CACHE):
        P._SLICE_CACHE[(id(big),) + key[1:]] = P._SLICE_CACHE[key]
    got = P.stage_slice(big, 0, 1, True, False, 2, 1)
    assert [g.params_total for g in got] == [w.params_total for w in want]
    assert got[0].hidden_size == 256
