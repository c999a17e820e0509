"""The reserve of a long decode from a short prompt, derived mechanism by mechanism.

Llama-3.1-8B in bf16, one sequence, a 128-token prompt, greedy generate() to 8,192 and to
32,768 tokens (transformers 5.23, torch's default caching allocator, no card limit).  The
large pool (requests above ``kSmallSize`` = 1 MiB; ``c10/cuda/CUDACachingAllocator.cpp``) is
where the reserve grows; the replay (``allocator.replay_runs`` over ``inference_events``'
stream) gives exactly the sum below.

1. Load and prefill: 15,476 MiB of large segments: the weights (every tensor of at least
   ``kMinLargeAlloc`` = 10 MiB in a segment of its own, rounded up to ``kRoundLarge`` = 2 MiB;
   the 1-10 MiB ones share ``kLargeBuffer`` = 20 MiB segments), the 32 MiB cuBLAS workspace
   and what the 128-token prefill leaves cached.
2. The cache: ``DynamicLayer.update`` makes each layer's keys, then values, by ``torch.cat``
   of the old S tokens and the new one, so 64 tensors (32 layers x keys, values) request
   2,048 (S + 1) B each step (8 KV heads x 128 x 2 B a token) while their S-token copy still
   lives, then drop it.  Up to S = 511 they are small-pool blocks.
3. 512 <= S < 5,120 (1-10 MiB): a miss takes a 20 MiB ``kLargeBuffer`` segment that several
   tensors split (``should_split``: more than 1 MiB would remain); 34 of them: 680 MiB.
4. From 10 MiB on, a miss takes the request rounded up to 2 MiB (``get_allocation_size``): a
   segment of R MiB.  All 64 tensors have one size, so they outgrow their R segments in the same
   step, every 1,024 steps (2 MiB / 2 KiB).  In such an epoch 65 segments are needed: one per
   tensor plus one, because each tensor's new copy is made before its old one is freed, so the
   64 live copies and the block about to be filled rotate through 65 segments (best fit takes
   the lowest free R segment; ``free_block`` merges only within a segment).  The 65 (R - 2)
   MiB segments of the previous epoch stay cached: no later request fits them (requests only
   grow), so without a card's limit nothing frees them.
   * R = 12 ... 20 MiB: 34 of the 65 fit in the cached 20 MiB segments of step 3, 31 are new:
     31 x R per epoch;
   * R = 22 MiB and up: 65 x R per epoch.
5. To 8,192 tokens (S = 8,191, request 16 MiB): epochs R = 12, 14, 16:
   15,476 + 680 + 31 x (12 + 14 + 16) = 15,476 + 680 + 1,302 = 17,458 MiB.
6. To 32,768 tokens (request 64 MiB): 31 x (12 + ... + 20) = 2,480 MiB and 65 x (22 + 24 + ...
   + 64) = 65 x 946 = 61,490 MiB: 15,476 + 680 + 2,480 + 61,490 = 80,126 MiB (78.2 GiB) for an
   allocated peak of 19.1 GiB.
7. On a card, when ``cudaMalloc`` of the next segment fails, ``release_cached_blocks`` frees
   every whole cached segment (the outgrown rings) and retries before an out-of-memory error:
   on an RTX 4090 the 32k decode is replayed at the card's capacity and fits, tight
   (``gpus.judge_on``: only by that freeing).

Not measured on a GPU yet (tools/inference_cases.jsonl has a 2,048-token decode for the next
session with one).
"""

import bisect

import pytest

import vramwidget as vw
from vramwidget.allocator.caching import AllocatorConfig, replay_runs
from vramwidget.model.architecture import load
from vramwidget.inference.estimate import InferenceSetup
from vramwidget.inference.events import cached_runs, replay_parts
from vramwidget.units import MIB

LARGE_AFTER_PREFILL = 15476 * MIB
PHASE_B = 34 * 20 * MIB


def _large_pool(context_len):
    arch = load("llama-3.1-8b")
    parts = replay_parts(cached_runs(arch, InferenceSetup.from_kwargs(context_len=context_len, prompt_len=128)))
    log = []
    res = replay_runs(parts, AllocatorConfig(), growth_log=log)
    large = [(g, r) for g, small, r in sorted(log) if not small]
    return res, large, len(parts[0])


def test_8k_decode_reserve_is_the_sum_of_its_mechanisms():
    res, large, prefill_events = _large_pool(8192)
    idx = [g for g, _ in large]
    at_prefill = large[bisect.bisect_left(idx, prefill_events) - 1][1]
    assert at_prefill == LARGE_AFTER_PREFILL
    assert large[-1][1] == LARGE_AFTER_PREFILL + PHASE_B + 31 * (12 + 14 + 16) * MIB == 17458 * MIB
    # the 20 MiB segments of step 3, then the 12, 14 and 16 MiB rings of step 4
    grown = [b - a for (_, a), (_, b) in zip(large, large[1:]) if _ >= prefill_events]
    assert sorted(set(grown)) == [12 * MIB, 14 * MIB, 16 * MIB, 20 * MIB]
    assert grown.count(20 * MIB) == 34 and grown.count(12 * MIB) == grown.count(16 * MIB) == 31


@pytest.mark.slow
def test_32k_decode_reserve_is_the_sum_of_its_mechanisms_and_fits_an_rtx_4090_tight(capsys):
    """The 32k figure of the docstring, and the verdict on an RTX 4090 by its capacity replay
    in the API and the CLI (the widget reads the same InferenceEstimate: test_widget_modes)."""
    res, large, _ = _large_pool(32768)
    rings = 31 * (12 + 14 + 16 + 18 + 20) + 65 * sum(range(22, 65, 2))
    assert large[-1][1] == LARGE_AFTER_PREFILL + PHASE_B + rings * MIB == 80126 * MIB
    est = vw.estimate_inference("llama-3.1-8b", prompt_len=128, context_len=32768, gpu="RTX 4090")
    assert est.unlimited_reserved_bytes == res.max_reserved_bytes
    assert est.unlimited_reserved_bytes + est.cuda_context_bytes > 24248 * MIB        # over the card without a limit
    assert est.fits and est.squeezed                                              # fits, tight: by the freeing
    assert est.reserved_bytes < est.unlimited_reserved_bytes / 3
    assert "frees its cached blocks" in est.allocator_note
    from vramwidget.cli import main

    assert main(["infer", "llama-3.1-8b", "--prompt-len", "128", "--context-len", "32768", "--gpu", "RTX-4090"]) == 0
    text = capsys.readouterr().out
    assert "RTX 4090: fits, tight" in text and "frees its cached blocks" in text


def _decode(context_len, prompt_len=128):
    s = InferenceSetup.from_kwargs(context_len=context_len, prompt_len=prompt_len)
    return load("llama-3.1-8b"), s


def test_a_long_decode_is_replayed_at_the_largest_cards_limit(monkeypatch):
    """A decode longer than LONG_DECODE_STEPS is replayed with the free-and-retry at the largest
    card of the catalog.  Below that capacity nothing is freed, so its reserve is the unlimited
    replay's to the byte (here with the threshold lowered to 64 steps: an 8,064-token decode of
    Llama-3.1-8B from a 128-token prompt, 17,528 MiB reserved for 16,389 MiB allocated); above it the reserve stops at the capacity instead of one more segment per
    layer and step (the allocator's state, and the replay's own memory, stay bounded: a
    10^6-token decode reserved 5 GB of the replay's own memory a minute before this)."""
    from vramwidget.allocator.caching import parse_alloc_conf
    from vramwidget.inference import events as E

    arch, s = _decode(8192)
    cfg = parse_alloc_conf(s.allocator)
    ref = replay_runs(replay_parts(cached_runs(arch, s), cfg), cfg)
    unlimited = ref.max_reserved_bytes
    E.clear_caches()
    monkeypatch.setattr(E, "LONG_DECODE_STEPS", 64)
    assert E.replay_inference(arch, s).max_reserved_bytes == unlimited
    # a card smaller than the unlimited reserve: the replay frees and retries at its limit
    E.clear_caches()
    # 97% of it (17,002 MiB): the cached segments no longer all fit, the retry frees them (at
    # 90% the blocks still in use no longer fit: an out-of-memory error, as on a real card)
    cap = int(unlimited * 0.97)
    monkeypatch.setattr(E, "largest_card_bytes", lambda: cap)
    capped = E.replay_inference(arch, s)
    assert capped.oom is None and capped.max_reserved_bytes <= cap < unlimited
    E.clear_caches()


def test_the_largest_card_is_the_catalogs():
    from vramwidget.gpus import list_gpus
    from vramwidget.inference.events import largest_card_bytes

    assert largest_card_bytes() == max(g.memory_gb for g in list_gpus()) * 2**30
    assert largest_card_bytes() >= 141 * 2**30      # the H200 the validation cases ran on
