"""The caching-allocator replay (vramwidget/allocator/caching.py) against the rules of PyTorch's
c10/cuda/CUDACachingAllocator.cpp, and the training event stream (events.py) against the
measured H200 steps."""

import statistics

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import vramwidget as vw
from vramwidget.allocator.caching import (AllocatorConfig, CachingAllocator, allocation_size, parse_alloc_conf, replay,
                                  round_size)
from vramwidget.model.architecture import from_config, load
from vramwidget.plan import plan_events as training_events  # noqa: E402
from vramwidget.training import setup_from_case
from vramwidget.units import MIB
from vramwidget.measure.validate import BUILTIN_CASES, load_cases

DEFAULT = AllocatorConfig()


# -- the rules, each with its constant from CUDACachingAllocator.cpp --------------------------

def test_round_size_is_512_bytes():
    # kMinBlockSize = 512: "all sizes are rounded to at least 512 bytes"
    assert round_size(1, DEFAULT) == 512
    assert round_size(512, DEFAULT) == 512
    assert round_size(513, DEFAULT) == 1024
    assert round_size(10 * MIB + 1, DEFAULT) == 10 * MIB + 512


def test_roundup_power2_divisions_example_of_the_docs():
    # PyTorch's CUDA semantics notes: with 4 divisions, 1200 (MB) lies between 1024 and 2048,
    # whose divisions are 1024, 1280, 1536, 1792, so it is rounded to 1280
    cfg = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1200 * MIB, cfg) == 1280 * MIB
    assert round_size(1024 * MIB, cfg) == 1024 * MIB
    # the list form: 4 divisions from 256 MiB, 8 for everything above the last listed size
    cfg = parse_alloc_conf("roundup_power2_divisions:[256:4,>:8]")
    assert round_size(300 * MIB, cfg) == 320 * MIB          # 256 + 64-MiB steps
    assert round_size(1100 * MIB, cfg) == 1152 * MIB        # 1024 + 128-MiB steps (8 divisions)


def test_segment_sizes():
    # get_allocation_size: kSmallBuffer 2 MiB up to kSmallSize (1 MiB), kLargeBuffer 20 MiB below
    # kMinLargeAlloc (10 MiB), else rounded up to kRoundLarge (2 MiB)
    assert allocation_size(512) == 2 * MIB
    assert allocation_size(MIB) == 2 * MIB
    assert allocation_size(MIB + 512) == 20 * MIB
    assert allocation_size(10 * MIB - 512) == 20 * MIB
    assert allocation_size(10 * MIB) == 10 * MIB
    assert allocation_size(11 * MIB) == 12 * MIB


def test_small_requests_share_2_mib_segments():
    al = CachingAllocator()
    blocks = [al.malloc(1000) for _ in range(4096)]     # 1000 B -> 1024 B blocks, 2048 per segment
    assert al.allocated == 4096 * 1024
    assert al.reserved == 2 * 2 * MIB
    for b in blocks:
        al.free(b)
    assert al.allocated == 0 and al.reserved == 4 * MIB   # freed blocks stay cached


def test_medium_requests_pack_a_20_mib_segment():
    al = CachingAllocator()
    for _ in range(4):
        al.malloc(4 * MIB)        # 1-10 MiB requests split one 20 MiB segment
    assert al.reserved == 20 * MIB
    al.malloc(4 * MIB + 512)      # 4 MiB left in it: a second segment
    assert al.reserved == 40 * MIB


def test_best_fit_and_split():
    al = CachingAllocator()
    a = al.malloc(30 * MIB)
    b = al.malloc(50 * MIB)
    al.free(a)
    al.free(b)
    assert al.reserved == 80 * MIB
    c = al.malloc(25 * MIB)       # the 30 MiB block is the best fit; 5 MiB (> 1 MiB) is split off
    assert c.size == 25 * MIB and al.reserved == 80 * MIB
    d = al.malloc(5 * MIB)        # the 5 MiB remainder fits exactly
    assert d.seg is c.seg
    e = al.malloc(49 * MIB)       # the 50 MiB segment: 1 MiB would remain, not more than kSmallSize: no split
    assert e.size == 50 * MIB
    assert al.reserved == 80 * MIB
    al.free(c)
    al.free(d)                    # merges with its free neighbour back into one 30 MiB block
    f = al.malloc(30 * MIB)
    assert f.seg is c.seg and al.reserved == 80 * MIB


def test_max_split_size_keeps_oversize_blocks_whole():
    cfg = parse_alloc_conf("max_split_size_mb:64")
    al = CachingAllocator(cfg)
    a = al.malloc(100 * MIB)
    al.free(a)
    al.malloc(30 * MIB)           # below max_split_size: an oversize cached block is not used
    assert al.reserved == 130 * MIB
    b = al.malloc(90 * MIB)       # above it: an oversize block within 20 MiB (kLargeBuffer) is used whole
    assert b.size == 100 * MIB and al.reserved == 130 * MIB


def test_free_and_retry_before_out_of_memory():
    al = CachingAllocator(capacity_bytes=100 * MIB)
    a = al.malloc(60 * MIB)
    al.free(a)                    # cached, unused
    b = al.malloc(80 * MIB)       # no cached block fits; cudaMalloc fails at 140 MiB; the cached
    assert al.reserved == 80 * MIB and b.size == 80 * MIB   # segment is released and the retry succeeds
    events = [("alloc", 1, 60 * MIB, "a"), ("alloc", 2, 50 * MIB, "b")]
    res = replay(events, capacity_bytes=100 * MIB)
    assert res.oom is not None and res.oom.index == 1 and res.oom.label == "b"


def test_expandable_segments_map_20_mib_pages():
    al = CachingAllocator(parse_alloc_conf("expandable_segments"))
    a = al.malloc(30 * MIB)
    assert al.reserved == 40 * MIB          # 20 MiB pages for the large pool
    al.malloc(9 * MIB)                      # fits the mapped tail
    assert al.reserved == 40 * MIB
    al.free(a)
    al.malloc(25 * MIB)                     # reuses the freed front (blocks split down to 512 B)
    assert al.reserved == 40 * MIB


@pytest.mark.parametrize("text, field_msg", [
    ("max_split_size_mb:10", "must be > 20"),
    ("max_split_size_mb:abc", "integer"),
    ("garbage_collection_threshold:1.5", "between 0 and 1"),
    ("expandable_segments:yes", "True or False"),
    ("roundup_power2_divisions:3", "power of two"),
    ("max_split_size:128", "unknown option"),
    ("backend:cudaMallocAsync", "not modelled"),
    ("expandable_segments", None),
])
def test_alloc_conf_strings(text, field_msg):
    if field_msg is None:
        assert parse_alloc_conf(text).expandable_segments
        return
    with pytest.raises(vw.VramError, match=field_msg) as e:
        vw.estimate("gpt2", allocator=text)
    assert e.value.field == "allocator" and str(e.value).startswith("allocator:")


# -- invariants ------------------------------------------------------------------------------

ops = st.lists(st.tuples(st.booleans(), st.integers(min_value=1, max_value=64 * MIB)), min_size=1, max_size=120)
configs = st.sampled_from(["default", "expandable_segments", "max_split_size_mb:32",
                           "roundup_power2_divisions:4", "max_split_size_mb:48,roundup_power2_divisions:[64:2,>:4]",
                           "garbage_collection_threshold:0.5,max_split_size_mb:32"])


@settings(max_examples=150, deadline=None)
@given(ops, configs)
def test_reserved_is_allocated_plus_cached_at_every_event(seq, conf):
    """reserved >= allocated after every request and free, and reserved is exactly allocated
    plus the free (cached) blocks the replay holds: its fragmentation."""
    al = CachingAllocator(parse_alloc_conf(conf))
    live = []
    for is_free, size in seq:
        if is_free and live:
            al.free(live.pop(size % len(live)))
        else:
            live.append(al.malloc(size))
        assert al.reserved >= al.allocated
        assert al.reserved == al.allocated + al.cached_bytes()
        assert al.allocated == sum(b.size for b in live)


# -- the measured steps ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def replayed():
    out = []
    for c in load_cases(BUILTIN_CASES):
        arch = from_config(c["model"], name=c.get("name"))
        s = setup_from_case(c["training"])
        out.append((c, replay(training_events(arch, s)), vw.estimate(arch, **s.to_dict())))
    return out


def test_replayed_max_reserved_matches_the_h200(replayed):
    """max_memory_reserved() of 45 measured cases (h200_training_a.jsonl): the replay of the
    estimate's own allocations through the allocator model: within 1% median and 4% worst
    (issue 13's bar).  The rule of thumb it replaces was 3.1% median, 19% worst."""
    errs = sorted(abs(r.max_reserved_bytes / MIB - c["measured"]["max_reserved_mib"]) / c["measured"]["max_reserved_mib"]
                  for c, r, _ in replayed)
    assert statistics.median(errs) <= 0.01, statistics.median(errs)
    assert errs[-1] <= 0.04, errs[-1]


def test_replayed_allocations_reach_the_measured_peak(replayed):
    """The event stream is the estimate's tensors laid out in time: its allocated peak (the
    replay's max_memory_allocated) is the measured peak within 0.5% on every case."""
    for c, r, est in replayed:
        m = c["measured"]["peak_allocated_mib"]
        assert abs(r.max_allocated_bytes / MIB - m) / m <= 0.005, c["id"]
        assert est.reserved_bytes == max(r.max_reserved_bytes, est.peak_allocated_bytes)


def test_first_failing_allocation():
    """On a card smaller than the replayed reserve the first request that fails is named."""
    est = vw.estimate("llama-3.2-1b", batch_size=2, seq_len=2048)
    res = est.replay(capacity_bytes=est.peak_allocated_bytes * 0.9)
    assert res.oom is not None and res.oom.label
    assert est.replay(capacity_bytes=est.reserved_bytes).oom is None


@settings(max_examples=100, deadline=None)
@given(ops, configs, st.integers(min_value=64, max_value=512))
@example(seq=[(False, 60 * MIB + 1)], conf="expandable_segments", capacity_mib=64)
def test_invariants_hold_through_free_and_retry(seq, conf, capacity_mib):
    """The same with a device capacity: segments are released and requests retried or refused,
    and reserved never exceeds the capacity."""
    from vramwidget.allocator.caching import K_LARGE_BUFFER, K_SMALL_BUFFER, K_SMALL_SIZE, OutOfMemory, allocation_size

    cfg = parse_alloc_conf(conf)

    def mapped(nbytes):
        """What a request makes the allocator ask the device for: a segment of
        get_allocation_size, or with expandable segments whole pages (2 MiB small pool, 20 MiB
        large pool: ExpandableSegment's segment_size), so 60 MiB + 1 B needs 80 MiB there."""
        if not cfg.expandable_segments:
            return allocation_size(nbytes)
        page = K_SMALL_BUFFER if nbytes <= K_SMALL_SIZE else K_LARGE_BUFFER
        return -(-nbytes // page) * page

    al = CachingAllocator(cfg, capacity_bytes=capacity_mib * MIB)
    live = []
    for is_free, size in seq:
        if is_free and live:
            al.free(live.pop(size % len(live)))
        else:
            try:
                live.append(al.malloc(size))
            except OutOfMemory as e:
                assert mapped(e.size) + e.reserved > capacity_mib * MIB or e.reserved > 0
        assert al.allocated <= al.reserved <= capacity_mib * MIB
        assert al.reserved == al.allocated + al.cached_bytes()


# -- lifetimes in the event stream, each from the source that sets it --------------------------

def _lifetimes(events):
    """{label: (alloc index, free index or None)} for the first allocation of each label."""
    born, out = {}, {}
    for i, (kind, key, _n, label) in enumerate(events):
        if kind == "alloc":
            born[key] = (i, label)
            out.setdefault(label, [i, None, key])
        elif kind == "free" and key in born:
            lab = born[key][1]
            if out.get(lab) and out[lab][2] == key and out[lab][1] is None:
                out[lab][1] = i
    return {k: (v[0], v[1]) for k, v in out.items()}


def test_eager_attention_lifetimes():
    """transformers' eager_attention_forward: ``softmax(attn_weights, dtype=float32).to(dtype)``
    keeps the masked scores referenced until the 16-bit probabilities exist; SoftmaxBackward0
    keeps its fp32 output until the softmax's own backward has made its input's gradient
    (derivatives.yaml: _softmax saves result), one op later than a consumer's saves go."""
    s = setup_from_case({"method": "full", "weights_dtype": "bfloat16", "autocast_dtype": None, "optimizer": "adamw",
                         "gradient_checkpointing": False, "attn_implementation": "eager", "batch_size": 1,
                         "seq_len": 256})
    arch = load("llama-3.2-1b")
    life = _lifetimes(training_events(arch, s, steps=1))
    L = ("layer", 0)
    masked, probs = life[L + ("attention scores masked",)], life[L + ("attention probabilities",)]
    assert masked[1] > probs[0]                 # freed after the probabilities were made
    sm = life[L + ("softmax output fp32",)]
    g_in = life[L + ("grad of", "attention scores as fp32 (softmax input)")]
    g_out = life[L + ("grad of", "softmax output fp32")]
    assert g_out[0] < g_in[0] < sm[1]           # released after the softmax's backward ran


def test_autocast_cache_keeps_trainable_casts_through_the_checkpointed_forward():
    """aten/src/ATen/autocast_mode.cpp cached_cast caches the 16-bit copy of a leaf that
    requires grad until torch.autocast exits: under checkpointing a trained weight's copy lives
    to the end of the forward pass (a frozen one's only while its block runs)."""
    base = {"weights_dtype": "float32", "autocast_dtype": "bfloat16", "optimizer": "adamw",
            "gradient_checkpointing": True, "attn_implementation": "sdpa", "batch_size": 1, "seq_len": 128}
    arch = load("llama-3.2-1b")
    for method, to_the_end in (("full", True), ("lora", False)):
        ev = training_events(arch, setup_from_case(dict(base, method=method)), steps=1)
        life = _lifetimes(ev)
        cast = life[("layer", 0, "weight cast")]
        logsm = life["log_softmax output (fp32)"]
        assert (cast[1] > logsm[0]) == to_the_end, method


def test_qlora_stream_dequantizes_every_4bit_weight_at_its_size():
    """bitsandbytes' MatMul4Bit dequantizes the whole weight for each matmul (forward, and again
    for the input gradient in backward): a transient of out x in 16-bit elements whatever the
    batch and sequence.  The block profile is solved as a*T + b*T*s from two probes, which a
    constant does not fit (it gave (1.5 T - 0.5 T s) x n: negative, so dropped, from s = 3);
    constants are kept as such.  Llama 3.1 8B: q_proj 4096 x 4096, k_proj 1024 x 4096."""
    from vramwidget.model.architecture import load
    from vramwidget.plan import plan_events as training_events
    from vramwidget.training import TrainingSetup

    arch = load("llama-3.1-8b")
    for b, sq in ((1, 1), (4, 2048), (2, 513)):
        s = TrainingSetup.from_kwargs(method="qlora", gradient_checkpointing="full", batch_size=b, seq_len=sq)
        deq = [e for e in training_events(arch, s, steps=1) if e[0] == "alloc" and "dequantized" in str(e[3])]
        q = [e[2] for e in deq if e[3][-1] == "q_proj dequantized weight"]
        k = [e[2] for e in deq if e[3][-1] == "k_proj dequantized weight"]
        # each of the 32 layers: forward, the recomputed forward, and backward's input gradient
        assert len(q) == len(k) == 32 * 3
        assert set(q) == {4096 * 4096 * 2} and set(k) == {1024 * 4096 * 2}
