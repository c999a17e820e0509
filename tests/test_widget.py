"""The Calculator widget, kernel side: traits in, estimate, rows and summary out.

No browser here (tests/test_bundle.py renders the chart specs headless in Node; the
JupyterLab tests drive the real frontend).  The memory numbers come from
vramwidget.estimate; these tests check the wiring: what changes when a trait changes,
what stays when input is bad, and which controls are linked.
"""

from __future__ import annotations

import json
import math

import altair as alt
import pytest

import vramwidget as vw
from vramwidget.show import charts
from vramwidget.errors import VramError
from vramwidget.widget import (
    ESTIMATE_INPUTS,
    INPUTS,
    SCENARIOS,
    YOUR_SETUP,
    Calculator,
    number_formats,
)

MODEL = "llama-3.2-1b"

#: the architecture of Llama 3.2 1B as its config.json gives it (a01 of the validation set)
LLAMA_32_1B_CONFIG = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": True, "rope_theta": 500000.0, "head_dim": 64,
}


@pytest.fixture()
def calc():
    return Calculator(MODEL, gpu="RTX 4090")


def test_estimate_matches_the_calculator(calc):
    """The widget shows exactly what estimate() returns for the same keyword arguments."""
    direct = vw.estimate(MODEL, **{k: v for k, v in calc.setup().items() if k != "model"})
    assert calc.estimate.peak_allocated_bytes == direct.peak_allocated_bytes
    assert calc.summary["peak_gib"] == pytest.approx(direct.peak_gib)
    assert calc.summary["model"] == MODEL
    assert calc.error == ""


def test_setting_batch_size_updates_estimate_and_rows(calc):
    before_est, before_rows = calc.estimate, calc.rows
    specs = calc.specs
    calc.batch_size = 8
    assert calc.estimate is not before_est
    assert calc.estimate.setup["batch_size"] == 8
    assert calc.estimate.peak_allocated_bytes > before_est.peak_allocated_bytes
    assert calc.rows is not before_rows
    calc.wait()
    assert set(calc.rows) == {"detail", "comparison", "phases", "fitmap"}
    detail = {(r["component"], r["group"]): r["bytes"] for r in calc.rows["detail"] if r["level"] == "group"}
    old = {(r["component"], r["group"]): r["bytes"] for r in before_rows["detail"] if r["level"] == "group"}
    assert detail[("weights", "mlp")] == old[("weights", "mlp")]          # weights do not move
    assert sum(b for (c, _), b in detail.items() if c == "activations") > \
        sum(b for (c, _), b in old.items() if c == "activations")         # activations grow
    # the specs were built once and are not rebuilt on an update
    assert calc.specs is specs


def test_an_unreplayed_setup_is_shown_provisional_then_refined(calc):
    """Issue 10: the update never runs an uncached allocator replay.  A sequence length no
    replay has seen (1536: not on the fit map's grid, not in the batch search) is drawn at
    once with the provisional device total (events.provisional_reserved_bytes), the verdict
    says so, and the worker sets the exact one."""
    from vramwidget.allocator.replays import cached_replay

    calc.wait()
    # 1536, or the next length whose replay no earlier test of this process has cached (the
    # replay cache is per process, and a replay serves every size with the same event stream)
    base = {k: v for k, v in calc.setup().items() if k != "model"}
    calc.seq_len = next(x for x in range(1536, 8192, 8) if x & (x - 1) and not vw.estimate(
        calc._arch, gpu=calc.gpu, **dict(base, seq_len=x)).reserved_exact)
    s = calc.estimate.sources.setup
    # one read of the published summary (the verdict is inside it): the worker may publish
    # the exact figures at any moment after the update (a replay here takes milliseconds)
    drawn = calc.summary
    provisional = drawn["verdict"]["need_bytes"]
    assert drawn["verdict"]["provisional"] is True and drawn["provisional"] is True
    assert provisional == drawn["device_total_bytes"]
    # the comparison's scenarios are worked out in the background: the frontend keeps the
    # comparison it has until they arrive
    assert set(calc.rows) == {"detail", "phases", "fitmap"}
    reserve = [r for r in calc.rows["detail"] if r["component"] == "allocator reserve"]
    assert reserve and reserve[0]["formula"].startswith("provisional")
    calc.wait()
    assert cached_replay(calc._arch, s) is not None
    reserve = [r for r in calc.rows["detail"] if r["component"] == "allocator reserve"]
    assert reserve and reserve[0]["formula"].startswith("caching allocator")
    assert calc.status == "idle" and calc.status_text == ""
    assert "provisional" not in calc.verdict and calc.summary["provisional"] is False
    assert calc.verdict["need_bytes"] == calc.estimate.device_total_bytes
    assert calc.summary["device_total_bytes"] == calc.estimate.device_total_bytes
    # the provisional figure was the guess (allocated peak x a reserved / allocated ratio), not this
    assert provisional != calc.estimate.device_total_bytes
    assert set(calc.rows) == {"detail", "comparison", "phases", "fitmap"}
    mine = [r for r in calc.rows["comparison"] if r["level"] == "title" and r["scenario"] == "your setup"]
    assert mine[0]["bytes"] == calc.estimate.device_total_bytes


def test_rows_are_the_treemap_of_the_estimate(calc):
    groups = [r for r in calc.rows["detail"] if r["level"] == "group"]
    total = sum(c.bytes for c in calc.estimate.components)
    assert sum(r["bytes"] for r in groups) == pytest.approx(total)
    from vramwidget.widget import DETAIL_SIZE

    width, height = DETAIL_SIZE
    assert sum((r["x2"] - r["x"]) * (r["y2"] - r["y"]) for r in groups) == pytest.approx(width * height)


def test_comparison_holds_every_scenario_on_one_scale(calc):
    rows = calc.rows["comparison"]
    names = [r["scenario"] for r in rows if r["level"] == "title"]
    assert names == [YOUR_SETUP] + [n for n, _ in SCENARIOS]
    k = None
    for r in rows:
        if r["level"] == "component":
            ratio = (r["x2"] - r["x"]) * (r["y2"] - r["y"]) / r["bytes"]
            k = k or ratio
            assert ratio == pytest.approx(k, rel=1e-6)
    # the user's default setup (full, pure bf16) is the "pure BF16" scenario
    totals = {r["scenario"]: r["bytes"] for r in rows if r["level"] == "title"}
    assert totals[YOUR_SETUP] == totals["pure BF16"]
    assert totals["FP32 full"] > totals["BF16 mixed"] > totals["pure BF16"] > totals["4-bit QLoRA"]
    # the GPU outline is drawn once per scenario
    caps = [r for r in rows if r["level"] == "capacity"]
    assert len(caps) == len(names) and caps[0]["label"].startswith("RTX 4090")
    # the scenarios are real estimates with the user's batch and sequence length
    scen = dict(calc.scenarios)
    assert scen["FP32 full"].setup["precision"] == "fp32"
    assert scen["4-bit QLoRA"].setup["quantization"] == "nf4"
    assert all(e.setup["seq_len"] == calc.seq_len for e in scen.values())


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="'batchsize'.*'colour'|'colour'.*'batchsize'"):
        Calculator(MODEL, batchsize=4, colour="red")


def test_keywords_are_the_traits():
    c = Calculator(MODEL, batch_size=2, seq_len=512, method="lora", lora_r=8, gpu="A100 80GB")
    assert (c.batch_size, c.seq_len, c.method, c.lora_r) == (2, 512, "lora", 8)
    assert c.estimate.setup["lora_r"] == 8
    assert c.summary["gpu"] == "A100 80GB" and c.summary["fits"] is True


def test_input_traits_are_synced_and_documented():
    for name in INPUTS:
        trait = Calculator.class_traits()[name]
        assert trait.metadata.get("sync") is True, name
        assert trait.help, f"{name} has no help text"
    # the input names are estimate()'s keyword names
    from vramwidget.training import TrainingSetup

    fields = set(TrainingSetup.__dataclass_fields__)
    assert set(ESTIMATE_INPUTS) - {"model"} <= fields


def test_bad_config_json_sets_error_and_keeps_the_last_estimate(calc):
    calc.batch_size = 2
    est, rows, summary = calc.estimate, calc.rows, calc.summary
    traits = {name: getattr(calc, name) for name in INPUTS if name != "config_json"}
    calc.config_json = '{"model_type": "llama", "hidden_size": 2048,'  # cut off
    assert calc.error.startswith("config: pasted config.json is not valid JSON")
    assert "\n" not in calc.error
    assert calc.error_field == "config_json"
    assert calc.estimate is est and calc.rows is rows and calc.summary is summary
    assert calc.config_json == '{"model_type": "llama", "hidden_size": 2048,'   # left as typed
    assert {name: getattr(calc, name) for name in traits} == traits
    # a valid config clears the error
    calc.config_json = json.dumps(LLAMA_32_1B_CONFIG)
    assert calc.error == ""
    assert calc.disabled["model"].startswith("a pasted config.json is the model")
    assert calc.estimate.params_total == 1_235_814_400   # measured case a01: params_total
    calc.config_json = ""
    assert "model" not in calc.disabled and calc.estimate.model_name == MODEL


def test_bad_value_keeps_the_trait_as_entered(calc):
    est = calc.estimate
    calc.batch_size = 0
    assert calc.batch_size == 0
    assert calc.error and calc.error_field == "batch_size"
    assert calc.estimate is est
    calc.model = "llama-9-1b"
    assert calc.model == "llama-9-1b"
    assert "unknown preset" in calc.error and calc.error_field == "model"
    calc.model = MODEL
    calc.batch_size = 1
    assert calc.error == ""


def test_invalid_setup_at_construction_raises():
    with pytest.raises(VramError, match="unknown preset"):
        Calculator("no-such-model-xyz")


def test_config_dict_as_model():
    c = Calculator(LLAMA_32_1B_CONFIG)
    assert c.estimate.params_total == 1_235_814_400
    assert json.loads(c.config_json)["hidden_size"] == 2048


def test_qlora_links_quantization(calc):
    assert calc.quantization == "none"
    calc.method = "qlora"
    assert calc.quantization == "nf4"
    assert calc.estimate.setup["quantization"] == "nf4"
    assert "lora_r" not in calc.disabled and "double_quant" not in calc.disabled
    calc.quantization = "int8"               # QLoRA on an 8-bit base stays QLoRA
    assert calc.method == "qlora" and "double_quant" in calc.disabled
    calc.method = "full"                      # a full fine-tune has no quantized base
    assert calc.quantization == "none"
    calc.method = "lora"
    calc.quantization = "fp4"                 # LoRA on a 4-bit base is QLoRA
    assert calc.method == "qlora"
    calc.quantization = "none"                # and back
    assert calc.method == "lora"
    assert calc.error == ""


def test_links_apply_to_constructor_keywords():
    c = Calculator(MODEL, method="qlora")
    assert c.quantization == "nf4" and c.estimate.setup["method"] == "qlora"
    c = Calculator(MODEL, quantization="nf4")
    assert c.method == "qlora"
    c = Calculator(MODEL, method="freeze")
    assert c.trainable_layers == 4
    c = Calculator(MODEL, method="qlora", quantization="int8")
    assert (c.method, c.quantization) == ("qlora", "int8")


def test_disabled_controls_say_why(calc):
    off = calc.disabled
    for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_targets"):
        assert "lora or qlora" in off[k]
    assert "freeze" in off["trainable_layers"]
    assert "quantized base" in off["quantized_groups"]
    calc.method = "lora"
    assert "lora_r" not in calc.disabled
    calc.method = "freeze"
    assert "trainable_layers" not in calc.disabled
    assert calc.trainable_layers == 4          # a quarter of Llama 3.2 1B's 16 layers
    assert calc.error == ""


def test_prepare_kbit_is_dropped_with_the_quantization(calc):
    calc.method = "qlora"
    calc.prepare_kbit = True
    assert calc.estimate.setup["prepare_kbit"] is True
    calc.method = "full"
    assert calc.prepare_kbit is False and calc.error == ""


def test_gpu_fit_and_unknown_gpu(calc):
    calc.batch_size = 1
    small = calc.summary
    # judged against what CUDA reports as the RTX 4090's total, 24,248 MiB ("23.68 GiB total
    # capacity", zai-org/CogVideo issue 36), with the card's own CUDA context (Ada: 426 MiB)
    assert small["gpu"] == "RTX 4090" and small["gpu_gib"] == pytest.approx(24248 / 1024)
    assert small["cuda_context_gib"] * 2**30 == calc.estimate.cuda_context_bytes == 426 * 2**20
    assert "unsloth-zoo PR 1053" in small["cuda_context_source"]
    assert small["fits"] == (calc.estimate.device_total_bytes <= 24248 * 2**20)
    calc.batch_size = 4
    calc.gpu = "T4"
    assert calc.summary["fits"] is False
    assert any("no bf16" in w for w in calc.summary["warnings"])
    calc.gpu = "H100"
    assert calc.summary["gpu"] == "H100 80GB" and calc.summary["fits"] is True
    calc.gpu = "H10"       # an unknown card is an error (issue 14: it left `error` empty), the estimate stays
    assert calc.error.startswith("gpu: unknown GPU 'H10'; did you mean") and calc.error_field == "gpu"
    assert calc.summary["gpu"] == "H100 80GB"
    calc.gpu = ""
    assert calc.summary["fits"] is None


def test_options_and_table(calc):
    opts = calc.options
    assert ["qlora", "QLoRA", "QLoRA (frozen 4-bit base)"] in opts["method"]   # short, long (tooltip)
    assert MODEL in [p[0] for p in opts["presets"]]
    assert ["H200", "H200", "H200 (140.4 GiB)"] in opts["gpus"]
    assert [m for m, _ in opts["lora_targets"]] == ["q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"]
    names = [r["component"] for r in calc.table]
    assert names[0] == "weights"
    assert sum(r["share"] for r in calc.table) == pytest.approx(1.0)
    assert all(r["color"].startswith("#") for r in calc.table)


def test_chart_is_a_standalone_altair_chart(calc, tmp_path):
    chart = calc.chart()
    assert isinstance(chart, alt.TopLevelMixin)
    spec = chart.to_dict()
    assert spec["data"] == {"name": "detail"}
    assert len(spec["datasets"]["detail"]) == len(calc.rows["detail"])
    assert spec["$schema"].endswith("v6.4.1.json")
    chart.save(tmp_path / "chart.html")
    chart.save(tmp_path / "chart.json")
    assert json.loads((tmp_path / "chart.json").read_text())["datasets"]["detail"]
    # the same through vw.chart(estimate), with only the components drawn in the legend
    spec = vw.chart(calc.estimate).to_dict()
    legend = [layer for layer in spec["layer"] if "color" in layer.get("encoding", {})][0]
    values = legend["encoding"]["color"]["legend"]["values"]
    assert set(values) == {c.name for c in calc.estimate.components}


def test_specs_read_named_data(calc):
    for name, spec in calc.specs.items():
        assert spec["data"] == {"name": name}
        assert "datasets" not in spec              # rows travel in the rows trait
        assert name in calc.rows
        assert any(p.get("name") == charts.GAP_PARAM for p in spec.get("params", [])) or name == "phases"


def test_phase_rows(calc):
    """One measure (issue 10): each bar is what the GPU holds (allocated + CUDA context, and
    the allocator's reserve at the peak), so the peak bar's top is the device total the
    verdict judges; the allocated tensors are a labelled tick inside it."""
    rows = calc.rows["phases"]
    totals = {r["phase"]: r["bytes"] for r in rows if r["level"] == "total"}
    allocated = {r["phase"]: r["bytes"] for r in rows if r["level"] == "allocated"}
    est = calc.estimate
    assert allocated["backward peak"] == pytest.approx(est.phases_bytes["backward"])
    assert max(allocated.values()) == pytest.approx(est.peak_allocated_bytes)
    assert max(totals.values()) == pytest.approx(est.device_total_bytes)
    assert max(totals.values()) == pytest.approx(calc.verdict["need_bytes"])
    for phase, label in charts.PHASE_LABELS.items():
        bars = sum(r["bytes"] for r in rows if r["level"] == "bar" and r["phase"] == label)
        assert bars == pytest.approx(totals[label])
        assert totals[label] == pytest.approx(allocated[label] + est.cuda_context_bytes
                                              + (est.reserved_bytes - est.peak_allocated_bytes
                                                 if phase == est.peak_phase else 0.0))
    cap = [r for r in rows if r["level"] == "capacity"]
    assert len(cap) == 1 and cap[0]["bytes"] == 24248 * 2**20     # the RTX 4090's CUDA total
    calc.gpu = ""                 # no GPU: the line is there but empty (drawn invisible)
    cap = [r for r in calc.rows["phases"] if r["level"] == "capacity"]
    assert len(cap) == 1 and cap[0]["bytes"] == 0 and cap[0]["text"] == ""


def test_to_dataframe(calc):
    df = calc.to_dataframe()
    assert df["bytes"].sum() == pytest.approx(sum(c.bytes for c in calc.estimate.components))
    assert {"component", "group", "tensor", "formula"} <= set(df.columns)


def test_number_formats():
    f = {x["name"]: x for x in number_formats()}
    # IEEE 754 binary32/binary16, bfloat16, OCP FP8 (E4M3 "fn": max 448; E5M2: 57344)
    assert (f["FP32"]["exponent"], f["FP32"]["mantissa"]) == (8, 23)
    assert (f["BF16"]["exponent"], f["BF16"]["mantissa"]) == (8, 7)
    assert (f["FP16"]["exponent"], f["FP16"]["mantissa"]) == (5, 10)
    assert f["FP32"]["max"] == pytest.approx(3.4028234663852886e38)
    assert f["BF16"]["max"] == pytest.approx(3.3895313892515355e38)
    assert f["FP16"]["max"] == 65504.0
    assert f["FP8 E4M3"]["max"] == 448.0
    assert f["FP8 E5M2"]["max"] == 57344.0
    assert f["FP16"]["min_normal"] == 2.0 ** -14
    assert f["BF16"]["epsilon"] == 2.0 ** -7 and f["FP16"]["epsilon"] == 2.0 ** -10
    assert f["NF4"]["bits"] == 4 and f["INT8"]["max"] == 127
    assert all(math.isfinite(x["max"]) for x in f.values())


def test_no_widget_update_raises(calc):
    """Whatever a frontend sends, the observer sets `error` instead of raising."""
    for name, value in [("method", "dpo"), ("precision", "fp64"), ("optimizer", "adam9"),
                        ("seq_len", -5), ("lora_targets", ["nope_proj"]), ("quantized_groups", []),
                        ("lora_dropout", 1.5), ("attn_implementation", "magic")]:
        old = getattr(calc, name)
        if name == "lora_targets":
            calc.method = "lora"
        setattr(calc, name, value)
        assert calc.error, (name, value)
        setattr(calc, name, old)
        if name == "lora_targets":
            calc.method = "full"
        assert calc.error == "", (name, calc.error)


def test_an_internal_failure_is_reported_not_raised(calc, monkeypatch):
    """A bug in the layout must not raise into the comm handler either."""
    import vramwidget.widget.compute as W  # the Calculator's recompute

    est, rows = calc.estimate, calc.rows

    def broken(*args, **kw):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(W, "layout_rows", broken)
    calc.batch_size = 3
    assert calc.error.startswith("internal error (ZeroDivisionError: boom)")
    assert calc.estimate is est and calc.rows is rows


def test_dragging_a_slider_does_not_pile_up_background_work(calc):
    """Issue 10: ten quick changes (a slider drag) start at most a few background jobs (the
    worker runs the latest request; a newer one stops the running job at its next step),
    and the state they leave is the last setup's, exact."""
    calc.wait()
    started = []
    refine = calc._refine

    def counting(token, todo):
        started.append(token)
        return refine(token, todo)

    calc._refine = counting
    for seq in range(1100, 1200, 10):        # sequence lengths no replay has seen
        calc.seq_len = seq
    calc.wait()
    assert 1 <= len(started) < 10, started
    assert calc.status == "idle" and calc.estimate.setup["seq_len"] == 1190
    assert "provisional" not in calc.verdict
    assert calc.verdict["need_bytes"] == calc.estimate.device_total_bytes


def test_target_len_control_applies_to_encoder_decoders_only():
    """target_len (an encoder-decoder's decoder length) is a control for T5 and BART only: for
    other models ``disabled`` says why (the frontend hides a control of MODEL_ONLY then) and a
    value left over from an encoder-decoder is not sent to the estimate."""
    c = Calculator("t5-base", batch_size=8, seq_len=512, target_len=128)
    assert "target_len" not in c.disabled and c.error == ""
    assert c.estimate.setup["target_len"] == 128
    api = vw.estimate("t5-base", batch_size=8, seq_len=512, target_len=128)
    assert c.estimate.peak_allocated_bytes == api.peak_allocated_bytes
    c.model = MODEL                     # decoder-only: the leftover 128 is ignored, not an error
    assert c.error == ""
    assert "encoder-decoders" in c.disabled["target_len"]
    assert c.estimate.setup["target_len"] is None
    assert c.estimate.peak_allocated_bytes == vw.estimate(MODEL, batch_size=8, seq_len=512).peak_allocated_bytes
    c.model = "bart-large"              # back to an encoder-decoder: the value applies again
    assert "target_len" not in c.disabled and c.estimate.setup["target_len"] == 128
    c.target_len = None
    assert c.estimate.setup["target_len"] is None and c.error == ""


def test_the_chart_specs_are_valid_vega_lite_and_made_once():
    """The widget's chart specs are built without Altair's schema check (most of a first
    Calculator's build); checked here instead: the specs built with the check are the very
    specs the widget sends, and each call hands out its own copy of the one made."""
    from vramwidget.show import charts
    from vramwidget.widget.views import build_specs

    checked = build_specs(validate=True)       # Altair raises on a spec the schema refuses
    sent = build_specs()
    assert sent == checked and set(sent) == {charts.DETAIL, charts.FITMAP, charts.COMPARISON, charts.PHASES_DATA}
    again = build_specs()
    assert again == sent and again is not sent and again[charts.DETAIL] is not sent[charts.DETAIL]
