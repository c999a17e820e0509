"""Tensor-parallel sharding rules, checked against transformers' own TP plan on the meta device.

transformers' config classes carry ``base_model_tp_plan`` (``layers.*.self_attn.q_proj:
colwise``, ``o_proj: rowwise``, ``mlp.experts.gate_up_proj: packed_colwise`` ...).  Building
the model on the meta device and applying those rules to every parameter's shape gives the
per-rank parameter count of each layer; :func:`vramwidget.inference.engines.gpu_share` must give the same.
The rules not in that plan (vocab-parallel embedding and head with vLLM's padding to 64, KV heads
replicated when fewer than the TP size, experts by EP, pipeline stages) are checked against the
counts vLLM's code gives.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings, strategies as st

from vramwidget.model import presets
from vramwidget.model.architecture import load
from vramwidget.inference.engines import check_layout, gpu_share, pad_vocab, pp_stages
from vramwidget.errors import VramError
from vramwidget.inference.estimate import estimate_inference

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _meta_model(key: str):
    cfg = dict(presets.get(key)["config"])
    mt = cfg.pop("model_type")
    for k in ("architectures", "torch_dtype", "transformers_version"):
        cfg.pop(k, None)
    conf = transformers.AutoConfig.for_model(mt, **cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(conf)
    return conf, model


def _plan_rule(plan, name: str):
    """The plan entry matching parameter ``name`` (``model.layers.3.mlp.down_proj.weight``)."""
    module = name.rsplit(".", 1)[0]
    best, best_len = None, -1
    for pattern, rule in plan.items():
        rx = "^(model\\.)?" + re.escape(pattern).replace("\\*", "\\d+") + "$"
        if (re.match(rx, module) or re.match(rx, name)) and len(pattern) > best_len:
            best, best_len = rule, len(pattern)     # the most specific entry wins
    return best


def _sharded_numel(shape, rule: str, tp: int, is_bias: bool) -> int:
    """transformers' rules on a shape: colwise shards the output dim (dim -2 of a weight, the
    bias), rowwise the input dim (dim -1; its bias is replicated); packed_colwise like colwise."""
    shape = list(shape)
    if rule in ("colwise", "packed_colwise"):
        ax = -1 if is_bias or len(shape) == 1 else -2
        assert shape[ax] % tp == 0, (shape, rule, tp)
        shape[ax] //= tp
    elif rule == "rowwise" and not is_bias and len(shape) >= 2:
        assert shape[-1] % tp == 0, (shape, rule, tp)
        shape[-1] //= tp
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("key,tp", [
    ("llama-3.1-8b", 2), ("llama-3.1-8b", 8), ("qwen2.5-7b", 2), ("mistral-7b", 4),
    ("mixtral-8x7b", 8), ("qwen3-30b-a3b", 4), ("llama-3.2-1b", 8),
])
def test_layer_shards_match_transformers_tp_plan(key, tp):
    conf, model = _meta_model(key)
    plan = dict(getattr(conf, "base_model_tp_plan", None) or {})
    assert plan, f"{key}: transformers has a base_model_tp_plan"
    expected = 0
    for name, p in model.named_parameters():
        if ".layers." not in name:
            continue
        rule = _plan_rule(plan, name)
        expected += _sharded_numel(p.shape, rule, tp, name.endswith(".bias")) if rule else p.numel()
    arch = load(key)
    assert arch.num_kv_heads >= tp        # where both split heads the same way
    share = gpu_share(arch, tp=tp)
    got = sum(t.numel for t in share.tensors if t.layers is not None)
    assert got == expected


def test_vocab_parallel_embedding_and_head_with_vllm_padding():
    # vLLM pads the vocabulary to a multiple of 64 (DEFAULT_VOCAB_PADDING_SIZE) and gives
    # each rank padded / tp rows (vocab_parallel_embedding.py)
    arch = load("mistral-7b")                     # V = 32000 = 64 x 500: no padding
    assert pad_vocab(arch, 64).vocab_size == 32000
    arch = load("qwen2.5-7b")                     # V = 152064 = 64 x 2376
    share = gpu_share(arch, tp=4, vocab_padding=64)
    emb = next(t for t in share.tensors if t.role == "embedding")
    head = next(t for t in share.tensors if t.role == "output_head")
    assert emb.shape == (152064 // 4, 3584) and head.shape == (152064 // 4, 3584)
    odd = load({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 32001})
    assert pad_vocab(odd, 64).vocab_size == 32064                   # 501 x 64
    emb = next(t for t in gpu_share(odd, tp=2, vocab_padding=64).tensors if t.role == "embedding")
    assert emb.shape == (32064 // 2, 64)


def test_kv_heads_replicated_when_fewer_than_tp():
    # vLLM's LlamaAttention: num_kv_heads = max(1, total_num_kv_heads // tp_size) -- 8 KV heads on
    # TP 16 keep one head per rank (each head on two ranks)
    arch = load("llama-3.1-70b")
    for tp, kv_local in ((2, 4), (8, 1), (16, 1)):
        if arch.num_heads % tp:
            continue
        share = gpu_share(arch, tp=tp)
        assert share.num_kv_heads == kv_local
        k = next(t for t in share.tensors if t.role == "attn_k" and not t.is_bias)
        assert k.out_features == kv_local * arch.head_dim
    # the KV cache per GPU follows: 80 layers x 2 x kv_local x 128 x 2 B
    e = estimate_inference("llama-3.1-70b", engine="vllm", gpu="H100 80GB", tensor_parallel=16,
                           gpu_memory_utilization=0.9, context_len=8192)
    assert e.serving["kv_bytes_per_token"] == 80 * 2 * 1 * 128 * 2


def test_experts_by_expert_parallel():
    arch = load("mixtral-8x7b")
    share = gpu_share(arch, tp=1, ep=4)
    ex = [t for t in share.tensors if t.experts]
    assert ex and all(t.experts == 2 and t.shape[0] == 2 for t in ex)
    with pytest.raises(VramError) as e:
        check_layout(arch, 1, 1, 3)
    assert e.value.field == "expert_parallel"
    # vLLM's --enable-expert-parallel on TP 4: whole experts over the 4 ranks (not split by TP),
    # attention split by TP
    both = gpu_share(arch, tp=4, ep=4)
    ex = [t for t in both.tensors if t.experts]
    full = [t for t in arch.tensors if t.experts]
    assert sum(t.numel for t in ex) * 4 == sum(t.numel for t in full)
    q = next(t for t in both.tensors if t.role == "attn_q")
    assert q.out_features == arch.hidden_size // 4


def test_pipeline_stages_follow_vllm_get_pp_indices():
    # vllm/distributed/utils.py get_pp_indices: even split, the remainder on the last stages
    assert pp_stages(80, 3) == [(0, 25), (26, 52), (53, 79)]
    arch = load("llama-3.1-8b")
    first = gpu_share(arch, pp=2, stage=0)
    last = gpu_share(arch, pp=2, stage=1)
    assert first.num_layers == last.num_layers == 16
    assert any(t.role == "embedding" for t in first.tensors) and not any(t.role == "output_head"
                                                                          for t in first.tensors)
    assert any(t.role == "output_head" for t in last.tensors)
    assert first.params_total + last.params_total == arch.params_total


def test_bad_layouts_name_the_field():
    with pytest.raises(VramError) as e:
        check_layout(load("llama-3.1-8b"), 3, 1, 1)           # 32 heads over 3 ranks
    assert e.value.field == "tensor_parallel"
    with pytest.raises(VramError) as e:
        estimate_inference("llama-3.1-8b", engine="vllm", gpu="H100 80GB", tensor_parallel=0)
    assert e.value.field == "tensor_parallel"


@settings(max_examples=30, deadline=None)
@given(key=st.sampled_from(["llama-3.1-8b", "qwen2.5-14b", "mixtral-8x7b", "llama-3.1-70b"]),
       tp=st.sampled_from([1, 2, 4, 8]))
def test_shards_add_up(key, tp):
    """Every rank holds the same shard: tp x a rank's layer parameters = the model's layer
    parameters, plus the copies of KV heads replicated beyond kv (and the replicated norms)."""
    arch = load(key)
    share = gpu_share(arch, tp=tp)
    layer = sum(t.numel for t in arch.tensors if t.layers is not None)
    ranked = sum(t.numel for t in share.tensors if t.layers is not None)
    assert ranked * tp >= layer
    # norms and the MoE router are replicated on every rank (vLLM: ReplicatedLinear gate)
    norms = sum(t.numel for t in arch.tensors
                if t.layers is not None and t.role in ("norm", "attn_norm", "router"))
    kv_extra = 0
    if arch.num_kv_heads < tp:
        kv_extra = (tp - arch.num_kv_heads) * 2 * arch.head_dim * arch.hidden_size * arch.num_layers
    assert ranked * tp == layer + (tp - 1) * norms + kv_extra
