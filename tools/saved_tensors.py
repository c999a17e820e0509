"""Measure, on the CPU, what autograd saves per transformer block, to check model/activations.py.

Builds a tiny model of a given architecture with transformers, runs one forward pass with
labels under ``torch.autograd.graph.saved_tensors_hooks`` and adds up the distinct
storages that autograd keeps (parameters excluded).  The difference between an (L+1)-layer
and an L-layer model is what one block saves: the quantity ``activations.trace_block``
predicts.  No GPU is needed; the CUDA attention backend is not exercised (CPU SDPA keeps
q, k, v, output and logsumexp, as flash attention does).

usage: python tools/saved_tensors.py   (prints predicted vs traced bytes per family)
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Dict, Optional

TINY: Dict[str, Dict[str, Any]] = {
    "llama": dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=32, vocab_size=512),
    "mistral": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
                    vocab_size=512, sliding_window=None),
    "qwen2": dict(hidden_size=224, intermediate_size=608, num_attention_heads=7, num_key_value_heads=1,
                  vocab_size=512, tie_word_embeddings=True),
    "qwen3": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=64, vocab_size=512),
    "gemma": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1,
                  head_dim=64, vocab_size=512),
    "gemma2": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, vocab_size=512, sliding_window=4096, query_pre_attn_scalar=64),
    "gemma3_text": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=64, vocab_size=512, sliding_window=4096),
    "phi3": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
                 vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "olmoe": dict(hidden_size=256, intermediate_size=128, num_attention_heads=8, num_key_value_heads=8,
                  num_experts=8, num_experts_per_tok=2, vocab_size=512, pad_token_id=1, eos_token_id=2),
    "mixtral": dict(hidden_size=256, intermediate_size=384, num_attention_heads=8, num_key_value_heads=2,
                    num_local_experts=4, num_experts_per_tok=2, vocab_size=512),
    "qwen2_moe": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      shared_expert_intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
                      num_experts=4, num_experts_per_tok=2, vocab_size=512),
    "gpt2": dict(n_embd=256, n_head=8, vocab_size=512, n_positions=256, bos_token_id=0, eos_token_id=0,
                 attn_pdrop=0.0),  # CPU SDPA has no dropout kernel (it would fall back to math)
    "gpt_neox": dict(hidden_size=256, intermediate_size=1024, num_attention_heads=8, vocab_size=512,
                     bos_token_id=0, eos_token_id=0),
    "opt": dict(hidden_size=256, ffn_dim=1024, num_attention_heads=8, vocab_size=512, max_position_embeddings=256,
                word_embed_proj_dim=256, pad_token_id=1, bos_token_id=2, eos_token_id=2),
    "bloom": dict(hidden_size=256, n_head=8, vocab_size=512),
    "falcon": dict(hidden_size=256, num_attention_heads=8, vocab_size=512, bos_token_id=0, eos_token_id=0),
    "qwen3_moe": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=8,
                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=512, head_dim=32),
    "olmo2": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, vocab_size=512, pad_token_id=1,
                  eos_token_id=2),
    "deepseek_v2": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=8,
                        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=0,
                        kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32,
                        v_head_dim=32, vocab_size=512),
    # issue 11's families
    "gpt_oss": dict(hidden_size=256, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                    num_local_experts=4, num_experts_per_tok=2, vocab_size=512, sliding_window=8),
    # "<model_type>:<variant>": one kind of block of a mixed stack (every layer of the tiny model that kind)
    "llama4_text": dict(hidden_size=256, intermediate_size=128, intermediate_size_mlp=384, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=1,
                        vocab_size=512, attention_chunk_size=16),
    "glm4_moe": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                     first_k_dense_replace=0, vocab_size=512, attention_bias=True, use_qk_norm=True,
                     partial_rotary_factor=0.5),
    "lfm2": dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=2, vocab_size=512,
                 layer_types=["conv"] * 4, block_multiple_of=64),
    "lfm2:attention": dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=2,
                           vocab_size=512, layer_types=["full_attention"] * 4, block_multiple_of=64),
    "modernbert": dict(hidden_size=256, intermediate_size=384, num_attention_heads=8, vocab_size=512,
                       global_attn_every_n_layers=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                       sep_token_id=2),
    "llama4_text:nope_dense": dict(hidden_size=256, intermediate_size=128, intermediate_size_mlp=384,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                                   num_experts_per_tok=1, vocab_size=512, no_rope_layers=[0, 0, 0, 0],
                                   moe_layers=[]),
}


# encoder-decoders and encoders (issue 11): "<model_type>:<kind>" varies the layers of one
# stack (LAYER_KEY) and is compared with that kind's block of the mixed stack
TINY.update({
    "t5:encoder": dict(d_model=256, d_kv=32, d_ff=512, num_heads=8, vocab_size=512, num_decoder_layers=2,
                       feed_forward_proj="gated-gelu", dropout_rate=0.0, decoder_start_token_id=0),
    "t5:decoder": dict(d_model=256, d_kv=32, d_ff=512, num_heads=8, vocab_size=512, num_layers=2,
                       feed_forward_proj="gated-gelu", dropout_rate=0.0, decoder_start_token_id=0),
    "t5:decoder_v1": dict(d_model=256, d_kv=32, d_ff=1024, num_heads=8, vocab_size=512, num_layers=2,
                          feed_forward_proj="relu", dropout_rate=0.1, decoder_start_token_id=0),
    "bert": dict(hidden_size=256, intermediate_size=1024, num_attention_heads=8, vocab_size=512,
                 max_position_embeddings=64, attention_probs_dropout_prob=0.0),  # CPU SDPA has no dropout kernel
    "bert:dropout": dict(hidden_size=256, intermediate_size=1024, num_attention_heads=8, vocab_size=512,
                         max_position_embeddings=64),
})
_BART = dict(d_model=256, encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=1024,
             decoder_ffn_dim=1024, vocab_size=512, max_position_embeddings=64, encoder_layers=2, decoder_layers=2)
TINY.update({
    # CPU SDPA has no dropout kernel: attention_dropout 0 there (it would fall back to math)
    "bart:encoder": dict(_BART, attention_dropout=0.0),
    "bart:decoder": dict(_BART, attention_dropout=0.0),
    "bart:dropout": dict(_BART, attention_dropout=0.1, activation_dropout=0.1),   # eager: every dropout
})
#: the config field that holds the varied stack's layer count (default num_hidden_layers)
LAYER_KEY = {"gpt2": "n_layer", "t5:encoder": "num_layers", "t5:decoder": "num_decoder_layers",
             "t5:decoder_v1": "num_decoder_layers", "bart:encoder": "encoder_layers",
             "bart:decoder": "decoder_layers", "bart:dropout": "decoder_layers"}
#: the kind of block a variant checks (Architecture.layer_kinds), when it is one kind of a mixed stack
KIND = {"modernbert": "layer", "t5:encoder": "encoder", "t5:decoder": "decoder", "t5:decoder_v1": "decoder",
        "bart:encoder": "encoder", "bart:decoder": "decoder", "bart:dropout": "decoder"}

#: the transformers Auto class of each vramwidget task
AUTO_CLASS = {"causal_lm": "AutoModelForCausalLM", "image_text_to_text": "AutoModelForImageTextToText",
              "seq2seq_lm": "AutoModelForSeq2SeqLM", "masked_lm": "AutoModelForMaskedLM"}


def _auto_class(mt: str) -> Any:
    import transformers
    from vramwidget.model.families import REGISTRY, resolve_model_type
    fam = REGISTRY.get(resolve_model_type(mt))
    return getattr(transformers, AUTO_CLASS[fam.task if fam is not None else "causal_lm"])


#: per-layer lists in a config: cut to the tiny model's layer count
PER_LAYER_LISTS = ("no_rope_layers", "layer_types")


def _per_layer(kw: Dict[str, Any], n_layers: int) -> Dict[str, Any]:
    return {k: (v[:n_layers] if k in PER_LAYER_LISTS and isinstance(v, list) else v) for k, v in kw.items()}


def traced_block_bytes(model_type: str, *, precision: str = "bf16", method: str = "full",
                       attn_implementation: str = "sdpa", batch_size: int = 2, seq_len: int = 32,
                       layers: int = 2, overrides: Optional[Dict[str, Any]] = None,
                       lora: Optional[Dict[str, Any]] = None, alive_only: bool = False,
                       target_len: Optional[int] = None) -> Dict[str, float]:
    """Saved bytes of one block, traced with torch: {'per_layer': ..., 'total_L': ...}.

    ``lora``: extra LoraConfig keywords (``use_dora``, ``lora_dropout``, ``target_modules`` with
    ``lm_head``/``embed_tokens``, ``modules_to_save``); ``method="norms"`` trains only the norms.  ``alive_only``: count only
    what the graph still holds when the forward pass ends (DoRA builds and drops a side graph
    for its weight norm).  ``target_len``: an encoder-decoder's labels of that many tokens (the
    decoder reads them shifted right), beside ``seq_len`` input tokens; None: the input ids."""
    import torch
    from transformers import AutoConfig

    kw = dict(TINY[model_type])
    kw.update(overrides or {})
    mt = model_type.split(":")[0]

    def run(n_layers: int) -> float:
        key = LAYER_KEY.get(model_type, LAYER_KEY.get(mt, "num_hidden_layers"))
        cfg = AutoConfig.for_model(mt, **{**_per_layer(kw, n_layers), key: n_layers})
        cfg.use_cache = False
        torch.manual_seed(0)
        wd = torch.float32 if precision in ("fp32", "amp_bf16") else torch.bfloat16
        model = _auto_class(mt).from_config(cfg, dtype=wd, attn_implementation=attn_implementation)
        if method == "lora":
            import peft

            from vramwidget.model.architecture import from_config

            arch = from_config(cfg.to_dict())
            # the blocks' nn.Linear modules (what peft's "all-linear" selects): not the fused
            # 3-D expert parameters, which peft would wrap as parameters
            targets = sorted({t.module for t in arch.tensors if t.linear and not t.experts})
            lkw = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets)
            lkw.update(lora or {})
            model = peft.get_peft_model(model, peft.LoraConfig(**lkw))
        elif method == "norms":
            for name, p in model.named_parameters():
                p.requires_grad_("norm" in name)
        model.train()
        ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
        labels = ids if target_len is None else torch.randint(0, cfg.vocab_size, (batch_size, target_len))
        seen: Dict[int, int] = {}
        refs = []

        def pack(t):
            st = t.untyped_storage()
            seen.setdefault(st.data_ptr(), st.nbytes())
            if alive_only:
                refs.append((weakref.ref(t), st.data_ptr(), st.nbytes()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp_bf16"):
                out = model(input_ids=ids, labels=labels)
        if alive_only:
            seen = {ptr: n for r, ptr, n in refs if r() is not None}
        del out
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return float(sum(n for k, n in seen.items() if k not in params))

    a, b = run(layers), run(layers + 1)
    return {"per_layer": b - a, "total_L": a}


def predicted_block_bytes(model_type: str, *, precision: str = "bf16", method: str = "full",
                          attn_implementation: str = "sdpa", batch_size: int = 2, seq_len: int = 32,
                          overrides: Optional[Dict[str, Any]] = None, **setup: Any) -> float:
    """What vramwidget's model/activations.py says one steady block saves (CPU kernels)."""
    from transformers import AutoConfig

    from vramwidget.model.architecture import from_config
    from vramwidget.plan.params import param_storage
    from vramwidget.plan.profile import activations_at
    from vramwidget.training import TrainingSetup

    kw = dict(TINY[model_type])
    kw.update(overrides or {})
    mt = model_type.split(":")[0]
    cfg = AutoConfig.for_model(mt, **{**_per_layer(kw, 2), LAYER_KEY.get(model_type, LAYER_KEY.get(
        mt, "num_hidden_layers")): 2}).to_dict()
    arch = from_config(cfg)
    s = TrainingSetup.from_kwargs(method=method, precision=precision, attn_implementation=attn_implementation,
                                  batch_size=batch_size, seq_len=seq_len, lora_r=8, **setup)
    acts = activations_at(arch, s, param_storage(arch, s), cpu=True)
    kind = KIND.get(model_type)
    if kind:
        # the mixed stack's average block weighs each kind by its share c / n of the layers it
        # averages (its names say "NAME (KIND, c of n layers)"): one KIND block is its items x n / c
        import re

        total = 0.0
        for t in acts.per_layer:
            m = re.search(r"\(" + re.escape(kind) + r", (\d+) of (\d+) layers\)$", t.name)
            if m:
                total += t.nbytes * int(m.group(2)) / int(m.group(1))
        return total
    return acts.per_layer_bytes


def predicted_total_bytes(model_type: str, *, layers: int = 2, precision: str = "bf16", method: str = "full",
                          attn_implementation: str = "sdpa", batch_size: int = 2, seq_len: int = 32,
                          **setup: Any) -> float:
    """What vramwidget says an ``layers``-layer model saves in its blocks and around the head
    (not the loss): for differences between two setups that share the loss."""
    from transformers import AutoConfig

    from vramwidget.model.architecture import from_config
    from vramwidget.plan.params import param_storage
    from vramwidget.plan.profile import activations_at
    from vramwidget.training import TrainingSetup

    key = "n_layer" if model_type == "gpt2" else "num_hidden_layers"
    arch = from_config(AutoConfig.for_model(model_type, **{**TINY[model_type], key: layers}).to_dict())
    s = TrainingSetup.from_kwargs(method=method, precision=precision, attn_implementation=attn_implementation,
                                  batch_size=batch_size, seq_len=seq_len, lora_r=8, **setup)
    acts = activations_at(arch, s, param_storage(arch, s), cpu=True)
    return acts.layers_bytes + sum(n for _, n, _ in acts.head)


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    kinds = sys.argv[1:] or list(TINY)
    for mt in kinds:
        for prec, method, attn in (("bf16", "full", "sdpa"), ("bf16", "full", "eager"), ("fp32", "full", "sdpa"),
                                   ("fp32", "full", "eager"), ("bf16", "lora", "sdpa"), ("bf16", "lora", "eager")):
            try:
                t = traced_block_bytes(mt, precision=prec, method=method, attn_implementation=attn)["per_layer"]
                p = predicted_block_bytes(mt, precision=prec, method=method, attn_implementation=attn)
                print(f"{mt:12} {prec:9} {method:5} {attn:6} traced {t:10.0f} predicted {p:10.0f} "
                      f"{(p - t) / t * 100:+6.1f}%", flush=True)
            except Exception as e:  # noqa: BLE001 - a survey tool
                print(f"{mt:12} {prec:9} {method:5} {attn:6} error {type(e).__name__}: {str(e)[:120]}", flush=True)


#: vision towers of issue 11's VLMs: (tower model_type, tiny vision config, input builder name)
TINY_TOWERS: Dict[str, Dict[str, Any]] = {
    "siglip_vision_model": dict(hidden_size=128, intermediate_size=320, num_attention_heads=4, image_size=112,
                                patch_size=14, vision_use_head=False),
    "pixtral": dict(hidden_size=128, intermediate_size=320, num_attention_heads=4, head_dim=32, image_size=112,
                    patch_size=14),
}


def traced_tower_bytes(tower: str, *, precision: str = "bf16", attn_implementation: str = "sdpa",
                       images: int = 2, layers: int = 2) -> float:
    """Saved bytes of a whole ``layers``-layer vision tower (the tower alone on ``images``
    images at its configured resolution, every parameter training)."""
    import torch
    from transformers import AutoConfig, AutoModel

    cfg = AutoConfig.for_model(tower, **{**TINY_TOWERS[tower], "num_hidden_layers": layers})
    torch.manual_seed(0)
    wd = torch.float32 if precision == "fp32" else torch.bfloat16
    model = AutoModel.from_config(cfg, dtype=wd, attn_implementation=attn_implementation)
    model.train()
    px = torch.randn(images, 3, cfg.image_size, cfg.image_size, dtype=wd)
    extra = {"image_sizes": torch.tensor([[cfg.image_size, cfg.image_size]] * images)} if tower == "pixtral" else {}
    seen: Dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(pixel_values=px, **extra)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return float(sum(n for k, n in seen.items() if k not in params))


def traced_tower_block_bytes(tower: str, *, precision: str = "bf16", attn_implementation: str = "sdpa",
                             images: int = 2, layers: int = 2) -> float:
    """Saved bytes of one vision-tower block (a model of L+1 minus one of L layers)."""
    kw = dict(precision=precision, attn_implementation=attn_implementation, images=images)
    return traced_tower_bytes(tower, layers=layers + 1, **kw) - traced_tower_bytes(tower, layers=layers, **kw)


def _tiny_tower(tower: str, precision: str, attn_implementation: str):
    """The tiny tower's family, config dict, Architecture and full-training setup."""
    from transformers import AutoConfig

    from vramwidget.model.architecture import Architecture
    from vramwidget.model.families import family_for
    from vramwidget.training import TrainingSetup

    cfg = AutoConfig.for_model(tower, **{**TINY_TOWERS[tower], "num_hidden_layers": 2}).to_dict()
    fam = family_for(tower)
    arch = Architecture(name=tower, model_type=tower, config=cfg, **fam.params(cfg, tower))
    s = TrainingSetup.from_kwargs(method="full", precision=precision, attn_implementation=attn_implementation)
    return fam, cfg, arch, s


def predicted_tower_once_bytes(tower: str, *, precision: str = "bf16", attn_implementation: str = "sdpa",
                               images: int = 2) -> float:
    """What the tower family says the tower saves once for all its blocks (full training)."""
    fam, cfg, arch, s = _tiny_tower(tower, precision, attn_implementation)
    backend = "eager" if attn_implementation == "eager" else "flash"
    dtype = "float32" if precision == "fp32" else "bfloat16"
    return sum(n for _, n, _ in fam.tower_saved_once(arch, images, fam.patches(cfg), s, backend, dtype))


def predicted_tower_block_bytes(tower: str, *, precision: str = "bf16", attn_implementation: str = "sdpa",
                                images: int = 2) -> float:
    """What the tower family's block trace says one block saves (CPU kernels, full training)."""
    from vramwidget.model.activations import BlockContext, attention_backend, trace_block

    fam, cfg, arch, s = _tiny_tower(tower, precision, attn_implementation)
    patches = fam.patches(cfg)
    backend = attention_backend(arch, s, s.compute_dtype)
    if backend in ("math", "efficient"):
        backend = "flash"
    seqs, seq_len = fam.tower_attention_layout(images, patches, s)
    ctx = BlockContext(arch=arch, setup=s, T=images * patches, b=seqs, s=seq_len, c=s.compute_dtype,
                       resid=s.compute_dtype if not s.autocast else "float32",
                       norm_w_dtype="float32" if precision == "fp32" else s.weights_dtype, linear_trains=True,
                       norms_train=True, lora_modules=(), adapter_dtype="float32", attn_backend=backend,
                       quant_base=False, cpu=True)
    return trace_block(ctx, input_rg=True).total_bytes


#: Qwen2.5-VL's vision transformer (not an AutoModel of its own): a tiny tower on images of
#: QWEN_VL_SIDE x QWEN_VL_SIDE patches, 8 x 8-patch windows (window_size 112 px / patch 14 px)
QWEN_VL_TOWER = dict(hidden_size=128, num_heads=4, intermediate_size=320, out_hidden_size=256, window_size=112,
                     patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
QWEN_VL_SIDE = 16


def traced_qwen_vl_block_bytes(*, windowed: bool, precision: str = "bf16", attn_implementation: str = "sdpa",
                               images: int = 2, layers: int = 2) -> float:
    """Saved bytes of one Qwen2.5-VL vision block (L+1 minus L layers), every layer windowed
    (``fullatt_block_indexes=[]``) or every layer attending over its whole image."""
    import torch
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    def run(n: int) -> float:
        cfg = Qwen2_5_VLVisionConfig(depth=n, fullatt_block_indexes=[] if windowed else list(range(n)), **QWEN_VL_TOWER)
        torch.manual_seed(0)
        wd = torch.float32 if precision == "fp32" else torch.bfloat16
        model = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, dtype=wd,
                                                                       attn_implementation=attn_implementation)
        model.train()
        side = QWEN_VL_SIDE
        px = torch.randn(images * side * side, 3 * 2 * 14 * 14, dtype=wd)
        seen: Dict[int, int] = {}

        def pack(t):
            st = t.untyped_storage()
            seen.setdefault(st.data_ptr(), st.nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(px, grid_thw=torch.tensor([[1, side, side]] * images))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return float(sum(nb for k, nb in seen.items() if k not in params))

    return run(layers + 1) - run(layers)


def predicted_qwen_vl_block_bytes(*, windowed: bool, precision: str = "bf16", attn_implementation: str = "sdpa",
                                  images: int = 2) -> float:
    """What the Qwen2.5-VL tower family says one block of that layout saves (CPU kernels)."""
    from vramwidget.model.activations import BlockContext, trace_block
    from vramwidget.model.architecture import Architecture
    from vramwidget.model.families import family_for
    from vramwidget.training import TrainingSetup

    mt = "qwen2_5_vl_vision"
    cfg = dict(QWEN_VL_TOWER, depth=1, fullatt_block_indexes=[] if windowed else [0])
    fam = family_for(mt)
    arch = Architecture(name=mt, model_type=mt, config=cfg, **fam.params(cfg, mt))
    s = TrainingSetup.from_kwargs(method="full", precision=precision, attn_implementation=attn_implementation)
    patches = QWEN_VL_SIDE * QWEN_VL_SIDE
    ((seqs, seq_len), _), = fam.tower_layer_layouts(arch, images, patches, s)
    ctx = BlockContext(arch=arch, setup=s, T=images * patches, b=seqs, s=seq_len, c=s.compute_dtype,
                       resid=s.compute_dtype, norm_w_dtype="float32" if precision == "fp32" else s.weights_dtype,
                       linear_trains=True, norms_train=True, lora_modules=(), adapter_dtype="float32",
                       attn_backend="eager" if attn_implementation == "eager" else "flash", quant_base=False, cpu=True)
    return trace_block(ctx, input_rg=True).total_bytes
