"""vramwidget.measure.training on a CUDA GPU: real memory statistics (skipped without a GPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramwidget.measure.training import MEASURED_FIELDS, case_from_setup, measure_case  # noqa: E402
from vramwidget.units import MIB  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Llama 3.2 1B's shapes (hidden 2048, MLP 8192, 32 query / 8 KV heads of 64, vocab 128256,
# tied embeddings) with 2 layers instead of 16: about 384M parameters, 0.7 GiB in bf16.
LLAMA_1B_2_LAYERS = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def test_full_bf16_step_memory_on_cuda():
    case = case_from_setup(LLAMA_1B_2_LAYERS, "llama-3.2-1b-2layers", batch_size=2, seq_len=512)
    rec = measure_case(case, device="cuda", steps=3)
    m = rec["measured"]
    assert list(m) == list(MEASURED_FIELDS)
    for field, value in m.items():
        assert value is not None, field

    phases = (m["forward_peak_mib"], m["backward_peak_mib"], m["optimizer_step_peak_mib"])
    assert m["peak_allocated_mib"] == max(phases)
    assert m["weights_mib"] > 0
    # bf16 weights: 2 bytes a parameter (plus small buffers such as rotary inverse frequencies)
    assert m["weights_mib"] == pytest.approx(m["params_total"] * 2 / MIB, rel=0.05)
    # AdamW keeps two bf16 states per parameter between steps: at least 3x the weights
    assert m["persistent_after_step_mib"] >= 2.9 * m["weights_mib"]
    assert m["max_reserved_mib"] >= m["peak_allocated_mib"]
    assert m["first_step_peak_mib"] > m["weights_mib"]
    assert rec["env"]["gpu"] and rec["env"]["cuda_context_mib"] > 0
    assert "memory_stats" not in rec["env"]


def test_qlora_step_memory_on_cuda():
    pytest.importorskip("bitsandbytes")
    case = case_from_setup(LLAMA_1B_2_LAYERS, "llama-3.2-1b-2layers", method="qlora",
                           gradient_checkpointing=True, prepare_model_for_kbit_training=True,
                           batch_size=1, seq_len=256)
    rec = measure_case(case, device="cuda", steps=3)
    m = rec["measured"]
    assert m["params_total"] is None and m["params_trainable"] > 0
    phases = (m["forward_peak_mib"], m["backward_peak_mib"], m["optimizer_step_peak_mib"])
    assert m["peak_allocated_mib"] == max(phases)
    assert m["weights_mib"] > 0
