"""The widget with a model whose family has no analytic module (issue 11): typing its Hub id
traces it in the background worker (status idle -> tracing -> idle), keeping the last
estimate on screen meanwhile, then shows the traced estimate with a note.

Nothing can be fetched from the Hub here, so the Hub id is served by the real loading path
(``vramwidget.model.hub.fetch_config`` -> ``huggingface_hub.hf_hub_download``) from a local cache
folder laid out as huggingface_hub lays it out (``models--org--name/refs/main`` holding a
commit, ``snapshots/<commit>/config.json``), with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("anywidget")
trace = pytest.importorskip("vramwidget.trace")
if not trace.available():
    pytest.skip("the trace extra (torch, transformers, peft) is not installed", allow_module_level=True)

import vramwidget as vw  # noqa: E402
from vramwidget.show import charts  # noqa: E402
from vramwidget.model.families import supported_model_types  # noqa: E402
from vramwidget.widget import Calculator  # noqa: E402
from vramwidget.widget.worker import Worker  # noqa: E402

REPO_ID = "acme/tiny-phi"
#: a small config of model_type "phi" (transformers' PhiForCausalLM, e.g. microsoft/phi-2),
#: which has no module in vramwidget/model/families/
TINY_PHI = {
    "model_type": "phi", "architectures": ["PhiForCausalLM"], "vocab_size": 1024, "hidden_size": 128,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "max_position_embeddings": 2048, "partial_rotary_factor": 0.5, "torch_dtype": "bfloat16",
}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(root: Path, repo_id: str, config: dict) -> Path:
    """A huggingface_hub cache holding only ``config.json`` of ``repo_id`` (the layout
    ``hf_hub_download(..., local_files_only=True)`` reads)."""
    folder = root / ("models--" + repo_id.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snap = folder / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as C

    cache = write_hub_cache(tmp_path / "hub", REPO_ID, TINY_PHI)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(C, "HF_HUB_CACHE", str(cache))
    return cache


def test_phi_has_no_family_module():
    assert "phi" not in supported_model_types()


def test_typing_a_hub_id_without_a_family_traces_it_then_shows_the_estimate(offline_hub):
    c = Calculator("llama-3.2-1b", seq_len=256)
    assert c.status == "idle" and c.summary["model"] == "llama-3.2-1b"
    before_rows = c.rows
    seen = []
    c.observe(lambda ch: seen.append(ch["new"]), names="status")

    c.model = REPO_ID
    # at once: the tracing state, the previous estimate still shown, no error
    assert c.status == "tracing", (c.status, c.error)
    assert c.status_text.startswith(f"tracing {REPO_ID}")
    assert c.error == ""
    assert c.summary["model"] == "llama-3.2-1b" and c.rows is before_rows

    c.wait(timeout=300)
    assert c.status == "idle" and c.status_text == "" and c.error == ""
    assert seen[0] == "tracing" and seen[-1] == "idle"
    # the traced estimate, consistent across the traits and with vw.estimate's auto backend
    est = c.estimate
    assert est.backend == "trace"
    direct = vw.estimate(dict(TINY_PHI, _name_or_path=REPO_ID), **{k: v for k, v in c.setup().items() if k != "model"})
    assert direct.backend == "trace"
    assert est.peak_allocated_bytes == direct.peak_allocated_bytes
    assert c.summary["model"] == REPO_ID and c.summary["backend"] == "trace"
    assert c.summary["peak_bytes"] == est.peak_allocated_bytes
    assert c.summary["device_total_bytes"] == est.device_total_bytes
    assert any(n.startswith("traced: model_type 'phi'") for n in c.summary["notes"])
    # the comparison's scenarios were traced too, and every chart shows the new model
    titles = [r["scenario"] for r in c.rows[charts.COMPARISON] if r["level"] == "title"]
    assert titles[0] == "your setup" and len(titles) == 5, titles
    # the treemap's components add up to the traced estimate's device total
    detail_total = sum(r["bytes"] for r in c.rows[charts.DETAIL] if r["level"] == "component")
    assert detail_total == pytest.approx(est.device_total_bytes, rel=1e-6)

    # a change of batch size after the first trace: the size profile answers it
    c.batch_size = 2
    c.wait(timeout=300)
    assert c.status == "idle" and c.error == "" and c.estimate.setup["batch_size"] == 2


def test_a_failure_in_the_worker_is_the_error_banner(offline_hub, monkeypatch):
    from vramwidget.widget import background as calc_mod

    c = Calculator("llama-3.2-1b", seq_len=256)

    def broken(arch, kind, kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(calc_mod, "run_estimate", broken)
    c.model = REPO_ID
    assert c.status == "tracing"
    c.wait(timeout=60)
    assert c.status == "idle"
    assert c.error.startswith("internal error (RuntimeError: boom)")
    assert c.summary["model"] == "llama-3.2-1b"   # the last valid estimate stays


def test_worker_runs_the_latest_request_only():
    w = Worker()
    gate = threading.Event()
    ran = []
    w.submit(lambda: (gate.wait(5), ran.append(1)))
    time.sleep(0.05)                  # the first job is running, blocked on the gate
    for i in (2, 3, 4):
        w.submit(lambda i=i: ran.append(i))
    gate.set()
    assert w.wait(5)
    assert ran == [1, 4]
    w.close()
