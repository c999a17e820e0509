"""The verdict: one measure (device total on the card vs its CUDA total), three states, a band taken
from the validation errors of the predicted reserved memory; and the one byte format."""

import pytest

import vramwidget as vw
from vramwidget import validate as V
from vramwidget import verdict
from vramwidget.gpus import get_gpu
from vramwidget.units import GIB, MIB, fmt_bytes


def test_band_is_the_validation_error_of_the_reserved_prediction():
    """The band is recomputed from the shipped measured cases, so it follows the predictor
    (today's rule of thumb: 3.1% median, 9.9% p90, 19% worst over 45 H200 cases)."""
    u = verdict.uncertainty()
    summary = V.validate(V.BUILTIN_CASES)["summary"]["max_reserved_mib"]
    assert u["rel_error"] == summary["p90"] and u["n_cases"] == summary["n"] == 45
    assert u["median"] <= u["rel_error"] <= u["max"]
    assert 0.0 < u["rel_error"] < 0.5


def test_three_states_around_the_line():
    est = vw.estimate("llama-3.2-1b", batch_size=2, seq_len=1024)
    band = verdict.band_bytes(est.reserved_bytes)
    need = est.device_total_bytes
    assert verdict.state_of(need, need + band * 1.01, band) == "fits"
    # (just inside the band: need + band - need is not always band in floating point)
    assert verdict.state_of(need, need + band * 0.999, band) == "tight"
    assert verdict.state_of(need, need, band) == "tight"
    # issue 25: over the line is "does not fit", even within the band ("tight" only under it)
    assert verdict.state_of(need, need - band * 0.999, band) == "does_not_fit"
    assert verdict.state_of(need, need - band * 1.01, band) == "does_not_fit"


def test_verdict_judges_the_device_total_not_allocated():
    """Llama 3.1 8B QLoRA, batch 4: allocated and device total fall on different sides of
    an 80 GB card's line only if they are confused; the verdict uses the device total."""
    est = vw.estimate("llama-3.1-8b", method="qlora", batch_size=4, seq_len=2048)
    v = verdict.verdict(est, "H100-80GB")
    g = get_gpu("H100-80GB")
    assert v["measure"] == "device_total"
    # an H100 is a Hopper: its own context is the H200's measured 620.8 MiB the estimate
    # made without a GPU counts, so the device totals agree
    assert v["need_bytes"] == est.device_total_bytes == est.reserved_bytes + est.cuda_context_bytes
    # judged against what CUDA reports as the total: 81,009 MiB, "total capacity of 79.11 GiB"
    # in torch's out-of-memory message (vLLM issue 27508), not nvidia-smi's 81,559 MiB
    assert v["capacity_bytes"] == g.cuda_total_bytes == 81009 * MIB
    assert v["headroom_bytes"] == g.cuda_total_bytes - est.device_total_bytes
    assert v["band_bytes"] == pytest.approx(est.reserved_bytes * verdict.uncertainty()["rel_error"])
    assert set(v) >= {"state", "measure", "need_bytes", "capacity_bytes", "headroom_bytes", "band_bytes"}


def test_describe():
    est = vw.estimate("llama-3.2-1b", batch_size=1, seq_len=512)
    text = verdict.describe(verdict.verdict(est, "H100-80GB"))
    assert text.startswith("fits H100 80GB: ") and "to spare" in text and "%" in text
    big = vw.estimate("llama-2-7b", method="full", batch_size=8)
    assert verdict.describe(verdict.verdict(big, "RTX 4090")).startswith("does not fit RTX 4090: ")


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"), (512, "512 B"), (300 * 1024, "300 KiB"), (612.4 * MIB, "612 MiB"),
    (1000 * MIB, "1,000 MiB"), (9.96 * GIB, "9.96 GiB"), (23.46 * GIB, "23.5 GiB"),
    (854.6 * GIB, "855 GiB"), (854694 * GIB, "835 TiB"), (2.1 * 1024 * GIB, "2.10 TiB"),
    (-0.09 * GIB, "-92 MiB"),
])
def test_fmt_bytes(nbytes, text):
    """Automatic binary units, thousands separators (the issue's '854694 GiB' is 835 TiB)."""
    assert fmt_bytes(nbytes) == text
