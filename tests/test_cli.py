"""The `vramwidget` command line: real values in, real values out, one-line errors.

Most tests run ``cli.main([...])`` in-process (capsys); one runs ``python -m vramwidget``
in a subprocess, as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vramwidget import cli
from vramwidget.measure.validate import BUILTIN_CASES

ROOT = Path(__file__).resolve().parents[1]
PARAM_COUNTS = json.loads((ROOT / "tests" / "data" / "param_counts.json").read_text())

#: transformers' count for Llama 3.2 1B (tests/data/param_counts.json, meta-device model)
LLAMA_32_1B_PARAMS = 1_235_814_400
#: peft's trainable count for r=16 on every linear layer of Llama 3.2 1B (validation case a06)
LLAMA_32_1B_LORA16 = 11_272_192


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert err == ""
    return json.loads(out)


def _case(case_id):
    for line in Path(BUILTIN_CASES).read_text().splitlines():
        if line.strip():
            c = json.loads(line)
            if c.get("id") == case_id:
                return c
    raise KeyError(case_id)


# ---------------------------------------------------------------------------------------
# estimate --json
# ---------------------------------------------------------------------------------------

def test_recorded_counts_are_the_ones_asserted():
    assert PARAM_COUNTS["llama-3.2-1b"]["params_total"] == LLAMA_32_1B_PARAMS
    a06 = _case("a06")
    assert a06["name"] == "llama-3.2-1b" and a06["training"]["lora"]["r"] == 16
    assert a06["measured"]["params_trainable"] == LLAMA_32_1B_LORA16


def test_estimate_json_fields_and_counts(capsys):
    d = run_json(capsys, "estimate", "llama-3.2-1b", "--json")
    for key in ("params_total", "params_trainable", "peak_allocated_bytes", "reserved_bytes",
                "device_total_bytes", "phases", "components", "inventory", "architecture"):
        assert key in d, key
    assert d["params_total"] == LLAMA_32_1B_PARAMS
    assert d["params_trainable"] == LLAMA_32_1B_PARAMS  # full fine-tuning trains everything
    # phases: bytes per phase; the peak is the largest of forward/backward/optimizer step
    for ph in ("after_load", "forward", "backward", "optimizer_step", "first_step", "persistent"):
        assert isinstance(d["phases"][ph], int) and d["phases"][ph] > 0
    peak = max(d["phases"][p] for p in ("forward", "backward", "optimizer_step"))
    assert abs(d["peak_allocated_bytes"] - peak) <= 1
    assert d["phases"][d["peak_phase"]] == peak
    assert d["reserved_bytes"] >= d["peak_allocated_bytes"]
    assert d["device_total_bytes"] == pytest.approx(d["reserved_bytes"] + d["cuda_context_bytes"], abs=1)
    # pure bf16 full fine-tuning with AdamW: bf16 weights and two bf16 moments persist (6 B/param)
    assert d["phases"]["persistent"] >= 6 * LLAMA_32_1B_PARAMS
    assert d["peak_allocated_bytes"] > d["phases"]["persistent"]
    # the component tree: top-level components add up to the device total, parents to their children
    assert sum(c["bytes"] for c in d["components"]) == pytest.approx(d["device_total_bytes"], rel=1e-6, abs=64)

    def check(node):
        if node.get("children"):
            assert node["bytes"] == pytest.approx(sum(c["bytes"] for c in node["children"]), abs=len(node["children"]))
            for c in node["children"]:
                check(c)
    for c in d["components"]:
        check(c)
    names = {c["name"] for c in d["components"]}
    assert {"weights", "optimizer states", "activations", "cuda context", "allocator reserve"} <= names
    weights = next(c for c in d["components"] if c["name"] == "weights")
    assert weights["bytes"] == 2 * LLAMA_32_1B_PARAMS  # bf16, tied embedding counted once


def test_estimate_json_inventory_by_role(capsys):
    d = run_json(capsys, "estimate", "llama-3.2-1b", "--json")
    inv = d["inventory"]
    assert sum(r["params"] for r in inv.values()) == d["params_total"] == LLAMA_32_1B_PARAMS
    for role, entry in inv.items():
        assert entry["params"] == sum(t["numel"] for t in entry["tensors"])
        for t in entry["tensors"]:
            n = t["count"]
            for s in t["shape"]:
                n *= s
            assert n == t["numel"]
    # Llama 3.2 1B: 16 layers, h=2048, 32 heads / 8 KV heads of 64, i=8192, V=128256, tied
    assert inv["embedding"]["params"] == 128256 * 2048
    assert "output_head" not in inv  # tied to the embedding
    assert inv["attn_q"]["params"] == 16 * 2048 * 2048
    assert inv["attn_k"]["params"] == 16 * 512 * 2048
    assert inv["mlp_down"]["params"] == 16 * 2048 * 8192
    q = inv["attn_q"]["tensors"][0]
    assert q == {"name": "model.layers.{i}.self_attn.q_proj.weight", "shape": [2048, 2048], "count": 16,
                 "numel": 16 * 2048 * 2048, "linear": True, "module": "q_proj"}
    assert inv["norm"]["tensors"][0]["linear"] is False
    a = d["architecture"]
    assert "tensors" not in a
    assert (a["hidden_size"], a["num_layers"], a["num_heads"], a["num_kv_heads"], a["vocab_size"]) == \
        (2048, 16, 32, 8, 128256)
    assert a["tie_word_embeddings"] is True and a["params_total"] == LLAMA_32_1B_PARAMS


def test_estimate_lora_trainable_equals_peft(capsys):
    d = run_json(capsys, "estimate", "llama-3.2-1b", "--method", "lora", "--lora-r", "16", "--json")
    assert d["params_total"] == LLAMA_32_1B_PARAMS
    assert d["params_trainable"] == LLAMA_32_1B_LORA16
    assert d["setup"]["method"] == "lora" and d["setup"]["lora_r"] == 16
    # the same number by hand: r x (in + out) x 16 layers over the seven linear modules
    per_layer = 16 * ((2048 + 2048) + (2048 + 512) + (2048 + 512) + (2048 + 2048)
                      + (2048 + 8192) + (2048 + 8192) + (8192 + 2048))
    assert 16 * per_layer == LLAMA_32_1B_LORA16
    # restricted targets: q_proj and v_proj only
    d2 = run_json(capsys, "estimate", "llama-3.2-1b", "--method", "lora", "--lora-r", "8",
                  "--lora-targets", "q_proj,v_proj", "--json")
    assert d2["params_trainable"] == 16 * 8 * ((2048 + 2048) + (2048 + 512))


def test_estimate_options_reach_the_setup(capsys):
    d = run_json(capsys, "estimate", "llama-3.2-1b", "--method", "qlora", "--no-double-quant",
                 "--quantized-groups", "mlp,attn_vo", "--prepare-kbit", "--optimizer", "adamw_8bit",
                 "--optimizer-state-dtypes", "bf16,fp32", "--gradient-checkpointing", "full",
                 "--attn-implementation", "eager", "--batch-size", "3", "--seq-len", "512",
                 "--grad-accum-steps", "4", "--lora-r", "8", "--lora-alpha", "16", "--lora-dropout", "0.05",
                 "--lora-targets", "q_proj,v_proj", "--precision", "bf16", "--json")
    s = d["setup"]
    assert s["method"] == "qlora" and s["quantization"] == "nf4" and s["double_quant"] is False
    assert s["quantized_groups"] == ["mlp", "attn_vo"] and s["prepare_kbit"] is True
    assert s["optimizer"] == "adamw_8bit" and s["optimizer_state_dtypes"] == ["bfloat16", "float32"]
    assert s["gradient_checkpointing"] == "full" and s["attn_implementation"] == "eager"
    assert (s["batch_size"], s["seq_len"], s["grad_accum_steps"]) == (3, 512, 4)
    assert (s["lora_r"], s["lora_alpha"], s["lora_dropout"]) == (8, 16.0, 0.05)
    assert s["lora_targets"] == ["q_proj", "v_proj"]
    names = {c["name"] for c in d["components"]}
    assert "quantization constants" in names
    d2 = run_json(capsys, "estimate", "llama-3.2-1b", "--method", "freeze", "--trainable-layers", "2", "--json")
    assert 0 < d2["params_trainable"] < LLAMA_32_1B_PARAMS


def test_estimate_more_batch_needs_more_memory(capsys):
    small = run_json(capsys, "estimate", "llama-3.2-1b", "--batch-size", "1", "--json")
    big = run_json(capsys, "estimate", "llama-3.2-1b", "--batch-size", "8", "--json")
    assert big["peak_allocated_bytes"] > small["peak_allocated_bytes"]
    assert big["params_total"] == small["params_total"]


def test_estimate_param_count_model(capsys):
    d = run_json(capsys, "estimate", "7B", "--json")
    assert d["params_total"] == 7_000_000_000
    assert d["architecture"]["exact"] is False and d["architecture"]["assumption"]
    assert any("7B" in n for n in d["notes"])


def test_estimate_config_json_path(capsys, tmp_path):
    from vramwidget.model import presets

    cfg = presets.get("llama-3.2-1b")["config"]
    p = tmp_path / "llama1b" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(cfg))
    d = run_json(capsys, "estimate", str(p), "--json")
    assert d["params_total"] == LLAMA_32_1B_PARAMS
    d2 = run_json(capsys, "estimate", str(p.parent), "--json")  # a folder holding config.json
    assert d2["params_total"] == LLAMA_32_1B_PARAMS


def test_estimate_hub_id_of_a_preset_is_offline(capsys, monkeypatch):
    import huggingface_hub

    def no_network(*a, **k):
        raise AssertionError("a preset's Hub id must not touch the network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    d = run_json(capsys, "estimate", "meta-llama/Llama-3.2-1B", "--json")
    assert d["params_total"] == LLAMA_32_1B_PARAMS
    assert d["architecture"]["name"] == "llama-3.2-1b"


# ---------------------------------------------------------------------------------------
# estimate: the readable table
# ---------------------------------------------------------------------------------------

def test_estimate_table(capsys):
    code, out, err = run(capsys, "estimate", "llama-3.2-1b", "--method", "lora", "--lora-r", "16",
                         "--batch-size", "4")
    assert code == 0 and err == ""
    assert "llama-3.2-1b" in out
    assert "1,235,814,400" in out and "11,272,192" in out
    for label in ("after load", "end of forward", "backward peak", "optimizer step", "<- peak",
                  "peak allocated", "predicted reserved", "device total", "GiB", "GB"):
        assert label in out, label
    for comp in ("weights", "adapters", "optimizer states", "activations", "logits and loss", "cuda context"):
        assert f"\n{comp} " in out, comp
    assert "16 x r x in (16 x 2048) x 4 B" in out  # the formulas are shown (16 layers of q_proj lora_A: r x in fp32)
    assert "%" in out
    # the printed peak equals the JSON's
    d = run_json(capsys, "estimate", "llama-3.2-1b", "--method", "lora", "--lora-r", "16", "--batch-size", "4",
                 "--json")
    peak_line = next(line for line in out.splitlines() if line.startswith("peak allocated"))
    assert f"{d['peak_allocated_bytes'] / 2**30:.2f} GiB" in peak_line
    assert f"{d['peak_allocated_bytes'] / 1e9:.2f} GB" in peak_line


def test_estimate_table_units_gb(capsys):
    code, out, _ = run(capsys, "estimate", "llama-3.2-1b", "--units", "gb")
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("component / module group"))
    assert " GB " in header and "GiB" not in header
    weights = next(line for line in out.splitlines() if line.startswith("weights "))
    assert f"{2 * LLAMA_32_1B_PARAMS / 1e9:.3f}" in weights


def test_estimate_notes_shown(capsys):
    code, out, _ = run(capsys, "estimate", "llama-3.2-1b", "--attn-implementation", "eager", "--seq-len", "512")
    assert code == 0
    assert "notes:" in out and "eager attention" in out


# ---------------------------------------------------------------------------------------
# python -m vramwidget (subprocess)
# ---------------------------------------------------------------------------------------

def test_python_m_vramwidget_subprocess():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "vramwidget", "estimate", "llama-3.2-1b", "--json"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    d = json.loads(r.stdout)
    assert d["params_total"] == LLAMA_32_1B_PARAMS
    assert sum(v["params"] for v in d["inventory"].values()) == LLAMA_32_1B_PARAMS
    # and an error through the real process: one line, exit 2, no traceback
    r = subprocess.run([sys.executable, "-m", "vramwidget", "estimate", "lama-2-7b"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("vramwidget: error: ")
    assert "Traceback" not in r.stderr and "llama-2-7b" in r.stderr


# ---------------------------------------------------------------------------------------
# validate
# ---------------------------------------------------------------------------------------

PREDICTED = ("params_total", "params_trainable", "weights_mib", "peak_allocated_mib", "max_reserved_mib",
             "step_seconds")   # the built-in cases ran on an H200, a catalogue GPU: timed too


def test_validate_json_builtin(capsys):
    rows = run_json(capsys, "validate", "--json")
    assert len(rows) == 45
    for r in rows:
        assert set(r) >= {"id", "predicted", "error"}
        assert set(r["predicted"]) == set(PREDICTED)
        assert r["predicted"]["peak_allocated_mib"] > 0
    by_id = {r["id"]: r for r in rows}
    a06 = by_id["a06"]
    assert a06["predicted"]["params_trainable"] == LLAMA_32_1B_LORA16
    assert a06["predicted"]["params_total"] == LLAMA_32_1B_PARAMS
    # the same when the file is given explicitly
    assert run_json(capsys, "validate", BUILTIN_CASES, "--json") == rows


def test_validate_table(capsys):
    code, out, err = run(capsys, "validate")
    assert code == 0 and err == ""
    assert "a01" in out and "a45" in out
    summary = next(line for line in out.splitlines() if line.startswith("peak_allocated_mib"))
    assert "median" in summary and "p90" in summary and "max" in summary and "(n=45)" in summary


def test_validate_runs_on_any_file(capsys, tmp_path):
    lines = [line for line in Path(BUILTIN_CASES).read_text().splitlines() if line.strip()][:3]
    cases = [json.loads(x) for x in lines]
    cases[1]["id"] = "mine"
    cases[2].pop("measured")  # a case never measured: predicted, no error
    p = tmp_path / "cases.jsonl"
    p.write_text("\n".join(json.dumps(c) for c in cases) + "\n")
    rows = run_json(capsys, "validate", str(p), "--json")
    assert [r["id"] for r in rows] == [cases[0]["id"], "mine", cases[2]["id"]]
    assert all(v is None for v in rows[2]["error"].values())
    assert rows[0]["error"]["peak_allocated_mib"] is not None


# ---------------------------------------------------------------------------------------
# presets, measure, help
# ---------------------------------------------------------------------------------------

def test_presets_and_models(capsys):
    code, out, err = run(capsys, "presets")
    assert code == 0 and err == ""
    line = next(x for x in out.splitlines() if x.startswith("llama-2-7b "))
    assert "meta-llama/Llama-2-7b-hf" in line and "7B" in line
    rows = run_json(capsys, "models", "--json")
    names = [r["name"] for r in rows]
    assert len(names) >= 30 and "llama-3.2-1b" in names
    assert {"name", "hub_id", "params_label"} <= set(rows[0])


def test_measure_is_delegated(capsys, monkeypatch):
    import vramwidget.measure.training as measure

    seen = {}

    def fake_main(argv):
        seen["argv"] = argv
        return 7

    monkeypatch.setattr(measure, "main", fake_main)
    assert cli.main(["measure", "cases.jsonl", "--out", "x.jsonl", "--device", "cpu"]) == 7
    assert seen["argv"] == ["cases.jsonl", "--out", "x.jsonl", "--device", "cpu"]


def test_measure_real_usage_error(capsys):
    code, out, err = run(capsys, "measure")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "error" in err


def test_help_and_version(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "estimate" in out and "validate" in out
    code, out, _ = run(capsys, "estimate", "--help")
    assert code == 0 and "--lora-targets" in out and "adamw_fused" in out and "selective" in out
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("vramwidget ")


# ---------------------------------------------------------------------------------------
# errors: exactly one stderr line, exit code 2, nothing on stdout, no traceback
# ---------------------------------------------------------------------------------------

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000}


def _config(tmp_path, name, cfg=None, text=None):
    p = tmp_path / name
    p.write_text(text if text is not None else json.dumps(cfg))
    return str(p)


ERROR_CASES = {
    # id: (argv builder, substrings the one line must contain)
    "unknown preset": (lambda t: ["estimate", "lama-2-7b"], ["unknown preset 'lama-2-7b'", "llama-2-7b"]),
    "unsupported model_type": (lambda t: ["estimate", _config(t, "xlnet.json", {**LLAMA, "model_type": "xlnet"})],
                               ["'xlnet' is not supported", "llama", "mistral", "gpt2", "qwen2"]),
    "missing hidden_size": (lambda t: ["estimate", _config(t, "c.json", {k: v for k, v in LLAMA.items()
                                                                         if k != "hidden_size"})],
                            ["missing field 'hidden_size'"]),
    "heads do not divide with a bad head_dim": (lambda t: ["estimate", _config(t, "c.json", {**LLAMA, "hidden_size": 66,
                                                                                          "head_dim": 0})],
                                                ["head_dim", "0"]),
    "kv heads do not divide": (lambda t: ["estimate", _config(t, "c.json", {**LLAMA, "num_key_value_heads": 3})],
                               ["num_key_value_heads"]),
    "zero layers": (lambda t: ["estimate", _config(t, "c.json", {**LLAMA, "num_hidden_layers": 0})],
                    ["num_hidden_layers", "positive", "0"]),
    "negative hidden": (lambda t: ["estimate", _config(t, "c.json", {**LLAMA, "hidden_size": -64})],
                        ["hidden_size", "positive", "-64"]),
    "negative vocab": (lambda t: ["estimate", _config(t, "c.json", {**LLAMA, "vocab_size": -1})],
                       ["vocab_size"]),
    "malformed JSON": (lambda t: ["estimate", _config(t, "bad.json", text='{"model_type": "llama",\n'
                                                                          ' "hidden_size": 64,,\n}')],
                       ["not valid JSON", "line 2", "column"]),
    "JSON not an object": (lambda t: ["estimate", _config(t, "list.json", text="[1, 2]")], ["JSON object"]),
    "missing file": (lambda t: ["estimate", str(t / "nope.json")], ["cannot read"]),
    "batch 0": (lambda t: ["estimate", "llama-3.2-1b", "--batch-size", "0"], ["batch_size", ">= 1", "0"]),
    "negative seq": (lambda t: ["estimate", "llama-3.2-1b", "--seq-len", "-5"], ["seq_len", ">= 1"]),
    "batch not a number": (lambda t: ["estimate", "llama-3.2-1b", "--batch-size", "four"],
                           ["--batch-size", "whole number", "four"]),
    "NaN lora_alpha": (lambda t: ["estimate", "llama-3.2-1b", "--method", "lora", "--lora-alpha", "nan"],
                       ["lora_alpha", "finite"]),
    "lora rank 0": (lambda t: ["estimate", "llama-3.2-1b", "--method", "lora", "--lora-r", "0"],
                    ["lora_r", ">= 1"]),
    "lora target missing": (lambda t: ["estimate", "llama-3.2-1b", "--method", "lora", "--lora-targets",
                                       "q_proj,c_attn"],
                            ["lora_targets", "c_attn", "q_proj, k_proj, v_proj, o_proj, gate_proj"]),
    "full fine-tuning of 4-bit": (lambda t: ["estimate", "llama-3.2-1b", "--quantization", "nf4",
                                             "--method", "full"], ["method", "nf4", "qlora"]),
    "unknown optimizer": (lambda t: ["estimate", "llama-3.2-1b", "--optimizer", "adam"],
                          ["optimizer", "'adam'", "adamw", "adamw_8bit", "adafactor", "lion"]),
    "unknown precision": (lambda t: ["estimate", "llama-3.2-1b", "--precision", "fp64"],
                          ["precision", "bf16", "amp_bf16", "fp32"]),
    "unknown checkpointing": (lambda t: ["estimate", "llama-3.2-1b", "--gradient-checkpointing", "some"],
                              ["gradient_checkpointing", "none, selective, full"]),
    "unknown quantized group": (lambda t: ["estimate", "llama-3.2-1b", "--method", "qlora",
                                           "--quantized-groups", "ffn"], ["quantized_groups", "attn_qk", "mlp"]),
    "bad state dtype": (lambda t: ["estimate", "llama-3.2-1b", "--optimizer-state-dtypes", "bf16,fp64"],
                        ["optimizer_state_dtypes", "fp64", "float32"]),
    "freeze without layers": (lambda t: ["estimate", "llama-3.2-1b", "--method", "freeze"], ["trainable_layers"]),
    "lora dropout 1": (lambda t: ["estimate", "llama-3.2-1b", "--method", "lora", "--lora-dropout", "1"],
                       ["lora_dropout", "[0, 1)"]),
    "bad param count": (lambda t: ["estimate", "-7B"], []),
    "unknown option": (lambda t: ["estimate", "llama-3.2-1b", "--bogus"], ["--bogus"]),
    "missing model": (lambda t: ["estimate"], ["MODEL"]),
    "bad units": (lambda t: ["estimate", "llama-3.2-1b", "--units", "mib"], ["--units", "gib", "gb"]),
    "unknown command": (lambda t: ["frobnicate"], ["frobnicate", "estimate"]),
    "no command": (lambda t: [], ["estimate"]),
    "validate missing file": (lambda t: ["validate", str(t / "none.jsonl")], ["cannot read"]),
    "validate malformed file": (lambda t: ["validate", _config(t, "bad.jsonl", text='{"id": 1}\n{oops\n')],
                                ["line"]),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_error_is_one_line_exit_2(case, capsys, tmp_path):
    build, needles = ERROR_CASES[case]
    code, out, err = run(capsys, *build(tmp_path))
    assert code == 2, (case, out, err)
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("vramwidget: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)


def test_unknown_hub_id_offline_is_one_line(capsys, monkeypatch):
    """An unknown Hub id without network: one line naming the alternatives; no network touched."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls = []

    def offline(repo_id, filename, **kw):
        calls.append(repo_id)
        raise LocalEntryNotFoundError("offline and no cached file")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    code, out, err = run(capsys, "estimate", "someorg/not-a-preset-model")
    assert calls == ["someorg/not-a-preset-model"]
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "someorg/not-a-preset-model" in err and "preset" in err and "config.json" in err


def test_unknown_hub_id_offline_subprocess():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "vramwidget", "estimate", "someorg/not-a-preset-model"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("vramwidget: error: ")
    assert "preset" in r.stderr


def test_internal_error_is_one_line(capsys, monkeypatch):
    E = sys.modules["vramwidget.estimate"]  # `import vramwidget.estimate` gives the function

    def boom(arch, setup, *args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(E, "estimate_setup", boom)
    monkeypatch.delenv("VRAMWIDGET_DEBUG", raising=False)
    code, out, err = run(capsys, "estimate", "llama-3.2-1b")
    assert code == 1 and err.count("\n") == 1 and "boom second line" in err


def test_infer_and_estimate_inference(capsys):
    """KV cache of Llama-2-7B, bf16, 4,096 tokens: 2 x 32 x 4096 x 4096 x 2 B = 2 GiB."""
    import json as _json

    from vramwidget.cli import main as cli_main

    assert cli_main(["infer", "llama-2-7b", "--context-len", "4096", "--json"]) == 0
    d = _json.loads(capsys.readouterr().out)
    kv = next(c for c in d["components"] if c["name"] == "kv cache")
    assert kv["bytes"] == 2 * 32 * 4096 * 4096 * 2
    assert cli_main(["estimate", "llama-2-7b", "--inference", "--context-len", "4096", "--json"]) == 0
    assert _json.loads(capsys.readouterr().out)["components"] == d["components"]
    assert cli_main(["estimate", "llama-2-7b", "--inference", "--method", "lora"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training option" in err[0]


def test_fit_subcommand(capsys):
    from vramwidget.cli import main as cli_main

    assert cli_main(["fit", "llama-3.2-1b", "--gpu", "H100-80GB"]) == 0
    out = capsys.readouterr().out
    assert "largest batch" in out and "H100" in out


def test_estimate_with_gpu_gives_the_verdict(capsys):
    """``estimate --gpu`` answers "does it fit": the verdict of vramwidget.fit.verdict on the
    device total.  Llama 3.1 8B QLoRA at batch 4 x 2048 without checkpointing keeps ~72 GiB of
    activations (the LoRA inputs peft casts to fp32 alone are ~37 GiB): no 24 GiB card holds it,
    an H200 (141 GB) does."""
    from vramwidget.fit import verdict as V

    args = ["llama-3.1-8b", "--method", "qlora", "--gradient-checkpointing", "none", "--batch-size", "4",
            "--seq-len", "2048"]
    d = run_json(capsys, "estimate", *args, "--gpu", "RTX 4090", "--json")
    v = d["verdict"]
    assert v["state"] == "does_not_fit" and v["measure"] == "device_total" and v["gpu"] == "RTX 4090"
    assert v["need_bytes"] == pytest.approx(d["device_total_bytes"], abs=1)
    # the card's own CUDA context and its source are said beside the judged figures
    assert "CUDA context on RTX 4090: 426 MiB" in v["context_note"]
    assert v["headroom_bytes"] == pytest.approx(v["capacity_bytes"] - v["need_bytes"])
    assert v["band_bytes"] == pytest.approx(V.band_bytes(d["reserved_bytes"]))
    d2 = run_json(capsys, "estimate", *args, "--gpu", "H200", "--json")
    assert d2["verdict"]["state"] == "fits" and d2["verdict"]["headroom_bytes"] > 0
    assert "verdict" not in run_json(capsys, "estimate", *args, "--json")     # no GPU, no verdict

    code, text, _ = run(capsys, "estimate", *args, "--gpu", "RTX 4090")
    assert code == 0
    line = next(x for x in text.splitlines() if x.startswith("verdict"))
    assert "DOES NOT FIT on RTX 4090" in line and "over" in line and "uncertainty ±" in line
    assert "vramwidget fit llama-3.1-8b --gpu \"RTX 4090\"" in text


def test_estimate_on_several_gpus(capsys):
    """``estimate`` takes the parallel layout's flags (as ``fit`` does): the per-GPU estimate of
    Llama 3.1 70B QLoRA sharded by FSDP over 2 GPUs is estimate_parallel's worst GPU, and the
    verdict judges that GPU."""
    from vramwidget import estimate_parallel

    args = ["llama-3.1-70b", "--method", "qlora", "--gradient-checkpointing", "full", "--num-gpus", "2",
            "--strategy", "fsdp_full_shard"]
    d = run_json(capsys, "estimate", *args, "--gpu", "RTX 4090", "--json")
    direct = estimate_parallel("llama-3.1-70b", gpu="RTX 4090", method="qlora", gradient_checkpointing="full",
                               num_gpus=2, strategy="fsdp_full_shard").per_gpu
    assert d["parallel"] == {"strategy": "fsdp_full_shard", "num_gpus": 2}
    assert d["peak_allocated_bytes"] == pytest.approx(direct.peak_allocated_bytes, abs=1)
    assert d["verdict"]["need_bytes"] == pytest.approx(direct.device_total_bytes, abs=1)
    # after loading, one GPU holds half the sharded storage plus what FSDP does not shard with
    # bitsandbytes (the quantization state stays whole on every GPU: issue 12)
    single = run_json(capsys, "estimate", *args[:5], "--json")
    half = single["phases"]["after_load"] / 2
    assert half < d["phases"]["after_load"] < half + 1.5 * 2**30
    code, text, _ = run(capsys, "estimate", *args)
    assert code == 0 and text.startswith("per GPU, the worst one (strategy=fsdp_full_shard, num_gpus=2):")
    code, _, err = run(capsys, "estimate", "llama-3.1-8b", "--inference", "--num-gpus", "2")
    assert code == 2 and "--num-gpus is a training layout option" in err


def test_estimate_target_len_flag(capsys):
    """--target-len: an encoder-decoder's decoder length (the same as the API's target_len);
    a decoder-only model refuses it in one line naming the field (exit 2)."""
    import vramwidget as vw

    d = run_json(capsys, "estimate", "t5-base", "--batch-size", "8", "--seq-len", "512", "--target-len", "128",
                 "--json")
    assert d["setup"]["target_len"] == 128 and d["setup"]["seq_len"] == 512
    api = vw.estimate("t5-base", batch_size=8, seq_len=512, target_len=128)
    assert d["peak_allocated_bytes"] == pytest.approx(api.peak_allocated_bytes, abs=1)   # JSON: whole bytes
    assert cli.main(["estimate", "llama-3.2-1b", "--target-len", "128"]) == 2
    err = capsys.readouterr().err
    assert "target_len: llama-3.2-1b is decoder-only; its sequence is seq_len" in err


def test_the_process_entry_turns_the_collector_off_only_for_one_shot_commands(monkeypatch, capsys):
    """``cli.run`` (the console script, ``python -m vramwidget``) runs estimate / fit / infer
    with Python's cyclic garbage collector off (the process ends when they have printed:
    CLI fit of Llama 3.1 8B QLoRA 1.3-1.5 -> 1.15-1.2 s here); every other command, and
    ``main`` called as a function, leave it as it was.  A one-shot command ends the process
    with ``os._exit`` once its output is flushed (stood in for here by a SystemExit)."""
    import gc

    def _exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", _exit)
    was = gc.isenabled()
    try:
        for argv, off in ((["estimate", "llama-3.2-1b"], True), (["presets"], False)):
            gc.enable()
            monkeypatch.setattr(sys, "argv", ["vramwidget"] + argv)
            with pytest.raises(SystemExit) as exc:
                cli.run()
            assert exc.value.code == 0
            assert gc.isenabled() is not off, argv
        gc.enable()
        assert cli.main(["estimate", "llama-3.2-1b"]) == 0 and gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    capsys.readouterr()
