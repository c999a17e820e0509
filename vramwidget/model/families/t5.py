"""T5 (and Flan-T5, mT5, UMT5's layout): an encoder-decoder with relative position biases.

Parameters (transformers ``models/t5/modeling_t5.py``, ``T5ForConditionalGeneration``):
``shared`` (the token embedding both stacks read); per encoder layer
``layer.0.SelfAttention.{q,k,v,o}`` (no biases, inner size ``num_heads x d_kv``) and
``layer.0.layer_norm``, ``layer.1.DenseReluDense.{wi | wi_0, wi_1}, wo`` and
``layer.1.layer_norm``; the first layer of each stack also holds
``relative_attention_bias`` (buckets x heads, an ``nn.Embedding``); per decoder layer the same
plus ``layer.1.EncDecAttention.{q,k,v,o}`` and its norm (the MLP is ``layer.2``); each stack
ends in ``final_layer_norm``.  ``lm_head`` is always tied to ``shared`` in transformers 5:
``T5Config.__post_init__`` reads ``tie_word_embeddings`` only to set
``scale_decoder_outputs`` (T5 v1.0 scales the decoder output by d_model^-0.5, v1.1 / Flan-T5
do not) and forces ``tie_word_embeddings = True``.  ``task="encoder"`` counts
``T5EncoderModel`` (``shared`` + the encoder).

Block (``T5Block``): T5LayerNorm (RMS without mean: ``x * rsqrt(mean(x.float()**2))``,
which keeps the fp32 copy for ``pow``, ``rsqrt`` and the original x for the product, then
casts back to the weight's 16-bit dtype) -> q, k, v -> attention with the position bias
added to the scores (no 1/sqrt(d) scaling, softmax in the compute dtype) -> o -> dropout ->
residual; the decoder adds cross-attention over the encoder output (k and v projections of
the one encoder-output tensor, which every decoder layer's k and v keep: one storage) and
the MLP (``wi`` + ReLU, or ``act(wi_0) * wi_1`` with ``gated-gelu`` = the tanh-composite
``gelu_new``) -> dropout -> ``wo`` -> dropout -> residual.  The position bias is computed
once per stack (in its first layer) and passed to the others.

The stacks are one mixed stack of kinds "encoder" (``num_layers``) and "decoder"
(``num_decoder_layers``); the encoder reads ``seq_len`` tokens, the decoder ``target_len``
(``T5ForConditionalGeneration.forward``: ``decoder_input_ids = self._shift_right(labels)``;
default: as many as the encoder): its self-attention scores are b x heads x t x t, its
cross-attention's b x heads x t x s (``T5Attention.forward``: the position bias is
(1, heads, query_length, key_length)), its k and v projections read the b x s encoder output.  The loss is ``CrossEntropyLoss`` on the logits as they
are (no fp32 upcast, unlike ``ForCausalLMLoss``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Mapping, Tuple

from .base import Family, register
from .blocks import F32, ParamBuilder, required_count, dropout, linear, residual, rms_norm, sdpa_core
from .gpt2 import GPT2
from ...errors import VramError


@register
class T5(Family):
    model_types = ("t5", "mt5")
    task = "seq2seq_lm"
    tasks = ("seq2seq_lm", "encoder")
    encoder_decoder = True
    #: the decoder stack reads the target tokens (TrainingSetup.target_len)
    target_kinds = ("decoder",)
    mlp_kind = "plain"
    norm_kind = "rms"
    rotary = False
    gguf_arch = "t5"
    default_lora_targets = ("q", "v")      # peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["t5"]
    #: CrossEntropyLoss on the 16-bit logits (T5ForConditionalGeneration.forward)
    loss_upcast = False
    #: every layer has its own relative_attention_bias (UMT5); False: the first layer of each stack
    bias_every_layer = False

    # -- parameters ---------------------------------------------------------------------
    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        return self.params_for_task(cfg, mt, self.task)

    def gated(self, cfg: Mapping[str, Any]) -> bool:
        """The MLP is gated (``feed_forward_proj`` gated-*)."""
        proj = str(cfg.get("feed_forward_proj") or "relu")
        return proj.split("-")[0] == "gated"

    def act_name(self, cfg: Mapping[str, Any]) -> str:
        """``dense_act_fn`` as T5Config derives it (``gated-gelu`` means gelu_new)."""
        proj = str(cfg.get("feed_forward_proj") or "relu")
        return "gelu_new" if proj == "gated-gelu" else proj.split("-")[-1]

    def composite_gelu(self, arch: Any) -> bool:
        """The activation is the tanh-composite GELU."""
        return self.act_name(arch.config) in ("gelu_new", "gelu_fast")

    def params_for_task(self, cfg: Mapping[str, Any], mt: str, task: str) -> Dict[str, Any]:
        # T5Config's attribute_map: hidden_size -> d_model, num_attention_heads -> num_heads,
        # num_hidden_layers -> num_layers, head_dim -> d_kv; defaults are T5Config's
        h = required_count(cfg, "model width", "d_model", "hidden_size", default=512)
        d = required_count(cfg, "key/value width per head", "d_kv", "head_dim", default=64)
        i = required_count(cfg, "MLP width", "d_ff", default=2048)
        Le = required_count(cfg, "encoder layers", "num_layers", "num_hidden_layers", default=6)
        Ld = required_count(cfg, "decoder layers", "num_decoder_layers", default=Le)
        a = required_count(cfg, "attention heads", "num_heads", "num_attention_heads", default=8)
        V = required_count(cfg, "vocabulary size", "vocab_size", default=32128)
        buckets = required_count(cfg, "relative position buckets", "relative_attention_num_buckets", default=32)
        proj = str(cfg.get("feed_forward_proj") or "relu")
        parts = proj.split("-")
        if (len(parts) > 1 and parts[0] != "gated") or len(parts) > 2:
            raise VramError(f"config: feed_forward_proj must be 'gated-ACT' or 'ACT', got {proj!r}",
                            field="feed_forward_proj")
        gated = self.gated(cfg)
        decoder = task == "seq2seq_lm"
        L = Le + (Ld if decoder else 0)
        b = ParamBuilder(L)
        b.top("shared.weight", (V, h), "embedding", "shared")

        def stack(S: str, first: int, n: int, cross: bool) -> None:
            sub = ParamBuilder(n)
            P = S + ".block.{i}.layer."
            for nm, role in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")):
                sub.linear(P + "0.SelfAttention." + nm, a * d, h, role)
            sub.linear(P + "0.SelfAttention.o", h, a * d, "attn_o")
            sub.layer(P + "0.SelfAttention.relative_attention_bias.weight", (buckets, a), "position_embedding",
                      repeat=None if self.bias_every_layer else 1)
            sub.norm(P + "0.layer_norm", h)
            ff = "1"
            if cross:
                for nm, role in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")):
                    sub.linear(P + "1.EncDecAttention." + nm, a * d, h, role)
                sub.linear(P + "1.EncDecAttention.o", h, a * d, "attn_o")
                sub.norm(P + "1.layer_norm", h)
                ff = "2"
            F = P + ff + ".DenseReluDense."
            if gated:
                sub.linear(F + "wi_0", i, h, "mlp_gate")
                sub.linear(F + "wi_1", i, h, "mlp_up")
            else:
                sub.linear(F + "wi", i, h, "mlp_up")
            sub.linear(F + "wo", h, i, "mlp_down")
            sub.norm(P + ff + ".layer_norm", h)
            for t in sub.tensors:
                lo, hi = t.layers if t.layers else (0, 0)
                b.tensors.append(shift_layers(t, first + lo, first + hi))
            b.norm(S + ".final_layer_norm", h, per_layer=False)

        stack("encoder", 0, Le, False)
        kinds: List[Tuple[str, int]] = [("encoder", Le)]
        if decoder:
            stack("decoder", Le, Ld, True)
            kinds.append(("decoder", Ld))
        # generate()'s EncoderDecoderCache: each decoder layer keeps its self-attention keys and
        # values (a x d_kv each per decoder token) and the cross-attention keys and values of the
        # encoder output (the same per encoder token); with the encoder input as long as the
        # context, that is 2 x num_decoder_layers layers' worth per token.  The encoder keeps none.
        return dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a, head_dim=d, intermediate_size=i,
                    vocab_size=V, tie_word_embeddings=True, tensors=b.tensors, mlp_kind=self.mlp_kind,
                    norm_kind=self.norm_kind, layer_kinds=kinds, kv_cache_layers=2 * Ld if decoder else 0,
                    task=task)

    def notes(self, arch: Any) -> List[str]:
        out = ["T5: the decoder reads as many tokens as the encoder unless target_len says otherwise (then the "
               "decoder, its cross-attention queries, the head and the loss read batch x target_len tokens)",
               "T5: lm_head is tied to the shared embedding (transformers 5 forces tie_word_embeddings=True; "
               "the config's false only turns off the d_model^-0.5 decoder-output scaling)"]
        out.append("T5 inference: the KV cache is each decoder layer's self-attention keys/values plus the "
                   "cross-attention keys/values of the encoder output, the encoder input taken as long as the "
                   "context (2 x num_decoder_layers layers' worth per token); the encoder keeps none")
        if arch.task == "encoder":
            out.append("T5: task='encoder' counts T5EncoderModel (no decoder, no LM head); the head and loss "
                       "of the estimate stand for whatever the encoder feeds")
        return out

    def reads_encoder(self, tensor: Any) -> bool:
        """``EncDecAttention.k`` and ``.v`` project the encoder output (key_value_states)."""
        return ".EncDecAttention.k." in tensor.name or ".EncDecAttention.v." in tensor.name

    # -- training trace -----------------------------------------------------------------
    def dropout_p(self, cfg: Mapping[str, Any]) -> float:
        """``dropout_rate`` (0.1 by default)."""
        return float(cfg.get("dropout_rate", 0.1) or 0.0)

    def norm(self, tr: Any, ctx: Any, x: Any, name: str, group: str = "norms") -> Any:
        """T5LayerNorm: ``x * rsqrt(x.float().pow(2).mean(-1))`` keeps the fp32 copy (pow), the
        rsqrt and the original x (the product's other factor); the 16-bit cast-back is kept by
        ``weight * x`` when the weight trains."""
        out = rms_norm(tr, ctx, x, name, ctx.arch.hidden_size, group)
        if x.rg:
            tr.save(x)
        return out

    def attention(self, tr: Any, ctx: Any, n: Any, kv_in: Any, prefix: str, cross: bool) -> Any:
        """Self- or cross-attention with the position bias; dropout after ``o``."""
        arch, T = ctx.arch, ctx.T
        a, d, h = arch.num_heads, arch.head_dim, arch.hidden_size
        q = linear(tr, ctx, n, "q", a * d, prefix + "q output", "attention")
        if cross:
            # the encoder output is one tensor: every decoder layer's k and v keep that same
            # storage (counted once, in final_norm); LoRA's copies are per module
            # over the encoder's tokens (b x s_enc): T5Attention's key_value_states
            Tk = ctx.b * ctx.src_s
            k = linear(tr, ctx, kv_in, "k", a * d, prefix + "k output", "attention", trains=False, tokens=Tk)
            v = linear(tr, ctx, kv_in, "v", a * d, prefix + "v", "attention", trains=False, tokens=Tk)
            if ctx.linear_trains:
                k.rg = v.rg = True
        else:
            k = linear(tr, ctx, n, "k", a * d, prefix + "k output", "attention")
            v = linear(tr, ctx, n, "v", a * d, prefix + "v", "attention")
        names = ("q cast", "k cast", "v cast", "softmax output", "attention probabilities",
                 "attention dropout mask", "attention probabilities after dropout", "attention output",
                 "attention logsumexp", "q", "k", "v")
        sub = PrefixedTrace(tr, prefix, names)
        # T5's position bias is the SDPA mask.  It needs a gradient where relative_attention_bias
        # trains (self-attention, full fine-tuning) or, under checkpointing, where T5Attention
        # makes its zeros require grad (cross-attention).  CUDA runs the memory-efficient kernel
        # either way (flash takes no mask; the efficient kernel returns the bias gradient,
        # tools/autograd/derivatives.yaml); the CPU's flash kernel has no mask gradient, so there
        # a mask that needs one sends SDPA to the math kernel (for the CPU checks)
        bias_grad = ctx.linear_trains if not cross else ctx.setup.gradient_checkpointing == "full"
        if ctx.cpu and ctx.attn_backend == "flash" and bias_grad:
            ctx = replace(ctx, attn_backend="math")
        # scores (b x heads x t x s_enc for the cross-attention): T5Attention.forward adds the
        # position bias of shape (1, heads, query_length, key_length), compute_bias or the
        # cross-attention's zeros (transformers models/t5/modeling_t5.py)
        o_in = sdpa_core(sub, ctx, q, k, v, d, dropout_p=self.dropout_p(arch.config), softmax_fp32=False,
                         kv_len=ctx.src_s if cross else None)
        o = linear(tr, ctx, o_in, "o", h, prefix + "o output", "attention", in_features=a * d)
        return dropout(tr, o, self.dropout_p(arch.config), prefix + "output", ctx.cpu)

    def block(self, tr: Any, ctx: Any, x: Any) -> Any:
        arch = ctx.arch
        p = self.dropout_p(arch.config)
        cross = ctx.kind == "decoder"
        n1 = self.norm(tr, ctx, x, "self-attention layer_norm")
        o = self.attention(tr, ctx, n1, n1, "self-attention ", False)
        x1 = residual(tr, x, o, "residual after self-attention")
        if cross:
            # the encoder output is its final_layer_norm's output: the dtype this block's own
            # norm gives the same residual stream (fp32 where the norm weights are fp32, as
            # after prepare_model_for_kbit_training or under autocast; T5LayerNorm.forward in
            # transformers models/t5/modeling_t5.py casts to the weight's dtype only when 16-bit)
            enc = tr.new("encoder output", ctx.b * ctx.src_s * arch.hidden_size, n1.dtype, True, "b x s x h",
                         "attention")
            n2 = self.norm(tr, ctx, x1, "cross-attention layer_norm")
            o2 = self.attention(tr, ctx, n2, enc, "cross-attention ", True)
            x1 = residual(tr, x1, o2, "residual after cross-attention")
        n3 = self.norm(tr, ctx, x1, "mlp layer_norm")
        m = self.mlp(tr, ctx, n3)
        m = dropout(tr, m, p, "mlp output", ctx.cpu)
        return residual(tr, x1, m, "block output")

    def mlp(self, tr: Any, ctx: Any, n: Any) -> Any:
        """DenseReluDense (gated or not) with its dropouts and the fp32 ``wo``."""
        arch = ctx.arch
        i, h = arch.intermediate_size, arch.hidden_size
        p = self.dropout_p(arch.config)
        if self.gated(arch.config):
            g = linear(tr, ctx, n, "wi_0", i, "wi_0 output", "mlp")
            act = GPT2.activation(self, tr, ctx, g, i)
            u = linear(tr, ctx, n, "wi_1", i, "wi_1 output", "mlp")
            if act.rg or u.rg:
                tr.save(act)
                tr.save(u)
            prod = tr.new("act(wi_0) * wi_1", n.numel / h * i, _wider(act.dtype, u.dtype), act.rg or u.rg,
                          "T x i", "mlp")
        else:
            f = linear(tr, ctx, n, "wi", i, "wi output", "mlp")
            prod = GPT2.activation(self, tr, ctx, f, i)
        prod = dropout(tr, prod, p, "mlp hidden", ctx.cpu)
        return linear(tr, ctx, prod, "wo", h, "wo output", "mlp", in_features=i)

    def final_norm(self, tr: Any, ctx: Any, x: Any) -> Any:
        """Both stacks' ends: the encoder's final_layer_norm + dropout (its output is kept once
        by every decoder layer's cross-attention k and v when they train), the stacks'
        embedding dropouts, and the decoder's final_layer_norm + dropout before the head."""
        arch = ctx.arch
        p = self.dropout_p(arch.config)
        # the encoder side reads b x s_enc tokens, the decoder side (x) the b x t target tokens
        enc_numel = ctx.b * ctx.src_s * arch.hidden_size
        enc_x = tr.new("encoder final norm input", enc_numel, x.dtype, x.rg, "b x s x h", "output head")
        ne = self.norm(tr, ctx, enc_x, "encoder final_layer_norm", "output head")
        ne = dropout(tr, ne, p, "encoder output", ctx.cpu)
        if arch.task == "seq2seq_lm" and ctx.linear_trains:
            ne.name, ne.group, ne.formula = "encoder output (kept by every cross-attention k and v)", "attention", \
                "b x s x h"
            tr.save(ne)
        if ctx.linear_trains:   # the embedding trains: both stacks drop out their input embeddings
            for S in ("encoder", "decoder") if arch.task == "seq2seq_lm" else ("encoder",):
                e = tr.new(f"{S} input embeddings", enc_numel if S == "encoder" else x.numel,
                           ctx.c if ctx.setup.autocast else x.dtype, True,
                           "b x s x h" if S == "encoder" else "b x t x h", "embedding")
                dropout(tr, e, p, f"{S} input embeddings", ctx.cpu)
        if arch.task != "seq2seq_lm":
            return ne
        n = self.norm(tr, ctx, x, "decoder final_layer_norm", "output head")
        return dropout(tr, n, p, "decoder output", ctx.cpu)

    # -- inference ----------------------------------------------------------------------
    def inference_mlp(self, arch: Any, T: int, c: float) -> List[Tuple[str, float, str]]:
        i = arch.intermediate_size
        n = (4 if self.composite_gelu(arch) else 2) + (1 if self.gated(arch.config) else 0)
        return [("wi output + activation temporaries", n * T * i * c, f"{n} x T x i")]


@register
class UMT5(T5):
    """UMT5 (``models/umt5/modeling_umt5.py``): T5 whose every layer holds its own
    ``relative_attention_bias`` (``UMT5Attention(config, has_relative_attention_bias=True)``)."""

    model_types = ("umt5",)
    bias_every_layer = True


class PrefixedTrace:
    """A view of a Trace that prefixes the attention core's tensor names (self- and
    cross-attention of one decoder block are distinct storages); everything else is the
    Trace's own."""

    def __init__(self, tr: Any, prefix: str, names: Tuple[str, ...]) -> None:
        self._tr, self._p = tr, prefix

    def new(self, name: str, *a: Any, **k: Any) -> Any:
        """The Trace's new, the name prefixed."""
        return self._tr.new(self._p + name, *a, **k)

    def temp(self, name: str, *a: Any, **k: Any) -> Any:
        """The Trace's temp, the name prefixed."""
        return self._tr.temp(self._p + name, *a, **k)

    def cast(self, t: Any, dtype: str, name: str) -> Any:
        """The Trace's cast, the name prefixed."""
        return self._tr.cast(t, dtype, self._p + name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._tr, attr)


def _wider(a: str, b: str) -> str:
    return F32 if F32 in (a, b) else b


def shift_layers(t: Any, lo: int, hi: int) -> Any:
    """A parameter tensor of one stack moved to layers ``lo``..``hi`` (the decoder's after the encoder's)."""
    from dataclasses import replace
    return replace(t, layers=(lo, hi) if t.layers else None)

