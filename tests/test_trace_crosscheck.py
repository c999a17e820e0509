"""The two backends against each other, and the traced backend against the H200 measurements.

The analytic path models each family's saved tensors op by op and is within 0.54% of 45
measured H200 steps (tests/test_validation.py); the trace runs the transformers model
itself.  Where both model the same mechanisms they must agree within 1% on the peak
(beyond the 64 MiB cuBLAS workspace both add).  Tracing costs seconds, so hypothesis draws a
modest number of setups.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import vramwidget as vw  # noqa: E402
from vramwidget.measure import validate as V  # noqa: E402
from vramwidget.estimate import CUBLAS_WORKSPACE_BYTES  # noqa: E402

#: small real checkpoints of analytic families (presets, so their configs are the released ones):
#: Llama (SmolLM2), Qwen2, GPT-2, Gemma 3, Qwen3, and the two MoE routings (OLMoE, Qwen1.5-MoE)
MODELS = ["smollm2-135m", "qwen2.5-0.5b", "gpt2", "gemma-3-1b", "qwen3-0.6b"]

#: the setups both backends model: bf16 or autocast, SDPA (flash on CUDA), full fine-tuning or
#: LoRA, the PyTorch optimizers, with and without full checkpointing
SETUPS = st.fixed_dictionaries({
    "method": st.sampled_from(["full", "lora"]),
    "precision": st.sampled_from(["bf16", "amp_bf16"]),
    "optimizer": st.sampled_from(["adamw", "adamw_fused", "sgd_momentum"]),
    "gradient_checkpointing": st.sampled_from(["none", "full"]),
    "batch_size": st.integers(1, 4),
    "seq_len": st.sampled_from([512, 1024, 2048]),
})


def _peaks(model, kw):
    a = vw.estimate(model, backend="analytic", **kw)
    t = vw.estimate(model, backend="trace", **kw)
    assert t.backend == "trace" and a.backend == "analytic"
    return a.peak_allocated_bytes - CUBLAS_WORKSPACE_BYTES, t.peak_allocated_bytes - CUBLAS_WORKSPACE_BYTES


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("VW_TRACE_EXAMPLES", "8")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])   # no shrinking: each example traces
@given(model=st.sampled_from(MODELS), kw=SETUPS)
# the end of backward of a tied head and embedding, the peak at one short sequence with a small
# optimizer step (the trace was +3.7% and +8.4% here, see tests/test_tied_accumulation.py)
@example(model="qwen2.5-0.5b", kw=dict(method="full", precision="amp_bf16", optimizer="adamw_fused",
                                       gradient_checkpointing="none", batch_size=1, seq_len=512))
@example(model="qwen2.5-0.5b", kw=dict(method="full", precision="bf16", optimizer="sgd_momentum",
                                       gradient_checkpointing="full", batch_size=1, seq_len=512))
@example(model="gpt2", kw=dict(method="full", precision="bf16", optimizer="sgd_momentum",
                               gradient_checkpointing="full", batch_size=1, seq_len=512))
@example(model="gpt2", kw=dict(method="full", precision="amp_bf16", optimizer="sgd_momentum",
                               gradient_checkpointing="full", batch_size=1, seq_len=512))
def test_traced_peak_agrees_with_analytic(model, kw):
    if model == "gpt2" and kw["precision"] == "amp_bf16" and kw["gradient_checkpointing"] == "full":
        # a known refusal, not an agreement to check: GPT-2 under autocast with checkpointing
        # cannot be traced (torch.utils.checkpoint's CheckpointError: the recomputed values'
        # metadata differ under the trace's dispatch mode); the trace says so in one line
        with pytest.raises(vw.VramError, match="tracing gpt2 failed .*CheckpointError"):
            vw.estimate(model, backend="trace", **kw)
        return
    analytic, traced = _peaks(model, kw)
    assert traced == pytest.approx(analytic, rel=0.01), (model, kw)


@pytest.mark.slow
def test_lora_autocast_checkpointing_frozen_weight_casts():
    """Found by the property test above (Qwen3-0.6B, LoRA, amp_bf16, full checkpointing, b=4 x 512,
    fused AdamW): the analytic path used to hold 1.14 GiB of "bf16 weight copies (autocast
    cache)" for the frozen base, which autocast never caches (aten/src/ATen/autocast_mode.cpp,
    ``cached_cast`` caches leaves that require grad); under checkpointing those copies live only
    while their block runs.  Both backends now give 6.86 GB."""
    kw = dict(method="lora", precision="amp_bf16", optimizer="adamw_fused", gradient_checkpointing="full",
              batch_size=4, seq_len=512)
    analytic, traced = _peaks("qwen3-0.6b", kw)
    assert traced == pytest.approx(analytic, rel=0.01)


@pytest.mark.slow
def test_validate_backend_trace_meets_the_bounds():
    """`validate --backend trace` on the visible H200 cases: 3% median, 7% p90, 12% worst
    on peak allocated, the bounds the analytic path is held to (tests/test_validation.py).
    Here a slice of 19 (a trace costs seconds): every third case, plus the first case of each
    model type and method the slice would miss; all 45 with VW_TRACE_CASES=all (``tools/readme_figures.py --only trace`` runs them
    all for the README's figure)."""
    cases = V.load_cases(V.BUILTIN_CASES)
    assert len(cases) == 45
    if os.environ.get("VW_TRACE_CASES") != "all":
        kind = [(c["model"].get("model_type"), c["training"].get("method")) for c in cases]
        keep = set(range(0, len(cases), 3))
        keep |= {kind.index(k) for k in set(kind) - {kind[i] for i in keep}}
        cases = [cases[i] for i in sorted(keep)]
    result = V.validate(cases, backend="trace")
    errors = [r for r in result["cases"] if "error_message" in r]
    assert not errors, errors[:3]
    s = result["summary"]["peak_allocated_mib"]
    assert s["n"] == len(cases)
    assert s["median"] <= 0.03 and s["p90"] <= 0.07 and s["max"] <= 0.12, s
