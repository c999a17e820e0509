"""BART: a post-LayerNorm encoder-decoder, counted as ``BartForConditionalGeneration``.

Parameters (transformers ``models/bart/modeling_bart.py``): ``model.shared`` (the token
embedding; both stacks' ``embed_tokens`` and ``lm_head`` are the same tensor); per stack
``embed_positions`` (learned, ``max_position_embeddings + 2`` rows: BartLearnedPositionalEmbedding
offsets positions by 2) and ``layernorm_embedding``; per encoder layer
``self_attn.{k,v,q,out}_proj`` and ``self_attn_layer_norm``, ``fc1``, ``fc2`` and
``final_layer_norm`` (every Linear and LayerNorm with a bias); per decoder layer the same plus
``encoder_attn.{k,v,q,out}_proj`` and ``encoder_attn_layer_norm``.  ``final_logits_bias`` is
a buffer, not a parameter.

Block (``BartEncoderLayer`` / ``BartDecoderLayer``): attention (q, k, v; the scaling is the
attention call's, no scaled copy of q; dropout ``attention_dropout``) -> ``out_proj`` ->
dropout -> LayerNorm(residual + .): post-LN, as BERT; the decoder adds cross-attention over
the encoder output (its k_proj and v_proj read the one encoder-output tensor) the same way;
then ``fc1`` -> GELU -> dropout (``activation_dropout``) -> ``fc2`` -> dropout ->
LayerNorm(residual + .).  Each stack's input is ``embed_tokens(ids) * embed_scale +
embed_positions`` -> ``layernorm_embedding`` -> dropout.

The stacks are one mixed stack of kinds "encoder" and "decoder"; the encoder reads
``seq_len`` tokens, the decoder ``target_len`` (``labels`` shifted right become the decoder
input, ``shift_tokens_right`` in ``BartForConditionalGeneration.forward``; default: as many as
the encoder): b x heads x t x t self-attention and b x heads x t x s cross-attention scores.  The loss is ``CrossEntropyLoss`` on the logits as they are (no fp32 upcast).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from .base import Family, register
from .blocks import ParamBuilder, config_get, required_count, dropout, layer_norm, linear, sdpa_core
from .gpt2 import GPT2
from .t5 import PrefixedTrace, shift_layers
from ...errors import VramError


@register
class Bart(Family):
    model_types = ("bart",)
    task = "seq2seq_lm"
    tasks = ("seq2seq_lm",)
    encoder_decoder = True
    #: the decoder stack reads the target tokens (TrainingSetup.target_len)
    target_kinds = ("decoder",)
    mlp_kind = "plain"
    norm_kind = "layernorm"
    rotary = False
    gguf_arch = "bart"
    default_lora_targets = ("q_proj", "v_proj")   # peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["bart"]
    #: CrossEntropyLoss on the 16-bit logits (BartForConditionalGeneration.forward)
    loss_upcast = False

    # -- parameters ---------------------------------------------------------------------
    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        # BartConfig's defaults (bart-large's shape) and attribute_map (hidden_size -> d_model,
        # num_attention_heads -> encoder_attention_heads)
        h = required_count(cfg, "model width", "d_model", "hidden_size", default=1024)
        Le = required_count(cfg, "encoder layers", "encoder_layers", default=12)
        Ld = required_count(cfg, "decoder layers", "decoder_layers", default=12)
        ae = required_count(cfg, "encoder attention heads", "encoder_attention_heads", default=16)
        ad = required_count(cfg, "decoder attention heads", "decoder_attention_heads", default=16)
        ie = required_count(cfg, "encoder MLP width", "encoder_ffn_dim", default=4096)
        idd = required_count(cfg, "decoder MLP width", "decoder_ffn_dim", default=4096)
        V = required_count(cfg, "vocabulary size", "vocab_size", default=50265)
        npos = required_count(cfg, "positions", "max_position_embeddings", default=1024)
        if ae != ad or ie != idd:
            raise VramError(f"config: BART with different encoder and decoder heads ({ae}, {ad}) or MLP widths "
                            f"({ie}, {idd}) is not modelled", field="decoder_attention_heads")
        if h % ae:
            raise VramError(f"config: encoder_attention_heads ({ae}) does not divide d_model ({h})",
                            field="encoder_attention_heads")
        a, i = ae, ie
        L = Le + Ld
        b = ParamBuilder(L)
        b.top("model.shared.weight", (V, h), "embedding", "shared")

        def stack(S: str, first: int, n: int, cross: bool) -> None:
            P = f"model.{S}."
            b.top(P + "embed_positions.weight", (npos + 2, h), "position_embedding", "embed_positions")
            b.norm(P + "layernorm_embedding", h, bias=True, per_layer=False, role="embedding_norm")
            sub = ParamBuilder(n)
            Ly = P + "layers.{i}."
            attns = [("self_attn", "self_attn_layer_norm")]
            if cross:
                attns.append(("encoder_attn", "encoder_attn_layer_norm"))
            for att, ln in attns:
                for nm, role in (("k_proj", "attn_k"), ("v_proj", "attn_v"), ("q_proj", "attn_q")):
                    sub.linear(Ly + att + "." + nm, h, h, role, bias=True)
                sub.linear(Ly + att + ".out_proj", h, h, "attn_o", bias=True)
                sub.norm(Ly + ln, h, bias=True)
            sub.linear(Ly + "fc1", i, h, "mlp_up", bias=True)
            sub.linear(Ly + "fc2", h, i, "mlp_down", bias=True)
            sub.norm(Ly + "final_layer_norm", h, bias=True)
            for t in sub.tensors:
                lo, hi = t.layers if t.layers else (0, 0)
                b.tensors.append(shift_layers(t, first + lo, first + hi))

        stack("encoder", 0, Le, False)
        stack("decoder", Le, Ld, True)
        # generate()'s EncoderDecoderCache: each decoder layer's self-attention keys/values and the
        # cross-attention keys/values of the encoder output (2 x decoder layers' worth per token)
        return dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a, head_dim=h // a, intermediate_size=i,
                    vocab_size=V, tie_word_embeddings=True, tensors=b.tensors, mlp_kind=self.mlp_kind,
                    norm_kind=self.norm_kind, layer_kinds=[("encoder", Le), ("decoder", Ld)],
                    kv_cache_layers=2 * Ld, task=self.task)

    def notes(self, arch: Any) -> List[str]:
        return ["BART: the decoder reads as many tokens as the encoder unless target_len says otherwise (then the "
                "decoder, its cross-attention queries, the head and the loss read batch x target_len tokens); "
                "lm_head is tied to the shared embedding",
                "BART inference: the KV cache is each decoder layer's self-attention keys/values plus the "
                "cross-attention keys/values of the encoder output (2 x decoder_layers layers' worth per token)"]

    def reads_encoder(self, tensor: Any) -> bool:
        """``encoder_attn.k_proj`` and ``.v_proj`` project the encoder output (key_value_states)."""
        return ".encoder_attn.k_proj." in tensor.name or ".encoder_attn.v_proj." in tensor.name

    # -- training trace -----------------------------------------------------------------
    def p(self, cfg: Mapping[str, Any], name: str) -> float:
        """A dropout probability of the config (BartConfig's default 0.1 for ``dropout``, 0.0 for
        ``attention_dropout`` and ``activation_dropout``)."""
        return float(config_get(cfg, name, default=0.1 if name == "dropout" else 0.0) or 0.0)

    def act_name(self, cfg: Mapping[str, Any]) -> str:
        """``activation_function`` (gelu: the erf kernel)."""
        return str(cfg.get("activation_function") or "gelu")

    def composite_gelu(self, arch: Any) -> bool:
        """The activation is a Python composite GELU (``gelu_new``), not the erf kernel."""
        return self.act_name(arch.config) in ("gelu_new", "gelu_fast")

    def attention(self, tr: Any, ctx: Any, x: Any, kv_in: Any, prefix: str, cross: bool) -> Any:
        """Self- or cross-attention, its output dropout, the residual sum and the post-LN."""
        arch = ctx.arch
        h, d = arch.hidden_size, arch.head_dim
        cfg = arch.config
        q = linear(tr, ctx, x, "q_proj", h, prefix + "q output", "attention")
        if cross:
            # the encoder output is one tensor: every decoder layer's k_proj and v_proj keep that
            # same storage as their input (counted once, in final_norm)
            # over the encoder's tokens (b x s_enc): BartAttention's key_value_states
            Tk = ctx.b * ctx.src_s
            k = linear(tr, ctx, kv_in, "k_proj", h, prefix + "k output", "attention", trains=False, tokens=Tk)
            v = linear(tr, ctx, kv_in, "v_proj", h, prefix + "v output", "attention", trains=False, tokens=Tk)
            if ctx.linear_trains:
                k.rg = v.rg = True
        else:
            k = linear(tr, ctx, x, "k_proj", h, prefix + "k output", "attention")
            v = linear(tr, ctx, x, "v_proj", h, prefix + "v output", "attention")
        names = ("q cast", "k cast", "v cast", "softmax output", "attention probabilities",
                 "attention dropout mask", "attention probabilities after dropout", "attention output",
                 "attention logsumexp", "q", "k", "v")
        sub = PrefixedTrace(tr, prefix, names)
        # cross-attention scores are b x heads x t x s_enc (BartAttention.forward in transformers
        # models/bart/modeling_bart.py: queries from the decoder, keys from the encoder output)
        o_in = sdpa_core(sub, ctx, q, k, v, d, dropout_p=self.p(cfg, "attention_dropout"), softmax_fp32=False,
                         kv_len=ctx.src_s if cross else None)
        o = linear(tr, ctx, o_in, "out_proj", h, prefix + "out_proj output", "attention", in_features=h)
        o = dropout(tr, o, self.p(cfg, "dropout"), prefix + "output", ctx.cpu)
        s = tr.new(prefix + "residual sum", x.numel, o.dtype, True, "T x h", "norms")
        # post-LN: the normalised sum is the residual stream the next sub-layer adds to
        return tr.residual_stream(layer_norm(tr, ctx, s, prefix + "layer_norm", h))

    def block(self, tr: Any, ctx: Any, x: Any) -> Any:
        arch = ctx.arch
        h, i = arch.hidden_size, arch.intermediate_size
        cfg = arch.config
        x1 = self.attention(tr, ctx, x, x, "self-attention ", False)
        if ctx.kind == "decoder":
            enc = tr.new("encoder output", ctx.b * ctx.src_s * h, x1.dtype, True, "b x s x h", "attention")
            x1 = self.attention(tr, ctx, x1, enc, "cross-attention ", True)
        f = linear(tr, ctx, x1, "fc1", i, "fc1 output", "mlp")
        act = GPT2.activation(self, tr, ctx, f, i)
        act = dropout(tr, act, self.p(cfg, "activation_dropout"), "mlp hidden", ctx.cpu)
        m = linear(tr, ctx, act, "fc2", h, "fc2 output", "mlp", in_features=i)
        m = dropout(tr, m, self.p(cfg, "dropout"), "mlp output", ctx.cpu)
        s = tr.new("mlp residual sum", x.numel, m.dtype, True, "T x h", "norms")
        return layer_norm(tr, ctx, s, "final_layer_norm", h)

    def final_norm(self, tr: Any, ctx: Any, x: Any) -> Any:
        """No norm before the head (post-LN blocks end normalised); around the stacks: the
        encoder output, kept once by every decoder layer's cross-attention k_proj and v_proj when
        they train, and (when the embeddings train) each stack's embedding sum ->
        layernorm_embedding -> dropout."""
        arch = ctx.arch
        h = arch.hidden_size
        if ctx.linear_trains:
            # the encoder side reads b x s_enc tokens, the decoder side (x) the b x t target tokens
            enc_numel = ctx.b * ctx.src_s * h
            ne = tr.new("encoder output (kept by every cross-attention k_proj and v_proj)", enc_numel, x.dtype, True,
                        "b x s x h", "attention")
            tr.save(ne)
            for S in ("encoder", "decoder"):
                e = tr.new(f"{S} embeddings sum", enc_numel if S == "encoder" else x.numel,
                           ctx.c if ctx.setup.autocast else x.dtype, True,
                           "b x s x h" if S == "encoder" else "b x t x h", "embedding")
                en = layer_norm(tr, ctx, e, f"{S} layernorm_embedding", h, group="embedding")
                dropout(tr, en, self.p(arch.config, "dropout"), f"{S} input embeddings", ctx.cpu)
        return x

    # -- inference ----------------------------------------------------------------------
    def inference_mlp(self, arch: Any, T: int, c: float) -> List[Tuple[str, float, str]]:
        i = arch.intermediate_size
        return [("fc1 output + activation", 2 * T * i * c, "2 x T x i")]
