"""The tracing backend: one training step of the transformers model on fake tensors.

Expected values come from the analytic path (itself within 0.54% of 45 H200 measurements,
tests/test_validation.py) and from the measured cases in vramwidget/data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import vramwidget as vw
from vramwidget.estimate import CUBLAS_WORKSPACE_BYTES
from vramwidget.measure.validate import BUILTIN_CASES

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramwidget.trace import profile as P  # noqa: E402
from vramwidget.trace import resolve_config  # noqa: E402
from vramwidget.trace.assemble import phases_from_log  # noqa: E402
from vramwidget.trace.events import cuda_rounded  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _case(cid):
    with open(BUILTIN_CASES, encoding="utf-8") as f:
        for line in f:
            c = json.loads(line)
            if c.get("id") == cid:
                return c
    raise KeyError(cid)


def test_core_imports_without_torch():
    """The calculator core and the trace package's front door import no torch."""
    code = ("import sys; import vramwidget, vramwidget.trace, vramwidget.trace.profile, vramwidget.trace.assemble; "
            "import vramwidget.estimate; print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, check=True).stdout.split()
    assert out == ["False", "False"]


def test_cuda_rounding():
    # c10/cuda/CUDACachingAllocator.cpp round_size: at least 512 B, then multiples of 512 B
    assert [cuda_rounded(n) for n in (0, 1, 512, 513, 4096 * 2048 * 2)] == [0, 512, 512, 1024, 4096 * 2048 * 2]


def test_llama_1b_matches_measured_h200_case_a01():
    """a01: Llama-3.2-1B, pure bf16, AdamW (foreach), SDPA, b=2 x s=2048, measured on an H200."""
    c = _case("a01")
    e = vw.estimate(c["model"], backend="trace", batch_size=2, seq_len=2048)
    m = c["measured"]
    assert e.backend == "trace" and e.setup["backend"] == "trace"
    assert e.params_total == m["params_total"] == 1235814400
    MiB = 2 ** 20
    # a01 ran first in its process: no matmul had yet allocated the 64 MiB cuBLAS workspace
    assert (e.phases_bytes["after_load"] - CUBLAS_WORKSPACE_BYTES) / MiB == pytest.approx(m["weights_mib"], rel=0.001)
    for field, phase in (("persistent_after_step_mib", "persistent"),
                         ("forward_peak_mib", "forward"), ("backward_peak_mib", "backward"),
                         ("optimizer_step_peak_mib", "optimizer_step")):
        assert e.phases_bytes[phase] / MiB == pytest.approx(m[field], rel=0.005), field
    assert e.peak_phase == "backward"


@pytest.mark.parametrize("b0, b1", [(2, 3), (1, 1)])
def test_profile_equals_an_exact_trace_at_another_size(b0, b1):
    """Sizes replayed from the (b, s) profile equal a trace run at that size, byte for byte
    (a batch of one has its own profile: transformers copies expanded position ids only for b > 1)."""
    name, cfg = resolve_config("smollm2-135m")
    s0 = vw.TrainingSetup.from_kwargs(batch_size=b0, seq_len=256, backend="trace")
    prof = P.profile_for(cfg, s0)   # traces (b0, 256) and (b0 + 1 or 1, 512)
    assert prof.size_fns is not None
    s1 = s0.replace(batch_size=b1, seq_len=200)
    exact = P._trace(cfg, s1, "causal_lm")
    direct = phases_from_log(exact.allocs, exact.marks, [cuda_rounded(a.nbytes) for a in exact.allocs], 0)[0]
    replayed = phases_from_log(prof.base.allocs, prof.base.marks, prof.sizes(b1, 200), 0)[0]
    assert replayed == direct


def test_second_size_builds_the_profile_then_sizes_are_instant():
    import time

    cfg = dict(resolve_config("smollm2-135m")[1], num_hidden_layers=3)
    vw.estimate(cfg, backend="trace", batch_size=1, seq_len=300)
    assert P.cached_profile(cfg, vw.TrainingSetup.from_kwargs(batch_size=1, seq_len=300, backend="trace")) is None
    vw.estimate(cfg, backend="trace", batch_size=1, seq_len=700)   # second size: the profile
    t0 = time.perf_counter()
    e = vw.estimate(cfg, backend="trace", batch_size=1, seq_len=1500)
    assert time.perf_counter() - t0 < 1.0   # a replay, not a trace (a trace takes seconds)
    assert any("profile" in n for n in e.notes)


def test_traced_tree_sums_to_the_peak():
    e = vw.estimate("smollm2-135m", backend="trace", batch_size=2, seq_len=256)
    comps = {c.name: c.bytes for c in e.components}
    peak_tree = sum(v for k, v in comps.items() if k not in ("allocator reserve", "cuda context"))
    assert peak_tree == pytest.approx(e.peak_allocated_bytes, rel=1e-9)
    opt = {c.name: c.bytes for c in e.phase_components["optimizer_step"]}
    assert {"weights", "gradients", "optimizer states", "optimizer temporaries"} <= set(opt)
    assert sum(opt.values()) == pytest.approx(e.phases_bytes["optimizer_step"], rel=1e-9)
    # foreach AdamW: one sqrt(exp_avg_sq) per parameter at once, the size of the states in bf16
    assert opt["optimizer temporaries"] == pytest.approx(opt["optimizer states"] / 2, rel=0.01)


# -- honest refusals: one line, why, and what would work ------------------------------------

def _tiny_llama(**over):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
    cfg.update(over)
    return cfg


def test_remote_code_is_refused_with_what_would_work():
    cfg = _tiny_llama(auto_map={"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    with pytest.raises(vw.VramError) as e:
        vw.estimate(cfg, backend="trace")
    msg = str(e.value)
    assert "\n" not in msg and "remote code" in msg and "modeling_custom.CustomForCausalLM" in msg
    assert "transformers-native" in msg


def test_unknown_model_type_is_refused():
    with pytest.raises(vw.VramError) as e:
        vw.estimate({"model_type": "no_such_model_xyz", "hidden_size": 8}, backend="auto")
    assert "no_such_model_xyz" in str(e.value) and "\n" not in str(e.value)


def test_data_dependent_shapes_are_refused(monkeypatch):
    """A model whose code reads tensor values to pick a shape (here: SiLU made to call
    .nonzero(), as an eager MoE router does) cannot be traced on fake tensors."""
    import transformers.activations as acts

    def silu_nonzero(self, x):
        return x[x.nonzero()[:, 0]]

    monkeypatch.setattr(acts.SiLUActivation, "forward", silu_nonzero)
    with pytest.raises(vw.VramError) as e:
        vw.estimate(_tiny_llama(), backend="trace", batch_size=1, seq_len=8)
    msg = str(e.value)
    assert "data-dependent" in msg and "what would work" in msg and "\n" not in msg


def test_custom_kernel_without_shape_rule_is_refused(monkeypatch):
    """An op with only a device kernel and no fake/meta implementation (a custom CUDA kernel)."""
    lib = torch.library.Library("vw_test_trace", "DEF")
    lib.define("fused_act(Tensor x) -> Tensor")
    lib.impl("fused_act", lambda x: x.clone(), "CPU")
    import transformers.activations as acts

    monkeypatch.setattr(acts.SiLUActivation, "forward", lambda self, x: torch.ops.vw_test_trace.fused_act(x))
    with pytest.raises(vw.VramError) as e:
        vw.estimate(_tiny_llama(), backend="trace", batch_size=1, seq_len=8)
    msg = str(e.value)
    assert "custom CUDA kernel" in msg and "what would work" in msg and "\n" not in msg


def test_untraced_knobs_and_optimizers_are_refused():
    with pytest.raises(vw.VramError, match="paged_adamw"):
        vw.estimate(_tiny_llama(), backend="trace", optimizer="paged_adamw", seq_len=8)
    with pytest.raises(vw.VramError, match="precision"):
        vw.estimate(_tiny_llama(), backend="trace", precision="fp8", seq_len=8)


def test_auto_traces_a_family_without_a_module():
    """A transformers model type no family module covers (here BLOOM's cousin 'gptj' or
    whatever the analytic path refuses) is traced under backend='auto'."""
    cfg = {"model_type": "gptj", "n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8, "vocab_size": 256,
           "n_positions": 64}
    with pytest.raises(vw.VramError):
        vw.estimate(cfg, backend="analytic", seq_len=16)
    e = vw.estimate(cfg, backend="auto", seq_len=16)
    assert e.backend == "trace"
    # transformers' GPT-J counts: wte 256x64, per layer ln (2x64) + q,k,v,out (4x64x64) + fc_in (256x64+256)
    # + fc_out (64x256+64), final ln, lm_head 256x64 + bias 256
    per_layer = 2 * 64 + 4 * 64 * 64 + (256 * 64 + 256) + (64 * 256 + 64)
    assert e.params_total == 256 * 64 + 2 * per_layer + 2 * 64 + 256 * 64 + 256
