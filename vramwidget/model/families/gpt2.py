"""GPT-2: the LayerNorm decoder the other "plain" families are written as a variation of.

Parameters (transformers ``models/gpt2/modeling_gpt2.py``, ``GPT2LMHeadModel``):
``transformer.wte``, ``transformer.wpe`` (learned positions); per layer ``ln_1``,
``attn.c_attn`` (fused qkv, Conv1D: in x out), ``attn.c_proj``, ``ln_2``, ``mlp.c_fc``,
``mlp.c_proj``, all with biases; ``transformer.ln_f``; the head tied to ``wte``.  Block:
LayerNorm -> fused qkv -> attention core -> projection -> dropout -> residual ->
LayerNorm -> fc -> activation -> projection -> dropout -> residual.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from .base import Family, register
from .blocks import (F32, ParamBuilder, config_get, positive_count, promote_dtype, required_count, dropout, layer_norm, linear, sdpa_core)
from ...errors import VramError


@register
class GPT2(Family):
    model_types = ("gpt2",)
    gguf_arch = "gpt2"
    mlp_kind = "plain"
    norm_kind = "layernorm"
    rotary = False
    default_lora_targets = ("c_attn", "c_proj", "c_fc")
    #: module names of the fused qkv, attention output, MLP in and MLP out projections
    names: Tuple[str, str, str, str] = ("c_attn", "c_proj", "c_fc", "c_proj")
    #: the eager softmax runs in fp32 (False: GPT-2 and Falcon keep the compute dtype)
    softmax_fp32: bool = False
    #: q built heads-major (partial RoPE by torch.cat: GPT-NeoX)
    q_heads_major: bool = False
    #: the sum of token and position embeddings goes through dropout (``embd_pdrop``)
    embd_dropout: bool = True

    # -- parameters ---------------------------------------------------------------------
    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        h = required_count(cfg, "hidden size", "n_embd", "hidden_size")
        L = required_count(cfg, "number of layers", "n_layer", "num_hidden_layers")
        a = required_count(cfg, "attention heads", "n_head", "num_attention_heads")
        V = required_count(cfg, "vocabulary size", "vocab_size")
        npos = required_count(cfg, "positions", "n_positions", "max_position_embeddings", default=1024)
        if h % a:
            raise VramError(f"config: n_head ({a}) does not divide n_embd ({h})", field="n_head")
        i = positive_count(cfg, config_get(cfg, "n_inner", default=4 * h), "n_inner")
        b = ParamBuilder(L)
        P = "transformer.h.{i}."
        b.top("transformer.wte.weight", (V, h), "embedding", "wte")
        b.top("transformer.wpe.weight", (npos, h), "position_embedding", "wpe")
        b.norm(P + "ln_1", h, bias=True)
        b.linear(P + "attn.c_attn", 3 * h, h, "attn_qkv", bias=True, conv1d=True)
        b.linear(P + "attn.c_proj", h, h, "attn_o", bias=True, conv1d=True)
        b.norm(P + "ln_2", h, bias=True)
        b.linear(P + "mlp.c_fc", i, h, "mlp_up", bias=True, conv1d=True)
        b.linear(P + "mlp.c_proj", h, i, "mlp_down", bias=True, conv1d=True)
        b.norm("transformer.ln_f", h, bias=True, per_layer=False)
        tied = bool(config_get(cfg, "tie_word_embeddings", default=True))
        if not tied:
            b.top("lm_head.weight", (V, h), "output_head", "lm_head")
        return self.info(h, L, a, a, h // a, i, V, tied, b)

    def info(self, h: int, L: int, a: int, kv: int, d: int, i: int, V: int, tied: bool, b: ParamBuilder
             ) -> Dict[str, Any]:
        """The Architecture fields of a plain decoder."""
        return dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kv, head_dim=d, intermediate_size=i,
                    vocab_size=V, tie_word_embeddings=tied, tensors=b.tensors, mlp_kind=self.mlp_kind,
                    norm_kind=self.norm_kind)

    # -- training trace -----------------------------------------------------------------
    def resid_dropout(self, cfg: Mapping[str, Any]) -> float:
        """Dropout after the attention and MLP projections (``resid_pdrop``)."""
        return float(cfg.get("resid_pdrop", cfg.get("dropout", cfg.get("hidden_dropout", 0.0))) or 0.0)

    def attn_dropout(self, cfg: Mapping[str, Any]) -> float:
        """Dropout on the attention probabilities (``attn_pdrop``)."""
        return float(cfg.get("attn_pdrop", cfg.get("attention_dropout", 0.0)) or 0.0)

    def parallel(self, cfg: Mapping[str, Any]) -> bool:
        """Attention and MLP read the same block input (parallel residual)."""
        return False

    def qkv(self, tr: Any, ctx: Any, n1: Any) -> Tuple[Any, Any, Any]:
        """q, k, v: views of one fused projection's output."""
        arch = ctx.arch
        a, kv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        qkv = linear(tr, ctx, n1, self.names[0], (a + 2 * kv) * d, "qkv", "attention")
        return qkv, qkv, qkv

    def mlp_norm_input(self, tr: Any, ctx: Any, x: Any, n1: Any) -> Any:
        """The MLP's normed input in a parallel block (its own LayerNorm of x)."""
        return layer_norm(tr, ctx, x, "ln_2", ctx.arch.hidden_size)

    def block(self, tr: Any, ctx: Any, x: Any) -> Any:
        arch = ctx.arch
        h, a, d, i = arch.hidden_size, arch.num_heads, arch.head_dim, arch.intermediate_size
        cfg = arch.config
        resid_p = self.resid_dropout(cfg)
        attn_p = self.attn_dropout(cfg)
        n1 = layer_norm(tr, ctx, x, "ln_1", h)
        q, k, v = self.qkv(tr, ctx, n1)
        o_in = sdpa_core(tr, ctx, q, k, v, d, dropout_p=attn_p, softmax_fp32=self.softmax_fp32,
                         q_heads_major=self.q_heads_major)
        o = linear(tr, ctx, o_in, self.names[1], h, "attention projection output", "attention", in_features=a * d)
        o = dropout(tr, o, resid_p, "attention residual", ctx.cpu)
        if self.parallel(cfg):
            n2 = self.mlp_norm_input(tr, ctx, x, n1)
        else:
            x1 = tr.residual_stream(tr.new("residual after attention", x.numel, promote_dtype(x.dtype, o.dtype), True,
                                           "T x h", "norms"))
            n2 = layer_norm(tr, ctx, x1, "ln_2", h)
        f = linear(tr, ctx, n2, self.names[2], i, "fc output", "mlp")
        act = self.activation(tr, ctx, f, i)
        m = linear(tr, ctx, act, self.names[3], h, "mlp projection output", "mlp", in_features=i)
        dropout(tr, m, resid_p, "mlp residual", ctx.cpu)
        return tr.new("block output", x.numel, x.dtype, True, "T x h", "norms")

    def act_name(self, cfg: Mapping[str, Any]) -> str:
        """The MLP's activation function name."""
        return str(cfg.get("activation_function", cfg.get("hidden_act", "gelu")))

    def composite_gelu(self, arch: Any) -> bool:
        """The activation is a Python composite of several kernels (GPT-2's gelu_new)."""
        return self.act_name(arch.config) in ("gelu_new", "gelu_fast")

    def activation(self, tr: Any, ctx: Any, f: Any, i: int) -> Any:
        """The plain MLP's activation: a fused GELU keeps its input, ReLU its output;
        gelu_new is 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))): pow saves x, tanh its
        output, the last product both factors.  Autocast runs pow in fp32, so from there on
        the chain is fp32 (pow saves an fp32 copy of x; only 0.5*x stays 16-bit)."""
        name = self.act_name(ctx.arch.config)
        T = ctx.T
        if not f.rg:
            return tr.new("activation output", f.numel, f.dtype, False, "T x i", "mlp")
        if self.composite_gelu(ctx.arch):
            if ctx.setup.autocast and f.dtype != F32:
                tr.save(tr.new("gelu input as fp32 (autocast pow)", T * i, F32, True, "T x i fp32", "mlp"))
                wide = F32
            else:
                tr.save(f)
                wide = f.dtype
            tr.save(tr.new("gelu tanh output", T * i, wide, True, "T x i", "mlp"))
            tr.save(tr.new("gelu 0.5 * x", T * i, f.dtype, True, "T x i", "mlp"))
            tr.save(tr.new("gelu 1 + tanh", T * i, wide, True, "T x i", "mlp"))
            return tr.new("activation output", f.numel, wide, True, "T x i", "mlp")
        if name == "relu":
            out = tr.new("activation output", f.numel, f.dtype, True, "T x i", "mlp")
            tr.save(out)
            return out
        tr.save(f)
        return tr.new("activation output", f.numel, f.dtype, True, "T x i", "mlp")

    def final_norm(self, tr: Any, ctx: Any, x: Any) -> Any:
        return layer_norm(tr, ctx, x, "final norm", ctx.arch.hidden_size, group="output head")

    def head_saved(self, arch: Any, T: int, full: bool) -> List[Tuple[str, float, str]]:
        # GPT-2 drops out the sum of token and position embeddings (embd_pdrop)
        if self.embd_dropout and full and float(arch.config.get("embd_pdrop", 0.1) or 0.0) > 0:
            return [("embedding dropout mask", T * arch.hidden_size * 1.0, "T x h bool")]
        return []

    # -- inference ----------------------------------------------------------------------
    def inference_mlp(self, arch: Any, T: int, c: float) -> List[Tuple[str, float, str]]:
        n = 4 if self.composite_gelu(arch) else 2
        i = arch.intermediate_size
        return [("fc output + activation temporaries", n * T * i * c,
                 f"{n} x T x i" + (" (GELU written as tanh composite)" if n == 4 else ""))]
