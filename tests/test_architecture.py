"""Parameter inventories against transformers' own counts.

Expected numbers come from tests/data/param_counts.json, written by
tools/record_param_counts.py (transformers 5.23 on the meta device; peft 0.21 for LoRA).
When torch and transformers are importable, one test re-derives a few of them live.
"""

import json

import pytest

from vramwidget.model import architecture as A
from vramwidget.model import presets
from vramwidget.measure.validate import BUILTIN_CASES, load_cases
from vramwidget.errors import VramError


def _validation_configs():
    out = {}
    for c in load_cases(BUILTIN_CASES):
        out.setdefault(c["name"], c["model"])
    return out


def _arch_for(key):
    if key.startswith("validation:"):
        name = key.split(":", 1)[1]
        return A.from_config(_validation_configs()[name], name=name)
    return A.load(key)


def test_every_preset_is_recorded(param_counts):
    assert len(presets.list_presets()) >= 30
    missing = [p for p in presets.list_presets() if p not in param_counts]
    assert not missing, f"presets without a recorded transformers count: {missing}"


@pytest.mark.parametrize("key", sorted(json.load(open(__file__.replace("test_architecture.py",
                                                                        "data/param_counts.json")))))
def test_params_total_equals_transformers(key, param_counts):
    arch = _arch_for(key)
    assert arch.params_total == param_counts[key]["params_total"]


@pytest.mark.parametrize("key", ["llama-2-7b", "gpt2", "mixtral-8x7b", "deepseek-v2-lite", "phi-3-mini",
                                 "gemma-2-2b", "opt-1.3b", "bloom-7b1", "falcon-7b", "qwen1.5-moe-a2.7b",
                                 "olmoe-1b-7b", "pythia-1b", "qwen3-8b", "gpt-oss-20b",
                                 "llama-4-scout-17b-16e", "glm-4.5-air", "lfm2-1.2b",
                                 "gemma-3-4b-vision", "mistral-small-3.2-24b", "modernbert-base",
                                 "bert-base-uncased", "bart-large"])
def test_tensor_shapes_equal_transformers(key, param_counts):
    """Every tensor: the same name pattern, shape and number of instances as transformers."""
    arch = _arch_for(key)
    ours = {}
    for t in arch.tensors:   # a tensor present in several runs of layers (hybrids) is listed once per run
        ours[t.name] = (list(t.shape), ours.get(t.name, (None, 0))[1] + t.repeat)
    theirs = {t["name"]: (t["shape"], t["count"]) for t in param_counts[key]["tensors"]}
    assert ours == theirs


def test_validation_counts_match_measured(cases):
    """measured.params_total of every non-QLoRA case (the H200 run's own count)."""
    for c in cases:
        m = c["measured"]
        if m["params_total"] is None or c["training"]["method"] != "full":
            continue
        assert A.from_config(c["model"]).params_total == m["params_total"], c["id"]


def test_lora_trainable_equals_peft(cases):
    """params_trainable of the LoRA/QLoRA cases equals what peft counted on the H200."""
    from vramwidget.estimate import estimate_setup
    from vramwidget.training import setup_from_case

    n = 0
    for c in cases:
        if c["training"]["method"] not in ("lora", "qlora"):
            continue
        est = estimate_setup(A.from_config(c["model"]), setup_from_case(c["training"]))
        assert est.params_trainable == c["measured"]["params_trainable"], c["id"]
        n += 1
    assert n == 14


def test_lora_counts_recorded_with_peft(param_counts):
    for key in ("llama-2-7b", "qwen2.5-0.5b"):
        arch = A.load(key)
        for rec in param_counts[key]["lora"]:
            targets = rec["target_modules"]
            targets = ["all-linear"] if targets == "all-linear" else targets
            assert arch.lora_params(rec["r"], targets) == rec["params_trainable"], (key, rec["target_modules"])


def test_llama_2_7b_by_hand():
    """32 x (4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096) + 2 x 32000 x 4096 + 4096 = 6,738,415,616."""
    per_layer = 4 * 4096 ** 2 + 3 * 4096 * 11008 + 2 * 4096
    assert A.load("llama-2-7b").params_total == 32 * per_layer + 2 * 32000 * 4096 + 4096 == 6_738_415_616


def test_hub_id_and_alias_resolve_offline():
    assert A.load("meta-llama/Llama-2-7b-hf").name == "llama-2-7b"
    assert A.load("META-LLAMA/LLAMA-2-7B-HF").params_total == 6_738_415_616


def test_old_and_new_config_spellings():
    """GPT-2's n_embd/n_layer/n_head and Llama's rope_theta vs rope_parameters give the same model."""
    old = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 100, "rope_theta": 10000.0}
    new = dict(old, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    new.pop("rope_theta")
    assert A.from_config(old).params_total == A.from_config(new).params_total
    g1 = A.from_config({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100})
    g2 = A.from_config({"model_type": "gpt2", "hidden_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "vocab_size": 100})
    assert g1.params_total == g2.params_total


def test_inventory_roles_and_linear_flags():
    arch = A.load("llama-3.1-8b")
    roles = arch.params_by_role()
    assert set(roles) == {"embedding", "attn_q", "attn_k", "attn_v", "attn_o", "mlp_gate", "mlp_up",
                          "mlp_down", "norm", "output_head"}
    assert sum(roles.values()) == arch.params_total
    assert arch.linear_modules() == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    q = next(t for t in arch.tensors if t.module == "q_proj")
    assert (q.in_features, q.out_features, q.repeat, q.layers) == (4096, 4096, 32, (0, 31))


def test_config_file_and_folder(tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    a = A.load(str(tmp_path / "config.json"))
    b = A.load(str(tmp_path))
    # embed 1000x128 + 2 x (q 128x128+128, k 64x128+64, v 64x128+64, o 128x128, 3 x 128x256, 2 norms) + norm
    per_layer = (128 * 128 + 128) + 2 * (64 * 128 + 64) + 128 * 128 + 3 * 128 * 256 + 2 * 128
    assert a.params_total == b.params_total == 1000 * 128 + 2 * per_layer + 128


def test_param_count_model_is_marked_assumed():
    arch = A.from_param_count("7B")
    assert arch.params_total == 7_000_000_000
    assert not arch.exact and "assume" in arch.assumption


def test_rederive_with_transformers():
    """Live check of three recorded counts with transformers on the meta device."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for key in ("llama-3.2-1b", "gpt2", "olmoe-1b-7b"):
        cfg = dict(presets.get(key)["config"])
        mt = cfg.pop("model_type")
        for k in ("architectures", "torch_dtype", "transformers_version"):
            cfg.pop(k, None)
        conf = transformers.AutoConfig.for_model(mt, **cfg)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(conf)
        assert sum(p.numel() for p in model.parameters()) == A.load(key).params_total


def test_contradictory_spellings_are_rejected():
    from vramwidget.errors import VramError

    with pytest.raises(VramError, match="contradictory") as e:
        A.from_config({"model_type": "gpt2", "n_embd": 64, "hidden_size": 128, "n_layer": 2, "n_head": 4,
                       "vocab_size": 10})
    assert e.value.field == "hidden_size"


TINY_CONFIGS = {
    "llama": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100),
    "mistral": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=100),
    "mixtral": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=100),
    "qwen2": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100),
    "qwen2_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
                      shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=100),
    "qwen3": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=100),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                      vocab_size=100, head_dim=16),
    "gemma": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=16, vocab_size=100),
    "gemma2": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=100),
    "gemma3_text": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=32, vocab_size=100),
    "phi3": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=0),
    "gpt_neox": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     vocab_size=100, bos_token_id=0, eos_token_id=0),
    "opt": dict(hidden_size=64, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
                word_embed_proj_dim=32, pad_token_id=1, bos_token_id=2, eos_token_id=2),
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=100),
    "falcon": dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=100,
                   bos_token_id=0, eos_token_id=0),
    "olmo": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 vocab_size=100, pad_token_id=1, eos_token_id=2),
    "olmo2": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=100, pad_token_id=1, eos_token_id=2),
    "olmoe": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_experts=4, num_experts_per_tok=2, vocab_size=100, pad_token_id=1, eos_token_id=2),
    "deepseek_v2": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
                        num_attention_heads=4, n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2,
                        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, vocab_size=100),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, vocab_size=100, n_group=1,
                        topk_group=1),
    "smollm3": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=100, pad_token_id=1),
    # issue 11's families (each counted with the model class its family counts by default)
    "gpt_oss": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=100),
    "llama4_text": dict(hidden_size=64, intermediate_size=32, intermediate_size_mlp=48, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                        vocab_size=100, interleave_moe_layer_step=2),
    "glm4_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4,
                     n_shared_experts=1, first_k_dense_replace=1, num_experts_per_tok=2, vocab_size=100,
                     attention_bias=True, use_qk_norm=True),
    "lfm2": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=100, layer_types=["conv", "full_attention", "conv", "conv"]),
    "gemma3": dict(text_config=dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, vocab_size=300),
                   vision_config=dict(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                      image_size=56, patch_size=14), mm_tokens_per_image=4),
    "mistral3": dict(text_config=dict(model_type="mistral", num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300),
                     vision_config=dict(model_type="pixtral", num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                        num_attention_heads=4, image_size=56, patch_size=14)),
    "qwen2_5_vl": dict(text_config=dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=300, bos_token_id=0, eos_token_id=0),
                       vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64,
                                          fullatt_block_indexes=[1])),
    # encoder-decoders (T5ForConditionalGeneration & co.: AutoModelForSeq2SeqLM)
    "t5": dict(d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=3, num_heads=4, vocab_size=100,
               feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    "mt5": dict(d_model=64, d_kv=16, d_ff=96, num_layers=3, num_heads=4, vocab_size=100),
    "bart": dict(d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=96, decoder_ffn_dim=96, vocab_size=100, max_position_embeddings=40),
    "bert": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
                 max_position_embeddings=40, type_vocab_size=3),
    "umt5": dict(d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=3, num_heads=4, vocab_size=100,
                 feed_forward_proj="gated-gelu"),
    "qwen3_next": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=100, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16),
    "modernbert": dict(num_hidden_layers=3, hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=100,
                       global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                       sep_token_id=2),
}

#: the transformers Auto class of each task vramwidget counts
AUTO_CLASS = {"causal_lm": "AutoModelForCausalLM", "image_text_to_text": "AutoModelForImageTextToText",
              "seq2seq_lm": "AutoModelForSeq2SeqLM", "masked_lm": "AutoModelForMaskedLM"}


def test_every_supported_type_has_a_tiny_config():
    assert set(TINY_CONFIGS) == set(A.SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_tiny_config_counts_equal_transformers_live(model_type):
    """Every supported model_type, built by transformers on the meta device (skipped without it)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    conf = transformers.AutoConfig.for_model(model_type, **TINY_CONFIGS[model_type])
    arch = A.from_config(conf.to_dict())
    with torch.device("meta"):
        model = getattr(transformers, AUTO_CLASS[arch.task]).from_config(conf)
    assert arch.params_total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type,task,cls", [("t5", "encoder", "T5EncoderModel"), ("t5", "seq2seq_lm", "T5ForConditionalGeneration"),
                                                 ("mt5", "encoder", "MT5EncoderModel"),
                                                 ("umt5", "encoder", "UMT5EncoderModel")])
def test_task_keyword_counts_that_model_class(model_type, task, cls):
    """``task`` picks the transformers class counted: T5EncoderModel is shared + the encoder
    (no decoder, no head), built by transformers on the meta device."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    conf = transformers.AutoConfig.for_model(model_type, **TINY_CONFIGS[model_type])
    arch = A.from_config(conf.to_dict(), task=task)
    with torch.device("meta"):
        model = getattr(transformers, cls)(conf)
    assert arch.task == task
    assert arch.params_total == sum(p.numel() for p in model.parameters())
    with pytest.raises(VramError, match="task"):
        A.from_config(conf.to_dict(), task="masked_lm")
