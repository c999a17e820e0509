"""Vision towers of vision-language models, as families of their own (not causal LMs: they
are registered as towers, built from a VLM's ``vision_config``).

Each declares its parameters (under the VLM's prefix) and one encoder block's forward over
the patches of one image (attention stays within an image: b = images, s = patches, except
where a tower packs its images into one masked sequence, see ``tower_attention_layout``):

* SigLIP (Gemma 3; transformers ``models/siglip/modeling_siglip.py``): pre-LayerNorm
  blocks with biased q/k/v/out_proj and fc1/fc2 with a tanh GELU; learned positions.
* Pixtral (Mistral 3; ``models/pixtral/modeling_pixtral.py``): RMSNorm blocks with 2D RoPE,
  q/k/v/o and a SwiGLU feed-forward, no biases.
* Qwen2.5-VL's vision transformer (``models/qwen2_5_vl/modeling_qwen2_5_vl.py``): RMSNorm
  blocks with a fused biased ``qkv``, 2D RoPE, ``proj`` and a biased SwiGLU.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

from ...units import DTYPE_BYTES
from .base import Family, register_tower
from .blocks import ParamBuilder, config_get, required_count, gated_mlp, linear, rms_norm, rotary, sdpa_core
from .gpt2 import GPT2
from .llama import Llama


def _tower_dims(cfg: Mapping[str, Any]) -> Tuple[int, int, int, int, int, int]:
    """A ViT tower's hidden size, layers, heads, MLP size, patch size and input channels
    (SigLIP's and Pixtral's config names)."""
    return (required_count(cfg, "vision hidden size", "hidden_size"), required_count(cfg, "vision layers", "num_hidden_layers"),
            required_count(cfg, "vision heads", "num_attention_heads"), required_count(cfg, "vision MLP size", "intermediate_size"),
            required_count(cfg, "patch size", "patch_size"), int(config_get(cfg, "num_channels", default=3) or 3))


def _vision_info(h: int, L: int, a: int, i: int, b: ParamBuilder, mlp_kind: str, norm_kind: str) -> Dict[str, Any]:
    return dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a, head_dim=h // a, intermediate_size=i,
                vocab_size=0, tie_word_embeddings=False, tensors=b.tensors, mlp_kind=mlp_kind, norm_kind=norm_kind)


@register_tower
class SiglipVision(GPT2):
    model_types = ("siglip_vision_model",)
    names = ("q_proj", "out_proj", "fc1", "fc2")
    softmax_fp32 = True
    embd_dropout = False
    prefix = "model.vision_tower."

    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        h, L, a, i, p, ch = _tower_dims(cfg)
        size = required_count(cfg, "image size", "image_size")
        P = self.prefix
        b = ParamBuilder(L)
        b.top(P + "embeddings.patch_embedding.weight", (h, ch, p, p), "embedding", "patch_embedding")
        b.top(P + "embeddings.patch_embedding.bias", (h,), "embedding", "patch_embedding")
        b.top(P + "embeddings.position_embedding.weight", ((size // p) ** 2, h), "position_embedding",
              "position_embedding")
        L_ = P + "encoder.layers.{i}."
        b.norm(L_ + "layer_norm1", h, bias=True)
        for nm, role in (("k_proj", "attn_k"), ("v_proj", "attn_v"), ("q_proj", "attn_q"), ("out_proj", "attn_o")):
            b.linear(L_ + "self_attn." + nm, h, h, role, bias=True)
        b.norm(L_ + "layer_norm2", h, bias=True)
        b.linear(L_ + "mlp.fc1", i, h, "mlp_up", bias=True)
        b.linear(L_ + "mlp.fc2", h, i, "mlp_down", bias=True)
        b.norm(P + "post_layernorm", h, bias=True, per_layer=False)
        if config_get(cfg, "vision_use_head", default=True):
            b.top(P + "head.probe", (1, 1, h), "attn_q", "head")
            b.top(P + "head.attention.in_proj_weight", (3 * h, h), "attn_qkv", "attention")
            b.top(P + "head.attention.in_proj_bias", (3 * h,), "attn_qkv", "attention")
            b.top(P + "head.attention.out_proj.weight", (h, h), "attn_o", "out_proj")
            b.top(P + "head.attention.out_proj.bias", (h,), "attn_o", "out_proj")
            b.top(P + "head.layernorm.weight", (h,), "norm", "layernorm")
            b.top(P + "head.layernorm.bias", (h,), "norm", "layernorm")
            b.top(P + "head.mlp.fc1.weight", (i, h), "mlp_up", "fc1")
            b.top(P + "head.mlp.fc1.bias", (i,), "mlp_up", "fc1")
            b.top(P + "head.mlp.fc2.weight", (h, i), "mlp_down", "fc2")
            b.top(P + "head.mlp.fc2.bias", (h,), "mlp_down", "fc2")
        return _vision_info(h, L, a, i, b, "plain", "layernorm")

    def patches(self, cfg: Mapping[str, Any]) -> int:
        """Patches of one image at the tower's fixed resolution."""
        return (int(cfg["image_size"]) // int(cfg["patch_size"])) ** 2

    def resid_dropout(self, cfg: Mapping[str, Any]) -> float:
        return 0.0

    def qkv(self, tr: Any, ctx: Any, n1: Any) -> Tuple[Any, Any, Any]:
        h = ctx.arch.hidden_size
        return tuple(linear(tr, ctx, n1, nm, h, nm + " output", "attention") for nm in ("q_proj", "k_proj", "v_proj"))

    def composite_gelu(self, arch: Any) -> bool:
        return False


@register_tower
class PixtralVision(Llama):
    model_types = ("pixtral",)
    prefix = "model.vision_tower."

    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        h, L, a, i, p, ch = _tower_dims(cfg)
        P = self.prefix
        b = ParamBuilder(L)
        b.top(P + "patch_conv.weight", (h, ch, p, p), "embedding", "patch_conv")
        b.top(P + "ln_pre.weight", (h,), "embedding_norm", "ln_pre")
        L_ = P + "transformer.layers.{i}."
        b.norm(L_ + "attention_norm", h)
        for nm, role in (("gate_proj", "mlp_gate"), ("up_proj", "mlp_up")):
            b.linear(L_ + "feed_forward." + nm, i, h, role)
        b.linear(L_ + "feed_forward.down_proj", h, i, "mlp_down")
        for nm, role in (("k_proj", "attn_k"), ("v_proj", "attn_v"), ("q_proj", "attn_q"), ("o_proj", "attn_o")):
            b.linear(L_ + "attention." + nm, h, h, role)
        b.norm(L_ + "ffn_norm", h)
        info = _vision_info(h, L, a, i, b, "gated", "rms")
        info["head_dim"] = int(config_get(cfg, "head_dim", default=h // a) or h // a)
        return info

    def patches(self, cfg: Mapping[str, Any]) -> int:
        """Patches of one image at the tower's largest resolution (``image_size``)."""
        return (int(cfg["image_size"]) // int(cfg["patch_size"])) ** 2

    # PixtralVisionModel.forward (models/pixtral/modeling_pixtral.py) flattens every image of the
    # batch into ONE sequence (``torch.cat(...).unsqueeze(0)``) and keeps images apart with a
    # block-diagonal mask (``generate_block_attention_mask``: a full N x N tensor in the hidden
    # states' dtype); only flash_attention_2 runs the images as varlen sequences (cu_seqlens).
    def tower_attention_layout(self, images: int, patches: int, setup: Any) -> Tuple[int, int]:
        if setup.attn_implementation == "flash_attention_2":
            return images, patches
        return 1, images * patches

    def tower_saved_once(self, arch: Any, images: int, patches: int, setup: Any, backend: str, dtype: str):
        """The block-diagonal mask: SDPA saves it for its backward (the memory-efficient kernel on
        CUDA, as flash attention takes no mask); a checkpointed layer keeps it as an input.  Under
        eager attention without checkpointing it is only added to the scores (transient)."""
        n, B = images * patches, DTYPE_BYTES[dtype]
        # PixtralRotaryEmbedding returns cos and sin (N x head_dim, in the hidden states' dtype)
        # that every layer's apply_rotary_pos_emb multiplies, so autograd keeps them once
        d = arch.head_dim
        out = [("pixtral 2D RoPE cos and sin", float(2 * n * d * B), f"2 x images x patches x head_dim x {B} B")]
        if setup.attn_implementation == "flash_attention_2":
            return out
        if backend == "eager" and setup.gradient_checkpointing == "none":
            return out
        return out + [("pixtral block-diagonal attention mask", float(n * n * B),
                       f"(images x patches)^2 x {B} B ({n}^2)")]


@register_tower
class Qwen25Vision(Family):
    model_types = ("qwen2_5_vl_vision",)
    prefix = "model.visual."

    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        h = required_count(cfg, "vision hidden size", "hidden_size")
        L = required_count(cfg, "vision depth", "depth", "num_hidden_layers")
        a = required_count(cfg, "vision heads", "num_heads")
        i = required_count(cfg, "vision MLP size", "intermediate_size")
        p = required_count(cfg, "patch size", "patch_size")
        tp = int(config_get(cfg, "temporal_patch_size", default=2) or 2)
        m = int(config_get(cfg, "spatial_merge_size", default=2) or 2)
        out = required_count(cfg, "vision output size", "out_hidden_size")
        ch = int(config_get(cfg, "in_channels", default=3) or 3)
        P = self.prefix
        b = ParamBuilder(L)
        b.top(P + "patch_embed.proj.weight", (h, ch, tp, p, p), "embedding", "proj")
        L_ = P + "blocks.{i}."
        b.norm(L_ + "norm1", h)
        b.norm(L_ + "norm2", h)
        b.linear(L_ + "attn.qkv", 3 * h, h, "attn_qkv", bias=True)
        b.linear(L_ + "attn.proj", h, h, "attn_o", bias=True)
        b.linear(L_ + "mlp.gate_proj", i, h, "mlp_gate", bias=True)
        b.linear(L_ + "mlp.up_proj", i, h, "mlp_up", bias=True)
        b.linear(L_ + "mlp.down_proj", h, i, "mlp_down", bias=True)
        w = h * m * m
        b.top(P + "merger.ln_q.weight", (h,), "norm", "ln_q")
        b.top(P + "merger.mlp.0.weight", (w, w), "mlp_up", "0")
        b.top(P + "merger.mlp.0.bias", (w,), "mlp_up", "0")
        b.top(P + "merger.mlp.2.weight", (out, w), "mlp_down", "2")
        b.top(P + "merger.mlp.2.bias", (out,), "mlp_down", "2")
        return _vision_info(h, L, a, i, b, "gated", "rms")

    def tower_layer_layouts(self, arch: Any, images: int, patches: int, setup: Any):
        """Qwen2_5_VisionTransformerPretrainedModel.forward: the ``fullatt_block_indexes`` layers
        attend within each image (cu_seqlens), the others within windows of ``window_size``
        pixels (``cu_window_seqlens``: (window_size / patch_size)^2 patches each; an image whose
        side is no multiple of it has smaller edge windows, counted here as full ones)."""
        cfg = arch.config
        L = arch.num_layers
        full = [j for j in (cfg.get("fullatt_block_indexes") or [7, 15, 23, 31]) if 0 <= int(j) < L]
        side = max(1, int(config_get(cfg, "window_size", default=112) or 112) // int(cfg.get("patch_size") or 14))
        per_window = min(patches, side * side)
        windows = images * max(1, -(-patches // per_window))
        out = [((images, patches), len(full)), ((windows, per_window), L - len(full))]
        if 0 not in full:   # the first layer's layout first (its input may need no gradient)
            out.reverse()
        return [o for o in out if o[1]]

    def patches(self, cfg: Mapping[str, Any]) -> int:
        """Dynamic resolution: a 448 x 448 image (32 x 32 patches of 14 px) unless
        ``image_patches`` says otherwise."""
        return 1024

    def block(self, tr: Any, ctx: Any, x: Any) -> Any:
        arch, T = ctx.arch, ctx.T
        h, a, d, i = arch.hidden_size, arch.num_heads, arch.head_dim, arch.intermediate_size
        n1 = rms_norm(tr, ctx, x, "norm1", h)
        qkv = linear(tr, ctx, n1, "qkv", 3 * h, "qkv output", "attention")
        q = tr.new("q", T * h, qkv.dtype, qkv.rg, "T x h", "attention")
        k = tr.new("k", T * h, qkv.dtype, qkv.rg, "T x h", "attention")
        qr, kr = rotary(tr, ctx, q, k, T * h, T * h)
        # Qwen2_5_VLVisionAttention: v is a view of the fused qkv output (``unbind``), so what the
        # attention keeps of v keeps the whole qkv output alive; SDPA and eager run one call per
        # chunk of cu_seqlens (an image, or a window) and ``torch.cat`` the chunks' outputs, a
        # new tensor that ``proj`` keeps beside the per-chunk outputs the kernel saved
        o_chunks = sdpa_core(tr, ctx, qr, kr, qkv, d)
        o_in = tr.new("attention output (the chunks concatenated)", T * h, o_chunks.dtype, o_chunks.rg, "T x h",
                      "attention")
        o = linear(tr, ctx, o_in, "proj", h, "proj output", "attention", in_features=h)
        x1 = tr.residual_stream(tr.new("residual after attention", x.numel, x.dtype, True, "T x h", "norms"))
        n2 = rms_norm(tr, ctx, x1, "norm2", h)
        gated_mlp(tr, ctx, n2, i)
        return tr.new("block output", x.numel, x.dtype, True, "T x h", "norms")

    def final_norm(self, tr: Any, ctx: Any, x: Any) -> Any:
        return x

    def inference_mlp(self, arch: Any, T: int, c: float):
        return []


