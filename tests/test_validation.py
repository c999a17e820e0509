"""The estimator against the 45 training steps measured on an H200 (the shipped copy of
../shared/validation/h200_training_a.jsonl).  These bounds are the acceptance criteria
of issue 3; a change that loses accuracy fails here."""

import pytest

from vramwidget.measure.validate import BUILTIN_CASES, load_cases, summarize, to_json_rows, validate


@pytest.fixture(scope="module")
def result():
    return validate(BUILTIN_CASES)


def test_every_case_is_estimated(result):
    assert len(result["cases"]) == 45
    assert all("error" in r for r in result["cases"]), [r.get("error_message") for r in result["cases"]]


def test_peak_allocated_bounds(result):
    s = result["summary"]["peak_allocated_mib"]
    assert s["n"] == 45
    assert s["median"] <= 0.03, s
    assert s["p90"] <= 0.07, s
    assert s["max"] <= 0.12, s


def test_step_seconds_bounds(result):
    """The step time (issue 15, vramwidget/timing.py) on the same 45 steps, timed on the H200
    they ran on: median |error| <= 15%, 90th percentile <= 30%.  Here too, so that a change
    to the traced blocks that throws the time off fails in the guard tests."""
    s = result["summary"]["step_seconds"]
    assert s["n"] == 45
    assert s["median"] <= 0.15, s
    assert s["p90"] <= 0.30, s


def test_weights_within_2_percent_on_every_case(result):
    worst = max(result["cases"], key=lambda r: abs(r["error"]["weights_mib"]))
    assert abs(worst["error"]["weights_mib"]) <= 0.02, (worst["id"], worst["error"]["weights_mib"])


def test_persistent_median_within_3_percent(result):
    assert result["summary"]["persistent_after_step_mib"]["median"] <= 0.03


def test_every_phase_is_close(result):
    """Forward, backward and optimizer-step peaks each within 10% median (they are
    not scored, but a right peak for the wrong phase would be luck)."""
    for f in ("forward_peak_mib", "backward_peak_mib", "optimizer_step_peak_mib"):
        assert result["summary"][f]["median"] <= 0.02, (f, result["summary"][f])


def test_peak_phase_matches_measurement(result):
    """The phase that holds the peak is the measured one in at least 40 of 45 cases."""
    names = {"forward": "forward_peak_mib", "backward": "backward_peak_mib",
             "optimizer_step": "optimizer_step_peak_mib"}
    agree = 0
    for r in result["cases"]:
        m = r["measured"]
        measured_phase = max(names, key=lambda k: m[names[k]])
        p = r["predicted"]
        predicted_phase = max(names, key=lambda k: p[names[k]])
        agree += measured_phase == predicted_phase
    assert agree >= 40


def test_json_rows_shape(result):
    rows = to_json_rows(result)
    assert len(rows) == 45
    # step_seconds: the cases ran on an H200, a catalogue GPU (env.gpu), so they are timed too
    assert set(rows[0]["predicted"]) == {"params_total", "params_trainable", "weights_mib", "peak_allocated_mib",
                                         "max_reserved_mib", "step_seconds"}


def test_runs_on_unseen_cases(tmp_path):
    """Any file in the format works: a case edited to a shape never measured."""
    import json

    c = load_cases(BUILTIN_CASES)[0]
    c = dict(c, id="new1", model=dict(c["model"], num_hidden_layers=3, hidden_size=512, head_dim=16,
                                        intermediate_size=1024))
    c["training"] = dict(c["training"], batch_size=3, seq_len=77)
    p = tmp_path / "cases.jsonl"
    p.write_text(json.dumps(c) + "\n")
    out = validate(str(p))
    assert out["cases"][0]["predicted"]["peak_allocated_mib"] > 0
    assert summarize(out["cases"])["peak_allocated_mib"]["n"] == 1


def test_inference_cases_are_estimated(tmp_path):
    """A generate() case (prompt + new tokens) is predicted with estimate_inference: the KV
    cache of Llama-3.2-1B for 4 x (2048 + 128 - 1) tokens (generate() never caches its last
    token) is 2 x 16 x 8 x 64 x 2 B per token."""
    import json

    model = load_cases(BUILTIN_CASES)[0]["model"]
    case = {"id": "i1", "name": "llama-3.2-1b", "model": model,
            "inference": {"weights_dtype": "bfloat16", "attn_implementation": "sdpa", "batch_size": 4,
                          "prompt_len": 2048, "max_new_tokens": 128},
            "measured": {"kv_cache_mib": 4 * 2175 * 2 * 16 * 8 * 64 * 2 / 2**20}}
    p = tmp_path / "inf.jsonl"
    p.write_text(json.dumps(case) + "\n")
    row = validate(str(p))["cases"][0]
    assert row["kind"] == "inference"
    assert row["predicted"]["kv_cache_mib"] == pytest.approx(4 * 2175 * 2 * 16 * 8 * 64 * 2 / 2**20)
    assert row["error"]["kv_cache_mib"] == pytest.approx(0.0)
    assert row["predicted"]["peak_allocated_mib"] >= row["predicted"]["weights_mib"]
