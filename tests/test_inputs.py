"""Bad inputs through the Python API: a VramError naming the field and what is allowed.

Also: a preset's Hub id resolves without network, an unknown Hub id offline names the
alternatives (the network is never touched: ``hf_hub_download`` is replaced and sockets are
blocked), a bare parameter count is a stated assumption, and ``custom()`` counts by hand.
"""

from __future__ import annotations

import json
import math
import socket
import sys

import pytest

import vramwidget as vw
from vramwidget.model import architecture
from vramwidget.model.architecture import SUPPORTED_MODEL_TYPES, custom, from_config, from_param_count
from vramwidget.errors import UnknownPresetError, VramError
from vramwidget.training import CHOICES, QUANT_GROUPS, STATE_DTYPES

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000}


@pytest.fixture
def no_network(monkeypatch):
    """Any socket connection fails the test: nothing here may reach the network."""

    def refuse(*a, **k):
        raise AssertionError("test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def err(fn, *a, **k) -> VramError:
    with pytest.raises(VramError) as info:
        fn(*a, **k)
    e = info.value
    assert "\n" not in str(e), "error messages are one line"
    return e


def allowed(field):
    return [c for c, _ in CHOICES[field]]


# ---------------------------------------------------------------------------------------
# model resolution
# ---------------------------------------------------------------------------------------

def test_unknown_preset_suggests_close_matches(no_network):
    e = err(vw.estimate, "lama-2-7b")
    assert isinstance(e, UnknownPresetError) and isinstance(e, KeyError)
    assert e.field == "model"
    assert "'lama-2-7b'" in str(e) and "did you mean" in str(e) and "llama-2-7b" in str(e)
    assert str(e).startswith("model: ")  # KeyError's quoting is not applied


def test_unknown_name_without_close_match_lists_presets(no_network):
    e = err(architecture.load, "zzzz")
    assert e.field == "model"
    assert "presets:" in str(e) and "gpt2" in str(e) and "'7B'" in str(e)


@pytest.mark.parametrize("bad", ["", "   "])
def test_empty_model(bad):
    e = err(vw.estimate, bad)
    assert e.field == "model" and "preset" in str(e)


def test_model_of_wrong_type():
    e = err(vw.estimate, 123)
    assert e.field == "model" and "int" in str(e)


def test_hub_id_of_a_preset_resolves_offline(no_network, monkeypatch):
    import huggingface_hub

    def fail(*a, **k):
        raise AssertionError("a preset's Hub id must not be downloaded")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fail)
    monkeypatch.setattr(architecture, "_CACHE", {})
    arch = architecture.load("meta-llama/Llama-2-7b-hf")
    assert arch.name == "llama-2-7b"
    assert arch.hub_id == "meta-llama/Llama-2-7b-hf"
    assert arch.params_total == 6_738_415_616  # transformers' count of Llama 2 7B
    # case-insensitive, and aliases too
    assert architecture.load("META-LLAMA/llama-2-7b-HF").name == "llama-2-7b"
    assert architecture.load("meta-llama/Llama-2-7b-chat-hf").name == "llama-2-7b"
    assert vw.estimate("meta-llama/Llama-2-7b-hf").params_total == 6_738_415_616


def test_unknown_hub_id_offline_names_alternatives(no_network, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls = []

    def offline(repo_id, filename, **kw):
        calls.append((repo_id, filename))
        raise LocalEntryNotFoundError("cannot reach the Hub and the file is not cached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    e = err(vw.estimate, "someorg/unknown-model-7b")
    assert calls == [("someorg/unknown-model-7b", "config.json")]  # only config.json is asked for
    assert e.field == "model"
    msg = str(e)
    assert "someorg/unknown-model-7b" in msg and "offline" in msg
    assert "preset" in msg and "config.json" in msg and "dict" in msg


def test_gated_hub_id_says_so(no_network, monkeypatch):
    import huggingface_hub

    class GatedRepoError(Exception):
        pass

    def gated(repo_id, filename, **kw):
        raise GatedRepoError("403")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", gated)
    e = err(vw.estimate, "someorg/gated-model")
    assert e.field == "model" and "gated" in str(e) and "HF_TOKEN" in str(e)


def test_hub_id_without_huggingface_hub(no_network, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    e = err(vw.estimate, "someorg/unknown-model-7b")
    assert e.field == "model" and "huggingface_hub" in str(e) and "preset" in str(e)


def test_hub_token_is_passed(no_network, monkeypatch, tmp_path):
    import huggingface_hub

    p = tmp_path / "config.json"
    p.write_text(json.dumps(LLAMA))
    seen = {}

    def download(repo_id, filename, token=None, **kw):
        seen["token"] = token
        return str(p)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr(architecture, "_CACHE", {})
    arch = architecture.load("someorg/tiny-llama")
    assert seen["token"] == "hf_test_token"
    assert arch.hub_id == "someorg/tiny-llama" and arch.params_total == custom_llama_count()


# ---------------------------------------------------------------------------------------
# config.json problems
# ---------------------------------------------------------------------------------------

def test_unsupported_model_type_lists_supported():
    e = err(from_config, {**LLAMA, "model_type": "xlnet"})
    assert e.field == "model_type"
    assert "'xlnet'" in str(e)
    for mt in ("llama", "mistral", "mixtral", "qwen2", "gemma2", "gpt2", "falcon", "deepseek_v3"):
        assert mt in str(e)
    assert set(SUPPORTED_MODEL_TYPES) <= set(str(e).replace(",", " ").split())


def test_missing_model_type():
    e = err(from_config, {k: v for k, v in LLAMA.items() if k != "model_type"})
    assert e.field == "model_type" and "llama" in str(e)


def test_encoder_decoder_rejected():
    e = err(from_config, {**LLAMA, "is_encoder_decoder": True})
    assert e.field == "model_type" and "decoder" in str(e)


@pytest.mark.parametrize("missing", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"])
def test_missing_field(missing):
    e = err(from_config, {k: v for k, v in LLAMA.items() if k != missing})
    assert e.field == missing
    assert f"missing field '{missing}'" in str(e)


def test_old_spelling_accepted_instead_of_missing():
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 128}
    arch = from_config(gpt2)
    # wte V*h + wpe P*h + per layer (ln 2h, c_attn 3h*h+3h, c_proj h*h+h, ln 2h, c_fc 4h*h+4h, c_proj 4h*h+h)
    # + ln_f 2h; the head is tied
    h, V, P, L = 64, 1000, 128, 2
    per_layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (4 * h * h + 4 * h) + (4 * h * h + h)
    assert arch.params_total == V * h + P * h + L * per_layer + 2 * h
    e = err(from_config, {k: v for k, v in gpt2.items() if k != "n_embd"})
    assert e.field in ("hidden_size", "n_embd")


def test_heads_not_dividing_hidden_size():
    """Issue 27: transformers builds such a config with head_dim = hidden_size // heads
    (LlamaAttention: getattr(config, "head_dim", hidden_size // num_attention_heads)): 66 // 4 =
    16, so q_proj has 64 outputs; the estimate says so in a warning."""
    arch = from_config({**LLAMA, "hidden_size": 66})
    assert arch.head_dim == 16 and arch.q_dim == 64
    assert any("66 // 4 = 16" in n for n in arch.family.notes(arch))
    # an explicit head_dim makes it valid (Gemma-style: heads x head_dim != hidden)
    arch = from_config({**LLAMA, "hidden_size": 66, "head_dim": 16})
    assert arch.head_dim == 16 and arch.q_dim == 64


def test_kv_heads_not_dividing_heads():
    e = err(from_config, {**LLAMA, "num_key_value_heads": 3})
    assert e.field == "num_key_value_heads" and "(3)" in str(e) and "(4)" in str(e)


@pytest.mark.parametrize("field,value", [
    ("hidden_size", 0), ("hidden_size", -64), ("hidden_size", 64.5), ("hidden_size", "64"),
    ("hidden_size", float("nan")), ("hidden_size", True),
    ("num_hidden_layers", 0), ("num_hidden_layers", -1), ("num_attention_heads", 0),
    ("vocab_size", 0), ("vocab_size", -1000), ("intermediate_size", 0), ("intermediate_size", -128),
])
def test_zero_negative_or_non_integer_sizes(field, value):
    e = err(from_config, {**LLAMA, field: value})
    assert e.field == field
    assert "positive whole number" in str(e) and repr(value) in str(e)


def test_malformed_json_file_names_line_and_column(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}\n')
    e = err(from_config, str(p))
    assert e.field == "config_json"
    assert "not valid JSON" in str(e) and "line 3" in str(e) and "column 21" in str(e)
    assert str(p) in str(e)
    # through load() and estimate() alike
    assert err(vw.estimate, str(p)).field == "config_json"


def test_json_file_not_an_object(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("[1, 2, 3]")
    e = err(from_config, str(p))
    assert e.field == "config_json" and "object" in str(e) and "list" in str(e)


def test_unreadable_config_path(tmp_path):
    e = err(from_config, str(tmp_path / "missing.json"))
    assert e.field == "model" and "cannot read" in str(e)


# ---------------------------------------------------------------------------------------
# custom() and from_param_count()
# ---------------------------------------------------------------------------------------

def custom_llama_count() -> int:
    """LLAMA by hand: h=64, L=2, a=4 (d=16), kv=2, i=128, V=1000, untied, RMSNorm, no biases."""
    h, L, d, kv, i, V = 64, 2, 16, 2, 128, 1000
    attn = h * h + 2 * (kv * d) * h + h * h       # q, k, v, o: 4096 + 2 x 2048 + 4096 = 12,288
    mlp = 3 * h * i                               # gate, up, down: 24,576
    norms = 2 * h                                 # input + post-attention RMSNorm
    return V * h + L * (attn + mlp + norms) + h + V * h   # embed + blocks + final norm + lm_head


def test_config_count_by_hand():
    assert from_config(LLAMA).params_total == custom_llama_count() == 202_048


def test_custom_gated_counts_by_hand():
    arch = custom(hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2, intermediate_size=688,
                  vocab_size=5000)
    h, L, a, kv, i, V = 256, 3, 8, 2, 688, 5000
    d = h // a                                     # 32
    q = h * (a * d)                                # 65,536
    k = v = h * (kv * d)                           # 16,384 each
    o = (a * d) * h                                # 65,536
    mlp = 3 * h * i                                # gate + up + down = 528,384
    norms = 2 * h                                  # 512
    per_layer = q + k + v + o + mlp + norms        # 692,736
    total = V * h + L * per_layer + h + V * h      # embed 1,280,000 + 2,078,208 + 256 + lm_head 1,280,000
    assert per_layer == 692_736
    assert arch.params_total == total == 4_638_464
    assert arch.exact and arch.mlp_kind == "gated"
    tied = custom(hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2, intermediate_size=688,
                  vocab_size=5000, tied=True)
    assert tied.params_total == total - V * h      # the head shares the embedding
    assert arch.linear_modules() == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # LoRA r=8 on q and v: r x (in + out) per layer
    assert arch.lora_params(8, ["q_proj", "v_proj"]) == L * 8 * ((h + a * d) + (h + kv * d))


def test_custom_default_intermediate_follows_llama_rule():
    # Llama: i = 8h/3 rounded up to a multiple of 256; h=4096 -> 11008 (Llama 2 7B)
    arch = custom(hidden_size=4096, num_layers=32, num_heads=32, vocab_size=32000)
    assert arch.intermediate_size == 11008
    assert arch.params_total == 6_738_415_616       # = transformers' Llama 2 7B


def test_custom_plain_counts_by_hand():
    arch = custom(hidden_size=128, num_layers=2, num_heads=4, vocab_size=1000, mlp="plain")
    h, L, V = 128, 2, 1000
    i = 4 * h
    attn = (3 * h * h + 3 * h) + (h * h + h)       # fused qkv + dense, with biases: 66,048
    mlp = (i * h + i) + (h * i + h)                # fc in + fc out, with biases: 131,712
    norms = 2 * (2 * h)                            # two LayerNorms, weight + bias: 512
    total = V * h + L * (attn + mlp + norms) + 2 * h + V * h   # embed_in + blocks + final LN + embed_out
    assert arch.params_total == total == 652_800
    assert arch.mlp_kind == "plain" and arch.norm_kind == "layernorm"


def test_custom_counts_match_transformers():
    """Where torch and transformers are installed: the hand counts are what transformers builds."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cases = [
        (custom(hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2, intermediate_size=688, vocab_size=5000),
         transformers.LlamaConfig(hidden_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                                  intermediate_size=688, vocab_size=5000, tie_word_embeddings=False)),
        (custom(hidden_size=128, num_layers=2, num_heads=4, vocab_size=1000, mlp="plain"),
         transformers.GPTNeoXConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=512, vocab_size=1000, tie_word_embeddings=False)),
    ]
    for arch, cfg in cases:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        assert arch.params_total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kw,fields", [
    (dict(hidden_size=0), {"hidden_size"}),
    (dict(hidden_size=-64), {"hidden_size"}),
    (dict(num_layers=0), {"num_layers", "num_hidden_layers"}),
    (dict(num_layers=-2), {"num_layers", "num_hidden_layers"}),
    (dict(num_heads=0), {"num_heads", "num_attention_heads"}),
    (dict(vocab_size=0), {"vocab_size"}),
    (dict(hidden_size=66), {"num_heads", "num_attention_heads"}),
    (dict(num_kv_heads=3), {"num_kv_heads", "num_key_value_heads"}),
    (dict(num_kv_heads=-1), {"num_kv_heads", "num_key_value_heads"}),
    (dict(intermediate_size=-5), {"intermediate_size"}),
    (dict(mlp="moe"), {"mlp"}),
])
def test_custom_bad_numbers(kw, fields):
    base = dict(hidden_size=64, num_layers=2, num_heads=4, vocab_size=1000)
    e = err(custom, **{**base, **kw})
    assert e.field in fields, (e.field, str(e))


@pytest.mark.parametrize("kw,fields", [(dict(num_kv_heads=0), {"num_kv_heads", "num_key_value_heads"}),
                                       (dict(intermediate_size=0), {"intermediate_size"}),
                                       (dict(head_dim=0), {"head_dim"})])
def test_custom_zero_optional_sizes_are_rejected(kw, fields):
    """0 is a bad size, not 'use the default' (None is)."""
    e = err(custom, hidden_size=64, num_layers=2, num_heads=4, vocab_size=1000, **kw)
    assert e.field in fields and "positive whole number" in str(e)


def test_param_count_7b_is_exact_and_stated():
    arch = from_param_count("7B")
    assert arch.params_total == 7_000_000_000
    assert arch.exact is False
    assert isinstance(arch.assumption, str) and "7B" in arch.assumption and "assume" in arch.assumption
    # the assumed shape is named (h, L) so a person can check the activations
    assert f"h={arch.hidden_size}" in arch.assumption and f"L={arch.num_layers}" in arch.assumption
    # through load() and estimate(): same count, and the assumption is carried into the notes
    assert architecture.load("7B").params_total == 7_000_000_000
    est = vw.estimate("7B")
    assert est.params_total == 7_000_000_000 and arch.assumption in est.notes


@pytest.mark.parametrize("text,n", [("7B", 7_000_000_000), ("350M", 350_000_000), ("1.3b", 1_300_000_000),
                                    (13e9, 13_000_000_000), ("70_000_000_000", 70_000_000_000)])
def test_param_count_spellings(text, n):
    assert from_param_count(text).params_total == n


@pytest.mark.parametrize("bad", ["abc", "-7B", "0", 0, -1, float("nan"), "inf", "7X"])
def test_bad_param_count(bad):
    e = err(from_param_count, bad)
    assert e.field == "model"


# ---------------------------------------------------------------------------------------
# the training setup
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["batch_size", "seq_len", "grad_accum_steps"])
@pytest.mark.parametrize("value", [0, -1, 1.5, float("nan"), float("inf"), "4", True, None])
def test_bad_counts(field, value):
    e = err(vw.estimate, "llama-3.2-1b", **{field: value})
    assert e.field == field
    assert "whole number >= 1" in str(e)


def test_nan_lora_alpha():
    e = err(vw.estimate, "llama-3.2-1b", method="lora", lora_alpha=float("nan"))
    assert e.field == "lora_alpha" and "finite" in str(e)
    assert err(vw.estimate, "llama-3.2-1b", method="lora", lora_alpha=0).field == "lora_alpha"
    assert err(vw.estimate, "llama-3.2-1b", method="lora", lora_alpha=-8).field == "lora_alpha"


@pytest.mark.parametrize("r", [0, -8, 2.5, float("nan")])
def test_bad_lora_rank(r):
    e = err(vw.estimate, "llama-3.2-1b", method="lora", lora_r=r)
    assert e.field == "lora_r" and ">= 1" in str(e)


@pytest.mark.parametrize("p", [1.0, -0.1, float("nan")])
def test_bad_lora_dropout(p):
    assert err(vw.estimate, "llama-3.2-1b", method="lora", lora_dropout=p).field == "lora_dropout"


def test_lora_target_the_model_lacks():
    e = err(vw.estimate, "llama-3.2-1b", method="lora", lora_targets=["q_proj", "c_attn"])
    assert e.field == "lora_targets"
    assert "c_attn" in str(e)
    for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "all-linear"):
        assert m in str(e)
    # and the other way round: GPT-2 names its modules differently
    e = err(vw.estimate, "gpt2", method="qlora", lora_targets="q_proj,v_proj")
    assert e.field == "lora_targets" and "c_attn" in str(e)
    assert err(vw.estimate, "llama-3.2-1b", method="lora", lora_targets=[]).field == "lora_targets"
    # all-linear is accepted
    assert vw.estimate("llama-3.2-1b", method="lora", lora_targets="all-linear").params_trainable == 11_272_192


def test_full_finetuning_of_4bit_weights():
    for q in ("nf4", "fp4", "int8"):
        e = err(vw.estimate, "llama-3.2-1b", method="full", quantization=q)
        assert e.field == "method"
        assert q in str(e) and "qlora" in str(e)
    e = err(vw.estimate, "llama-3.2-1b", method="freeze", trainable_layers=2, quantization="nf4")
    assert e.field == "method"


def test_qlora_needs_a_quantized_base():
    e = err(vw.estimate, "llama-3.2-1b", method="qlora", quantization="none")
    assert e.field == "quantization" and "nf4" in str(e)


@pytest.mark.parametrize("field,bad", [("method", "dpo"), ("precision", "fp64"), ("quantization", "int4x"),
                                       ("optimizer", "adam"), ("gradient_checkpointing", "sometimes"),
                                       ("attn_implementation", "xformers")])
def test_unknown_choice_names_the_allowed_values(field, bad):
    e = err(vw.estimate, "llama-3.2-1b", **{field: bad})
    assert e.field == field
    assert repr(bad) in str(e)
    for value in allowed(field):
        assert value in str(e), value


def test_unknown_optimizer():
    e = err(vw.estimate, "llama-3.2-1b", optimizer="adam")
    assert e.field == "optimizer"
    assert "adamw, adamw_fused, adamw_8bit, paged_adamw, paged_adamw_8bit, adafactor, sgd, sgd_momentum, lion" \
        in str(e)


def test_unknown_setup_keyword_suggests():
    e = err(vw.estimate, "llama-3.2-1b", batchsize=4)
    assert e.field == "batchsize" and "batch_size" in str(e)


def test_quantized_groups_and_state_dtypes():
    e = err(vw.estimate, "llama-3.2-1b", method="qlora", quantized_groups=["ffn"])
    assert e.field == "quantized_groups"
    for g in QUANT_GROUPS:
        assert g in str(e)
    assert err(vw.estimate, "llama-3.2-1b", method="qlora", quantized_groups=[]).field == "quantized_groups"
    e = err(vw.estimate, "llama-3.2-1b", optimizer_state_dtypes="bf16,fp64")
    assert e.field == "optimizer_state_dtypes"
    for d in STATE_DTYPES:
        assert d in str(e)


def test_linked_fields():
    assert err(vw.estimate, "llama-3.2-1b", prepare_kbit=True).field == "prepare_kbit"
    assert err(vw.estimate, "llama-3.2-1b", method="freeze").field == "trainable_layers"
    e = err(vw.estimate, "llama-3.2-1b", method="freeze", trainable_layers=99)
    assert e.field == "trainable_layers" and "16" in str(e)
    assert err(vw.estimate, "llama-3.2-1b", double_quant="yes").field == "double_quant"


def test_quantized_groups_embedding_is_not_silently_ignored():
    """Every group QUANT_GROUPS allows changes what is stored (or is refused with a clear error)."""
    base = vw.estimate("llama-3.1-8b", method="qlora", quantized_groups=["mlp"])
    try:
        both = vw.estimate("llama-3.1-8b", method="qlora", quantized_groups=["mlp", "embedding"])
    except VramError as e:  # rejecting it with a clear message would be fine too
        assert e.field == "quantized_groups"
        return
    assert both.phases_bytes["after_load"] < base.phases_bytes["after_load"]
    head = vw.estimate("llama-3.1-8b", method="qlora", quantized_groups=["mlp", "lm_head"])  # untied head
    assert head.phases_bytes["after_load"] < base.phases_bytes["after_load"]


def test_errors_are_value_errors():
    """Callers that catch ValueError keep working."""
    with pytest.raises(ValueError):
        vw.estimate("llama-3.2-1b", batch_size=0)
    with pytest.raises(ValueError):
        vw.estimate("lama-2-7b")


def test_good_inputs_still_work():
    est = vw.estimate("llama-3.2-1b", method="qlora", batch_size=4, seq_len=2048, gradient_checkpointing=True)
    assert est.setup["quantization"] == "nf4" and est.setup["gradient_checkpointing"] == "full"
    assert math.isfinite(est.peak_allocated_bytes) and est.peak_allocated_bytes > 0
