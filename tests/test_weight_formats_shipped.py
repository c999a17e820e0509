"""Weight formats as checkpoints ship them, the format a config.json's quantization_config picks,
and the transformers releases that changed inference memory (versions={"transformers": ...})."""

import json

import pytest

import vramwidget as vw
from vramwidget.errors import VramError
from vramwidget.inference.estimate import WEIGHT_FORMATS, InferenceSetup, estimate_inference, weights_bytes
from vramwidget.units import GIB

LLAMA = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
         "eos_token_id": 2}


@pytest.mark.parametrize("name,published", [
    # openai/gpt-oss-20b, model.safetensors.index.json: {"metadata": {"total_size": 13761264768}}
    ("gpt-oss-20b", 13_761_264_768),
    # openai/gpt-oss-120b: 65,248,815,744 B of tensors (its index's total_size, as two public test
    # suites quote it for that checkpoint)
    ("gpt-oss-120b", 65_248_815_744),
])
def test_gpt_oss_mxfp4_weights_are_the_published_checkpoint(name, published):
    """MXFP4 experts: n/2 B of e2m1 pairs + n/32 B of e8m0 scales; everything else bf16 (the
    checkpoint) except the expert biases, fp32 in Mxfp4GptOssExperts: within 0.2%."""
    got = weights_bytes(name, "mxfp4")
    assert abs(got / published - 1) < 0.02
    assert abs(got / published - 1) < 0.002


def test_gpt_oss_picks_mxfp4_from_its_config_and_fits_a_4090():
    est = estimate_inference("gpt-oss-20b", context_len=4096, gpu="RTX 4090")
    assert est.setup["weights"] == "mxfp4"
    assert any("quantization_config" in n and "mxfp4" in n for n in est.notes)
    assert any("dequantizes them to bf16" in n for n in est.notes)       # the fallback is said
    assert est.weights_bytes < 13 * GIB and est.fits
    bf16 = estimate_inference("gpt-oss-20b", context_len=4096, weights="bf16")     # explicit weights win
    assert bf16.setup["weights"] == "bf16" and bf16.weights_bytes > 38 * GIB
    assert any("the checkpoint ships mxfp4" in n for n in bf16.notes)


def test_mxfp4_is_refused_where_transformers_has_no_mxfp4_path():
    with pytest.raises(VramError, match="mxfp4") as e:
        estimate_inference("llama-3.1-8b", weights="mxfp4")
    assert e.value.field == "weights"


def _checkpoint(tmp_path, qc):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(LLAMA, quantization_config=qc)))
    return str(d)


@pytest.mark.parametrize("qc,weights,extra", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "gptq-4bit", {"group_size": 128}),
    ({"quant_method": "gptq", "bits": 8, "group_size": 32}, "gptq-8bit", {"group_size": 32}),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm"}, "awq-4bit", {"group_size": 64}),
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     "fp8-block", {"group_size": 128}),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8", {}),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
      "bnb_4bit_use_double_quant": True}, "nf4", {"double_quant": True}),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
     "ct-w4a16", {"group_size": 128}),
])
def test_a_local_checkpoint_picks_its_shipped_format(tmp_path, qc, weights, extra):
    path = _checkpoint(tmp_path, qc)
    est = estimate_inference(path, context_len=1024)
    assert est.setup["weights"] == weights
    for k, v in extra.items():
        assert est.setup[k] == v
    assert est.notes[0].startswith("weights: the checkpoint's config.json ships quantization_config")
    assert estimate_inference(path, context_len=1024, weights="bf16").setup["weights"] == "bf16"


def test_block_fp8_counts_one_fp32_scale_per_128_block():
    """FP8Linear (transformers integrations/finegrained_fp8.py): weight (out, in) e4m3 + weight_scale_inv
    (ceil(out/128), ceil(in/128)) fp32.  Llama-3.1-8B's q_proj 4096 x 4096: 16 MiB + 32 x 32 x 4 B."""
    arch = vw.load_architecture("llama-3.1-8b")
    est = estimate_inference(arch, weights="fp8-block", context_len=1024)
    q = next(n for c in est.phase_components["after_load"] if c.name == "quantization constants"
             for g in c.children for n in g.children if "q_proj" in n.name)
    assert q.bytes == 32 * 32 * 32 * 4            # 32 layers
    assert estimate_inference(arch, weights="fp8-block", context_len=1024).weights_bytes < \
        estimate_inference(arch, weights="bf16", context_len=1024).weights_bytes * 0.6


def test_the_cli_and_the_widget_offer_the_new_formats():
    for f in ("mxfp4", "fp8-block", "ct-w4a16", "ct-w8a8", "ct-fp8"):
        assert f in WEIGHT_FORMATS
    from vramwidget.widget.inference import inference_options

    offered = [v for v, _label in inference_options()["weights"]]
    assert {"mxfp4", "fp8-block", "ct-w4a16"} <= set(offered)
    from vramwidget.cli import main

    assert main(["infer", "gpt-oss-20b", "--weights", "mxfp4", "--context-len", "2048"]) == 0


def test_mixtral_qlora_experts_are_quantized_before_the_fused_experts():
    """transformers 4.57.0 (models/mixtral/modeling_mixtral.py): each expert is a
    MixtralBlockSparseTop2MLP of nn.Linear w1/w2/w3, which bitsandbytes replaces by Linear4bit;
    5.x fuses them into MixtralExperts.gate_up_proj / down_proj parameters, left 16-bit."""
    now = vw.estimate("mixtral-8x7b", method="qlora", batch_size=1, seq_len=512)
    old = vw.estimate("mixtral-8x7b", method="qlora", batch_size=1, seq_len=512, versions={"transformers": "4.46"})
    experts = 32 * 8 * 3 * 14336 * 4096           # 45.1 B expert weights
    # 16-bit (2 B) against 4-bit (0.5 B) + double-quantized absmax (about 0.127 bit)
    assert now.phases_bytes["after_load"] - old.phases_bytes["after_load"] == pytest.approx(
        experts * (2 - 0.5 - 0.127 / 8), rel=0.01)
    assert weights_bytes("mixtral-8x7b", "nf4", versions={"transformers": "4.46"}) < 26 * GIB


def test_the_legacy_tuple_cache_keeps_two_caches_in_a_decode_step():
    """transformers 4.35.2 (models/llama/modeling_llama.py, LlamaAttention.forward):
    ``key_states = torch.cat([past_key_value[0], key_states], dim=2)`` ... ``past_key_value =
    (key_states, value_states)``; generate()'s model_inputs keep the previous tuple until the next
    step's prepare_inputs_for_generation.  Llama-2-7B, 1,024-token prompt to 2,048: at the last
    decode step the 2,047- and the 2,048-token caches coexist: + 1 GiB over transformers 5."""
    kw = dict(context_len=2048, prompt_len=1024)
    new = estimate_inference("llama-2-7b", **kw)
    old = estimate_inference("llama-2-7b", versions={"transformers": "4.35"}, **kw)
    assert old.setup["attn_implementation"] == "eager"         # no SDPA before 4.36: said
    assert any("no SDPA path" in n for n in old.notes)
    kv = old.component_bytes("decode")["kv cache"]
    assert kv == pytest.approx(2 * 2047.5 * 32 * 2 * 4096 * 2, rel=0.002)
    assert old.phases_bytes["decode"] - new.phases_bytes["decode"] > 0.95 * GIB
    assert "legacy tuple cache" in old.assumes and "DynamicCache" in new.assumes
    # < 4.45 the head runs on every position and LlamaForCausalLM upcasts: logits = logits.float()
    # (4.44.2), 1,024 x 32,000 x 4 B in the prefill; 4.45 keeps only the last position's
    from vramwidget.model.architecture import load
    from vramwidget.inference.events import inference_events

    arch = load("llama-2-7b")
    for ver, n in (("4.44", 1024 * 32000 * 4), ("4.45", 32000 * 4)):
        sizes = [nb for kind, _k, nb, label in inference_events(arch, InferenceSetup.from_kwargs(
            versions={"transformers": ver}, **kw)) if kind == "alloc" and label and label[0] == "logits"]
        assert max(sizes) == n
