"""generate() measurements (vramwidget.measure.inference) on the CPU: the code path, the
record format validate() reads, and the KV cache counted from the cache's own tensors."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from vramwidget.errors import VramError  # noqa: E402
from vramwidget.measure.inference import measure_inference_case, normalize_inference_case  # noqa: E402
from vramwidget.measure.validate import validate  # noqa: E402

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


def test_generate_record_on_cpu(tmp_path):
    case = {"id": "t1", "name": "tiny", "model": TINY,
            "inference": {"weights_dtype": "bfloat16", "batch_size": 2, "prompt_len": 16, "max_new_tokens": 8}}
    rec = measure_inference_case(case, device="cpu")
    m = rec["measured"]
    # embed 256x64 + 2 x (q 64x64, k 32x64, v 32x64, o 64x64, 3 x 64x128, 2 norms) + norm + head 256x64
    per_layer = 64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert m["params_total"] == 256 * 64 + 2 * per_layer + 64 + 256 * 64
    # 2 layers x (k, v) x 2 KV heads x 16 dims x 2 B, for 2 sequences of 16 + 8 - 1 cached tokens
    assert m["kv_cache_bytes"] == 2 * 2 * 2 * 16 * 2 * 2 * 23
    assert m["weights_mib"] is None and rec["env"]["memory_stats"] == "unavailable on cpu"
    # the record is what validate reads; its KV prediction is exact
    p = tmp_path / "inf.jsonl"
    rec["measured"]["kv_cache_mib"] = m["kv_cache_bytes"] / 2**20
    p.write_text(json.dumps(rec) + "\n")
    row = validate(str(p))["cases"][0]
    assert row["error"]["kv_cache_mib"] == pytest.approx(0.0)


def test_bad_inference_cases_name_the_field():
    with pytest.raises(VramError) as e:
        normalize_inference_case({"model": TINY, "inference": {"batch_size": 0}})
    assert e.value.field == "inference.batch_size"
    with pytest.raises(VramError) as e:
        normalize_inference_case({"model": TINY, "inference": {"temperature": 1.0}})
    assert "temperature" in str(e.value)
    with pytest.raises(VramError, match="bitsandbytes"):
        measure_inference_case({"model": TINY, "inference": {"quantization": {"load_in_4bit": True}}}, device="cpu")
