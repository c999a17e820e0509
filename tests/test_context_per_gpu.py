"""Each card's own CUDA context in the device total (issue 13, item 2: the verdict uses the
usable capacity per GPU).

An estimate made on a card counts that card's CUDA context (``gpus.context_for``), and every
judge -- the verdict, ``fit``, ``fit_map``, the suggestions, the widget -- holds it against
what CUDA reports as the card's total (``verdict.capacity_bytes``: ``mem_get_info()``'s
total, nvidia-smi's less the driver's own reserve).  Without a GPU the estimate keeps the
H200 measurement of the validation cases (620.8 MiB) and says so.

The figures and their sources (vramwidget/data/gpus.json):

* Hopper (H200, H100): 620.8 MiB, this package's H200 measurements
  (data/h200_training_a.jsonl env.cuda_context_mib: total - free - reserved after
  torch.zeros(1), torch 2.11.0+cu130);
* Ada Lovelace (RTX 4090): 426 MiB, unslothai/unsloth-zoo PR 1053 (an RTX 6000 Ada,
  torch 2.10.0+cu130, nvidia-smi after torch.cuda.mem_get_info);
* Turing (T4): 274 MiB, pytorch/pytorch PR 86509 (287,047,680 B with lazy loading);
* RTX 4090's CUDA total: 24,248 MiB (zai-org/CogVideo issue 36: "23.68 GiB total capacity");
  the H200's: nvidia-smi's 143,771 MiB less the Hopper driver reserve, 550 MiB (the H100's
  81,559 - 81,009 MiB, vLLM issue 27508).
"""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vramwidget as vw
from vramwidget.fit import solver as fit, verdict
from vramwidget import gpus
from vramwidget.fit.fitmap import fit_map
from vramwidget.inference.estimate import estimate_inference
from vramwidget.units import CUDA_CONTEXT_BYTES, MIB

MODEL = "llama-3.2-1b"
SETUP = dict(batch_size=2, seq_len=1024)
#: the contexts of gpus.json, by hand (see the module docstring for their sources)
HOPPER_MIB, ADA_MIB, TURING_MIB = 620.8, 426.0, 274.0


def test_the_catalog_figures_are_the_ones_quoted():
    assert gpus.context_bytes("H200")[0] == HOPPER_MIB * MIB == CUDA_CONTEXT_BYTES
    assert gpus.context_bytes("RTX 4090")[0] == ADA_MIB * MIB
    assert "unsloth-zoo PR 1053" in gpus.context_bytes("RTX 4090")[1]
    assert gpus.context_bytes("T4")[0] == TURING_MIB * MIB
    assert gpus.get_gpu("RTX 4090").cuda_total_bytes == 24248 * MIB
    assert gpus.get_gpu("H200").cuda_total_bytes == (143771 - 550) * MIB


def test_device_totals_differ_by_the_cards_contexts():
    """The same setup on an H200 and on an RTX 4090: the same allocator reserve, device
    totals apart by exactly 620.8 - 426 = 194.8 MiB; without a GPU, the H200's figure."""
    h200 = vw.estimate(MODEL, gpu="H200", **SETUP)
    ada = vw.estimate(MODEL, gpu="RTX 4090", **SETUP)
    none = vw.estimate(MODEL, **SETUP)
    assert h200.reserved_bytes == ada.reserved_bytes == none.reserved_bytes
    assert h200.device_total_bytes - ada.device_total_bytes == pytest.approx((HOPPER_MIB - ADA_MIB) * MIB, abs=1e-3)
    assert ada.device_total_bytes == ada.reserved_bytes + ADA_MIB * MIB
    # no GPU chosen: today's figure, the H200 measurement, and the estimate says so
    assert none.device_total_bytes == h200.device_total_bytes
    assert none.cuda_context_bytes == CUDA_CONTEXT_BYTES and "no GPU chosen" in none.cuda_context_source
    assert none.to_dict()["cuda_context_source"] == gpus.NO_GPU_CONTEXT_SOURCE
    # the component tree's "cuda context" box is the card's, with its source, and the tree
    # still adds up to the device total
    for est, mib in ((h200, HOPPER_MIB), (ada, ADA_MIB), (none, HOPPER_MIB)):
        box = next(c for c in est.components if c.name == "cuda context")
        assert box.bytes == mib * MIB and box.formula == est.cuda_context_source
        assert sum(c.bytes for c in est.components) == pytest.approx(est.device_total_bytes, rel=1e-9)


def test_set_gpu_moves_the_context_of_a_built_tree():
    """Choosing the card after the tree was built (the widget, ``estimate --gpu``) moves the
    device total and the box together; going back to no GPU restores the H200's.  On a
    T4 (14.7 GiB for torch) this step's reserve without a limit (15.1 GB) is over the card and
    its allocated peak is not: the reserve is the one of a replay with the T4's capacity
    (``gpus.judge_on``), and the tree's "allocator reserve" box follows it."""
    est = vw.estimate(MODEL, **SETUP)
    before = est.device_total_bytes
    assert sum(c.bytes for c in est.components) == pytest.approx(before, rel=1e-9)
    est.set_gpu("RTX 4090")     # room to spare: the same reserve, another context
    assert before - est.device_total_bytes == pytest.approx((HOPPER_MIB - ADA_MIB) * MIB, abs=1e-3)
    assert sum(c.bytes for c in est.components) == pytest.approx(est.device_total_bytes, rel=1e-9)
    est.set_gpu("T4")
    assert before - (est.unlimited_reserved_bytes + est.cuda_context_bytes) == pytest.approx(
        (HOPPER_MIB - TURING_MIB) * MIB, abs=1e-3)
    judged = gpus.judge_on(est, "T4")
    assert judged["case"] == "capacity_replay" and judged["fits"]
    assert est.device_total_bytes == judged["need_bytes"] <= gpus.capacity_bytes("T4")
    assert est.reserved_bytes < est.unlimited_reserved_bytes
    assert sum(c.bytes for c in est.components) == pytest.approx(est.device_total_bytes, rel=1e-9)
    assert "frees its cached blocks" in est.allocator_note
    reserve_box = [c for c in est.components if c.name == "allocator reserve"][0]
    assert est.allocator_note in reserve_box.formula
    assert est.component_bytes()["cuda context"] == TURING_MIB * MIB
    est.set_gpu(None)
    assert est.device_total_bytes == before and est.allocator_note == ""


def test_parallel_and_inference_count_the_cards_context():
    kw = dict(method="lora", strategy="zero3", num_gpus=2, **SETUP)
    h200 = vw.estimate_parallel(MODEL, gpu="H200", **kw)
    ada = vw.estimate_parallel(MODEL, gpu="RTX 4090", **kw)
    assert h200.device_total_bytes - ada.device_total_bytes == pytest.approx((HOPPER_MIB - ADA_MIB) * MIB, abs=1e-3)
    assert ada.per_gpu.component_bytes()["cuda context"] == ADA_MIB * MIB
    assert all(st.estimate.cuda_context_bytes == ADA_MIB * MIB for st in ada.stages)
    # generate(): the same (it used the H200's constant whatever the card)
    gi = dict(context_len=4096, batch_size=1)
    ih, ia, i0 = (estimate_inference(MODEL, gpu="H200", **gi), estimate_inference(MODEL, gpu="RTX 4090", **gi),
                  estimate_inference(MODEL, **gi))
    assert ih.device_total_bytes - ia.device_total_bytes == pytest.approx((HOPPER_MIB - ADA_MIB) * MIB, abs=1e-3)
    assert i0.device_total_bytes == ih.device_total_bytes
    assert ia.component_bytes()["cuda context"] == ADA_MIB * MIB
    assert ia.fits == (ia.device_total_bytes <= 24248 * MIB) and ia.gpu_usable_bytes == 24248 * MIB


def _card_with_line_at(name, need_bytes):
    """The catalogue card ``name`` with its CUDA total moved so that the line falls at
    ``need_bytes`` (its context, generation and driver reserve unchanged)."""
    return replace(gpus.get_gpu(name), cuda_total_mib=need_bytes / MIB)


@pytest.mark.parametrize("name", ["RTX 4090", "H200", "T4"])
def test_the_line_is_the_cuda_total_less_the_cards_own_context(name, monkeypatch):
    """Where "just fits" turns into "just does not": the reserved memory at the CUDA total
    less the card's own context (= what torch can allocate, ``gpus.usable_capacity``).  On
    the real cards first, then on the card with its total moved a byte either side of a real
    estimate's need, where the verdict (band off), ``fit.check`` and ``fit_map`` flip together."""
    g = gpus.get_gpu(name)
    est = vw.estimate(MODEL, **SETUP)           # made without a GPU: judged with the card's own context
    v = verdict.verdict(est, g)
    line = g.cuda_total_bytes - gpus.context_bytes(g)[0]
    assert line == gpus.usable_capacity(g)[0] == v["usable_capacity_bytes"]
    assert v["headroom_bytes"] == pytest.approx(line - gpus.judge_on(est, g)["reserved_bytes"], abs=1e-3)
    if name == "H200":   # a derived total: nvidia-smi's less the Hopper driver reserve
        assert line == (143771 - 550 - HOPPER_MIB) * MIB
    if name == "RTX 4090":
        assert line == (24248 - ADA_MIB) * MIB

    # the line itself: the band (the predicted reserve's own uncertainty) set to nothing
    band = verdict.uncertainty()
    monkeypatch.setattr(verdict, "uncertainty", lambda: dict(band, rel_error=0.0))
    need = est.reserved_bytes + gpus.context_bytes(g)[0]
    # a byte over the unlimited reserve's line the card's allocator frees its cached blocks
    # and retries (gpus.judge_on): a replay with the card's capacity decides, and the verdict,
    # fit.check, fit_map and the estimate made on that card take the same answer and reserve
    peak_line = est.peak_allocated_bytes + gpus.context_bytes(g)[0]
    for margin in (+1.0, -1.0):
        card = _card_with_line_at(name, need + margin)
        assert abs(card.cuda_total_bytes - (need + margin)) < 1e-3
        v = verdict.verdict(est, card)
        judged = gpus.judge_on(est, card)
        c = fit.check(MODEL, card, **SETUP)
        df = fit_map(MODEL, card, batch_sizes=[SETUP["batch_size"]], seq_lens=[SETUP["seq_len"]], exact=True)
        on = vw.estimate(MODEL, gpu=card, **SETUP)
        if margin > 0:      # the unlimited reserve fits: no capacity replay, as before
            assert judged["case"] == "reserve" and v["state"] == "fits" and c.fits
            assert c.device_total_bytes == need == df["device_total_bytes"][0] == on.device_total_bytes
        else:
            assert judged["case"] == ("capacity_replay" if peak_line <= need + margin else "peak")
            replayed = est.replay(capacity_bytes=card.cuda_total_bytes - gpus.context_bytes(g)[0])
            assert judged["fits"] is (replayed.oom is None)
            # fitting only by the allocator freeing its cached blocks is tight at best
            assert v["state"] == (("tight" if judged["squeezed"] else "fits") if judged["fits"] else "does_not_fit")
            assert c.fits is judged["fits"]
            assert c.device_total_bytes == judged["need_bytes"] == df["device_total_bytes"][0] == on.device_total_bytes
            if judged["fits"]:
                assert judged["need_bytes"] <= card.cuda_total_bytes
                assert v["reserved_bytes"] == replayed.max_reserved_bytes < est.reserved_bytes
        assert (v["headroom_bytes"] >= 0) is (v["state"] != "does_not_fit")
        assert df["state"][0] == v["state"]


def test_fit_answers_agree_on_a_non_hopper_card():
    """One setup on an RTX 4090: the verdict, fit.check, fit_map, the largest batch and the
    suggestions use the same device total (reserved + 426 MiB) and the same 24,248 MiB."""
    kw = dict(method="qlora", gradient_checkpointing="full", seq_len=2048)
    b = fit.max_batch_size(MODEL, "RTX 4090", **kw)
    assert b >= 1
    for batch, fits_expected in ((b, True), (b + 1, False)):
        est = vw.estimate(MODEL, gpu="RTX 4090", batch_size=batch, **kw)
        c = fit.check(MODEL, "RTX 4090", batch_size=batch, **kw)
        v = verdict.verdict(est, "RTX 4090")
        df = fit_map(MODEL, "RTX 4090", batch_sizes=[batch], seq_lens=[kw["seq_len"]], exact=True,
                     **{k: x for k, x in kw.items() if k != "seq_len"})
        assert c.device_total_bytes == est.device_total_bytes == v["need_bytes"] == df["device_total_bytes"][0]
        assert c.usable_bytes == v["capacity_bytes"] == 24248 * MIB
        assert c.fits is fits_expected and (v["headroom_bytes"] >= 0) is fits_expected
        assert df["state"][0] == v["state"]


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from([g.name for g in gpus.list_gpus()]),
       batch=st.sampled_from([1, 2]), seq=st.sampled_from([256, 1024]))
def test_every_catalog_card_counts_its_own_context(name, batch, seq):
    """Invariants on every card of the catalogue: the device total made on the card is the
    no-GPU one moved by exactly (card's context - the H200's); the verdict of either is the
    same; its headroom is what torch can allocate there less the reserved memory."""
    on = vw.estimate(MODEL, gpu=name, batch_size=batch, seq_len=seq)
    off = vw.estimate(MODEL, batch_size=batch, seq_len=seq)
    ctx = gpus.context_bytes(name)[0]
    assert on.cuda_context_bytes == ctx == on.component_bytes()["cuda context"]
    assert on.unlimited_reserved_bytes + ctx - off.device_total_bytes == pytest.approx(ctx - CUDA_CONTEXT_BYTES,
                                                                                          abs=1e-3)
    if gpus.judge_on(on, name)["case"] != "capacity_replay":
        assert on.device_total_bytes - off.device_total_bytes == pytest.approx(ctx - CUDA_CONTEXT_BYTES, abs=1e-3)
    a, b = verdict.verdict(on, name), verdict.verdict(off, name)
    # the reserve on the card (its allocator frees cached blocks at the limit): the estimate
    # made on the card carries it, the no-GPU one is judged to it
    assert a["need_bytes"] == b["need_bytes"] == on.device_total_bytes == gpus.judge_on(off, name)["need_bytes"]
    assert a["state"] == b["state"] and a["capacity_bytes"] == gpus.get_gpu(name).cuda_total_bytes
    assert a["headroom_bytes"] == pytest.approx(gpus.usable_capacity(name)[0] - on.reserved_bytes, abs=1e-3)
