"""Every weight tensor of a causal language model, from its config.json.

An :class:`Architecture` is built from a Hugging Face ``config.json`` (a path or a dict),
a built-in preset name, a Hub id, plain numbers (:func:`custom`) or a bare parameter count
(:func:`from_param_count`).  Its ``tensors`` list every parameter tensor the transformers
model instantiates, collapsed across layers and experts: name pattern, shape, role,
module group, how many instances, and whether it is a linear layer that LoRA or 4-bit
quantization can target.  Counts are checked to the parameter against transformers
(``tools/record_param_counts.py`` records them; ``tests/test_architecture.py`` compares).

The symbols used in formulas throughout the package, defined once:

====  ================================================================
h     hidden size (``hidden_size`` / ``n_embd``)
L     number of transformer blocks (``num_hidden_layers`` / ``n_layer``)
a     attention heads;  kv: key/value heads (GQA/MQA);  d: head dim
i     MLP intermediate size (``intermediate_size`` / ``n_inner`` / 4h)
V     vocabulary size
E     routed experts;  k: experts per token;  i_e: expert intermediate size
====  ================================================================
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

from ..errors import VramError
from ..inputs import MAX_TEXT_CHARS, check_int, check_text, fail, shown
from .families import REGISTRY, Family, family_for, resolve_model_type, supported_model_types
from .tensors import MAX_LAYERS, check_depth
from .tensors import (ROLE_GROUP, ParamTensor, ParamBuilder, config_get, positive_count, required_count,  # noqa: F401 (re-exported)
                      restrict_layers)

#: every model_type with an analytic family (``vramwidget/model/families``)
SUPPORTED_MODEL_TYPES = supported_model_types()


@dataclass
class Architecture:
    """A causal LM's shape: the numbers that memory depends on, and every weight tensor.

    ``exact`` is false for a model given only as a parameter count: then the tensors are
    a stated assumption (a Llama-like shape fitted to the count; see :func:`from_param_count`).
    """

    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    tensors: List[ParamTensor] = field(default_factory=list)
    mlp_kind: str = "gated"            # "gated" (gate, up, down) or "plain" (fc, proj)
    norm_kind: str = "rms"             # "rms" or "layernorm"
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    dense_layers: int = 0              # leading dense layers in an MoE model (DeepSeek)
    sliding_window: Optional[int] = None
    sliding_layers: int = 0            # how many layers use the sliding window
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    mla: Optional[Dict[str, int]] = None   # kv_lora_rank, q_lora_rank, qk_rope_head_dim, ...
    max_position_embeddings: Optional[int] = None
    #: blocks of different kinds in one stack, (kind, count) in layer order of first
    #: appearance (hybrids: "linear_attention"/"full_attention"; encoder-decoders:
    #: "encoder"/"decoder"); None: every block is alike.  The family's ``block`` reads ctx.kind.
    layer_kinds: Optional[List[Tuple[str, int]]] = None
    #: the kind of each layer by index, where kinds interleave (a hybrid's layer_types);
    #: None: the kinds of ``layer_kinds`` one after another (an encoder's layers, then the
    #: decoder's).  Freeze trains the last layers, so which kinds train depends on it.
    layer_order: Optional[List[str]] = None
    #: side towers (a VLM's vision encoder) as architectures of their own
    towers: Dict[str, "Architecture"] = field(default_factory=dict, repr=False)
    #: the transformers model class counted: causal_lm, image_text_to_text, seq2seq_lm, masked_lm
    task: str = "causal_lm"
    #: layers that keep a KV cache (None: all); hybrids' other layers keep a fixed-size state
    kv_cache_layers: Optional[int] = None
    #: elements of the fixed-size recurrent state (conv + linear-attention/SSM) of one sequence
    state_elems_per_seq: int = 0
    hub_id: Optional[str] = None
    exact: bool = True
    assumption: str = ""
    config: Dict[str, Any] = field(default_factory=dict, repr=False)

    # -- counts --------------------------------------------------------------------
    @property
    def params_total(self) -> int:
        """Parameters as ``sum(p.numel() for p in model.parameters())`` (tied counted once)."""
        return sum(t.numel for t in self.tensors)

    @property
    def family(self) -> "Family":
        """The family module that models this architecture (looked up by ``model_type``)."""
        return family_for(self.model_type)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_modules(self) -> List[str]:
        """Names of the nn.Linear modules inside the blocks (what ``target_modules`` may name;
        fused MoE expert parameters are not nn.Linear modules)."""
        seen: List[str] = []
        for t in self.tensors:
            if t.linear and not t.experts and t.module not in seen:
                seen.append(t.module)
        return seen

    def params_by_group(self) -> Dict[str, int]:
        """Parameters per module group (embedding, attention, mlp, experts, ...)."""
        out: Dict[str, int] = {}
        for t in self.tensors:
            out[t.group] = out.get(t.group, 0) + t.numel
        return out

    def params_by_role(self) -> Dict[str, int]:
        """Parameters per role (attn_q, mlp_up, output_head, ...)."""
        out: Dict[str, int] = {}
        for t in self.tensors:
            out[t.role] = out.get(t.role, 0) + t.numel
        return out

    def lora_params(self, r: int, targets: Optional[Iterable[str]] = None) -> int:
        """Trainable LoRA parameters: r x (in + out) per targeted linear, as peft counts them."""
        return sum(r * (t.in_features + t.out_features) * t.repeat for t in self.lora_tensors(targets))

    def lora_tensors(self, targets: Optional[Iterable[str]] = None) -> List[ParamTensor]:
        """The linear weights LoRA wraps for ``targets`` (all linear layers when None)."""
        tset = set(self.linear_modules() if targets is None else resolve_targets(self, targets))
        return [t for t in self.tensors if t.linear and t.module in tset and not t.experts]

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        return {
            "name": self.name, "model_type": self.model_type, "hub_id": self.hub_id,
            "exact": self.exact, "assumption": self.assumption,
            "hidden_size": self.hidden_size, "num_layers": self.num_layers, "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings, "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token, "params_total": self.params_total,
            "params_by_group": self.params_by_group(),
            "tensors": [t.to_dict() for t in self.tensors],
        }


#: LoRA targets outside the blocks: peft wraps the output head's nn.Linear (``lm_head``) and
#: the token embedding (``embed_tokens``, peft's lora.Embedding); the blocks' modules are
#: what :func:`resolve_targets` returns
HEAD_TARGETS = ("lm_head", "embed_tokens")


def resolve_targets(arch: Architecture, targets: Iterable[str]) -> List[str]:
    """LoRA ``target_modules`` -> the module names of ``arch`` they select.

    ``"all-linear"`` (peft's spelling) selects every linear module of the blocks.
    A name the model lacks raises a VramError listing the names it has.
    """
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    targets = list(targets)
    head = [t for t in targets if t in HEAD_TARGETS]
    targets = [t for t in targets if t not in HEAD_TARGETS]
    if head and not targets:
        return []   # only the output head and/or the embedding (estimate.param_storage adds those)
    have = arch.linear_modules()
    if any(t in ("all-linear", "all_linear", "all") for t in targets):
        return have
    missing = [t for t in targets if t not in have]
    experts = sorted({t.module for t in arch.tensors if t.experts} & set(missing))
    if experts:
        raise VramError(f"lora_targets: {', '.join(experts)} in {arch.name} are fused expert parameters "
                        f"(E x out x in), not nn.Linear modules; LoRA on experts is not modelled. Linear "
                        f"modules: {', '.join(have)}", field="lora_targets")
    if missing:
        raise VramError(
            f"lora_targets: {arch.name} has no module named {', '.join(missing)}; "
            f"its linear modules are {', '.join(have)} (or 'all-linear')", field="lora_targets")
    if not targets:
        raise VramError("lora_targets: name at least one module (or 'all-linear')", field="lora_targets")
    return targets


# ----------------------------------------------------------------------------------
# Reading a config.json
# ----------------------------------------------------------------------------------

#: old and new spellings of the same size; a config that gives both must agree
#: a config.json is a few kilobytes; longer text is not one
MAX_CONFIG_CHARS = 1 << 24

_SYNONYMS = (("hidden_size", "n_embd"), ("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"),
             ("max_position_embeddings", "n_positions"))

def from_config(config: Union[Mapping[str, Any], str, os.PathLike], name: Optional[str] = None,
                task: Optional[str] = None) -> Architecture:
    """An Architecture from a config.json dict or a path to a config.json file.

    ``task`` picks the transformers model class counted where a family has several
    (``causal_lm``, ``image_text_to_text``, ``seq2seq_lm``, ``masked_lm``); None: the
    family's default (the class a user fine-tunes).
    """
    if name is not None:
        check_text("name", name, max_chars=MAX_TEXT_CHARS)
    if not isinstance(config, Mapping):
        if not isinstance(config, (str, os.PathLike)):
            raise fail("model", "a config.json must be a dict or a path", config)
        path = os.fspath(config)
        if not isinstance(path, str) or len(path) > MAX_TEXT_CHARS:
            raise fail("model", f"a config.json path is text of at most {MAX_TEXT_CHARS:,} characters", path)
        try:
            with open(path, "r", encoding="utf-8") as f:
                text = f.read(MAX_CONFIG_CHARS + 1)
            if len(text) > MAX_CONFIG_CHARS:
                raise fail("model", f"{shown(path)} is larger than a config.json ({MAX_CONFIG_CHARS:,} characters at "
                                    "most)", show_value=False)
        except UnicodeDecodeError:
            raise fail("model", f"{shown(path)} is not UTF-8 text", show_value=False) from None
        except OSError as e:
            raise VramError(f"model: cannot read {shown(path)}: {e.strerror or e}", field="model") from None
        config = parse_config_text(text, source=path)
        if name is None:
            name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "custom"
    cfg = dict(config)
    fam0 = REGISTRY.get(resolve_model_type(str(cfg.get("model_type") or "")))
    if ("text_config" in cfg and isinstance(cfg["text_config"], Mapping) and "hidden_size" not in cfg
            and not (fam0 is not None and fam0.reads_text_config)):
        inner = dict(cfg["text_config"])
        inner.setdefault("model_type", str(cfg.get("model_type", ""))[:64] + "_text")
        cfg = inner
    mt = cfg.get("model_type")
    if not mt:
        raise VramError("config: missing field 'model_type' (e.g. \"llama\"); supported: "
                        + ", ".join(supported_model_types()), field="model_type")
    if not isinstance(mt, str) or len(mt) > 64:
        raise fail("model_type", "config: must be text, one of " + ", ".join(supported_model_types()), mt)
    mt = resolve_model_type(mt)
    if cfg.get("is_encoder_decoder") and not getattr(REGISTRY.get(mt), "encoder_decoder", False):
        raise VramError(f"config: {mt} is an encoder-decoder model; its family models a decoder-only model",
                        field="model_type")
    family = family_for(mt)
    for a, b in _SYNONYMS:
        if cfg.get(a) is not None and cfg.get(b) is not None and cfg[a] != cfg[b]:
            raise VramError(f"config: contradictory fields {a}={shown(cfg[a])} and {b}={shown(cfg[b])} (two spellings of "
                            f"one size); keep one", field=a)
    task = family.check_task(task)
    check_depth(cfg)       # before the family lists every block's tensors
    try:
        info = family.params_for_task(cfg, mt, task)
    except VramError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as e:
        # a field of the wrong type that no check above names (e.g. a list where a number
        # belongs): still one line, never a traceback
        raise VramError(f"config: a {mt} config.json field has a value of the wrong type or range "
                        f"({type(e).__name__}: {shown(str(e))})", field="config_json") from None
    info.setdefault("task", task)
    # side towers come as the keyword arguments of their own architectures (model/families/vlm.py)
    info["towers"] = {k: Architecture(**v) for k, v in info.get("towers", {}).items()}
    text_cfg = info.pop("text_config", None)
    if text_cfg is not None:
        # a VLM: the decoder's config is what its blocks read; the full config stays with the towers
        cfg = text_cfg
    pos = config_get(cfg, "max_position_embeddings", "n_positions")
    if pos is not None:
        pos = positive_count(cfg, pos, "max_position_embeddings")
    info.setdefault("max_position_embeddings", pos)
    given = name or cfg.get("_name_or_path")
    return Architecture(name=given if isinstance(given, str) and given else mt, model_type=mt, config=cfg, **info)


def parse_config_text(text: str, source: str = "config.json") -> Dict[str, Any]:
    """Parse config.json text with a one-line error naming the line and column."""
    check_text("config_json", text, max_chars=MAX_CONFIG_CHARS, what="config.json must be text")
    source = shown(source).strip("'\"")
    try:
        cfg = json.loads(text)
    except RecursionError:
        raise VramError(f"config: {source} is nested too deeply to be a config.json", field="config_json") from None
    except json.JSONDecodeError as e:
        raise VramError(f"config: {source} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})",
                        field="config_json") from None
    if not isinstance(cfg, dict):
        raise VramError(f"config: {source} must hold a JSON object, got {type(cfg).__name__}", field="config_json")
    return cfg


# ----------------------------------------------------------------------------------
# Custom shapes and bare parameter counts
# ----------------------------------------------------------------------------------

def custom(*, hidden_size: int, num_layers: int, num_heads: int, vocab_size: int,
           intermediate_size: Optional[int] = None, num_kv_heads: Optional[int] = None,
           head_dim: Optional[int] = None, mlp: str = "gated", tied: bool = False,
           name: str = "custom") -> Architecture:
    """An architecture from plain numbers.

    ``mlp="gated"`` gives a Llama-style block (RMSNorm, gate/up/down projections, no biases);
    ``mlp="plain"`` a GPT-style block (LayerNorm with bias, fc/proj with biases, learned positions
    are not added).
    """
    from ..inputs import check_bool, check_choice

    mlp = check_choice("mlp", mlp, ("gated", "plain"))
    hidden_size, num_heads, vocab_size = (
        check_int(k, v, what="must be a positive whole number") for k, v in (("hidden_size", hidden_size),
                                     ("num_heads", num_heads), ("vocab_size", vocab_size)))
    num_layers = check_int("num_layers", num_layers, hi=MAX_LAYERS)
    intermediate_size, num_kv_heads, head_dim = (
        None if v is None else check_int(k, v, what="must be a positive whole number") for k, v in (("intermediate_size", intermediate_size),
                                                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)))
    tied = check_bool("tied", tied)
    name = check_text("name", name, max_chars=256)
    cfg: Dict[str, Any] = {"model_type": "llama", "hidden_size": hidden_size, "num_hidden_layers": num_layers,
                           "num_attention_heads": num_heads, "vocab_size": vocab_size,
                           "num_key_value_heads": num_heads if num_kv_heads is None else num_kv_heads,
                           "tie_word_embeddings": tied,
                           "intermediate_size": intermediate_size if intermediate_size is not None else
                           (4 * hidden_size if mlp == "plain" else _llama_intermediate(hidden_size))}
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    elif hidden_size % num_heads:
        # custom() is this package's own shape: the heads split the hidden size unless a head_dim
        # says otherwise (a config.json follows transformers' floor division instead: blocks.dims)
        raise VramError(f"num_heads: num_attention_heads ({num_heads}) does not divide hidden_size ({hidden_size}); "
                        f"give head_dim", field="num_heads")
    if mlp == "plain":
        cfg = {"model_type": "gpt_neox", "hidden_size": hidden_size, "num_hidden_layers": num_layers,
               "num_attention_heads": num_heads, "vocab_size": vocab_size, "intermediate_size":
               4 * hidden_size if intermediate_size is None else intermediate_size, "tie_word_embeddings": tied}
        if num_kv_heads is not None and num_kv_heads != num_heads:
            raise VramError("num_kv_heads: a plain (GPT-style) block has as many KV heads as heads",
                            field="num_kv_heads")
    arch = from_config(cfg, name=name)
    return arch


def _llama_intermediate(h: int) -> int:
    """Llama's rule: 2/3 of 4h, rounded up to a multiple of 256."""
    return int(math.ceil(8 * h / 3 / 256) * 256)


def parse_param_count(text: Union[str, int, float]) -> int:
    """'7B' -> 7e9, '350M' -> 3.5e8, 1.3e9 -> 1.3e9."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        n = float(text) if abs(text) < 1e300 else float("inf")
    elif not isinstance(text, str) or len(text) > 64:
        raise fail("model", "a parameter count is a number or text like '7B'", text)
    else:
        s = str(text).strip().upper().replace("_", "").replace(",", "")
        mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
        try:
            n = float(s[:-1]) * mult[s[-1]] if s and s[-1] in mult else float(s)
        except (ValueError, KeyError):
            raise VramError(f"model: {shown(text)} is neither a preset, a config.json, a Hub id nor a parameter "
                            f"count like '7B'", field="model") from None
    if not (n > 0) or n != n or n == float("inf"):
        raise VramError(f"model: a parameter count must be positive, got {shown(text)}", field="model")
    return int(round(n))


def from_param_count(count: Union[str, int, float], *, vocab_size: int = 32000) -> Architecture:
    """A stand-in architecture for a model known only by its parameter count.

    Assumption (stated on the result): a Llama-style dense decoder with hidden size from
    the Llama 2 family's aspect ratio (L = h / 128, i = 8h/3 rounded), full multi-head
    attention, untied embeddings of a 32k vocabulary; the hidden size is solved so the
    total matches the count.  Weights, gradients and optimizer states are then exact for
    that count; activations and logits follow the assumed shape and are marked derived.
    """
    n = parse_param_count(count)
    vocab_size = check_int("vocab_size", vocab_size, lo=1, hi=1 << 24)
    smallest = _assumed_total(256, vocab_size)
    if n < smallest:
        raise VramError(f"model: {_fmt_count(n)} parameters is below the smallest assumed shape ({_fmt_count(smallest)}: "
                        f"h=256, 2 layers, a {vocab_size:,}-token vocabulary); give a config.json for a model this "
                        f"small", field="model")
    if n > MAX_PARAMS:
        raise VramError(f"model: {_fmt_count(n)} parameters is more than 2**50 (a PiB of 1-byte weights): not a real "
                        f"model", field="model")
    best = None
    for h in range(256, 32768 + 1, 128):
        L = max(1, round(h / 128))
        i = _llama_intermediate(h)
        total = _assumed_total(h, vocab_size)
        if total > n and best is not None:
            break
        best = (total, h, L, i)
    assert best is not None
    _, h, L, i = best
    arch = custom(hidden_size=h, num_layers=L, num_heads=h // 128, vocab_size=vocab_size, intermediate_size=i,
                  head_dim=128, name=f"{_fmt_count(n)} (assumed shape)")
    # Scale the block tensors' repeat so the total equals the stated count exactly.
    arch.exact = False
    arch.assumption = (f"only a parameter count was given ({_fmt_count(n)}): weights, gradients and optimizer "
                       f"states use that count exactly; activations and logits assume a Llama-like shape "
                       f"h={h}, L={L}, heads={h // 128}, i={i}, vocab={vocab_size}")
    diff = n - arch.params_total
    if diff > 0:
        # The largest assumed shape not above the count; the remainder is one more tensor so
        # that weights, gradients and optimizer states follow the stated count exactly.
        arch.tensors.append(ParamTensor("(remainder to match the stated count)", (diff,), "norm", "other"))
    arch.config = {"param_count": n, "assumed": {"hidden_size": h, "num_layers": L, "intermediate_size": i}}
    return arch


def _assumed_total(h: int, vocab_size: int) -> int:
    """Parameters of the assumed Llama-like shape of hidden size h (L = h / 128, i = 8h/3)."""
    L, i = max(1, round(h / 128)), _llama_intermediate(h)
    return L * (4 * h * h + 3 * h * i + 2 * h) + 2 * vocab_size * h + h


#: a bare parameter count above this is an input error (a PiB of 1-byte weights)
MAX_PARAMS = 2 ** 50


def _fmt_count(n: int) -> str:
    for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suf}"
    return str(n)


# ----------------------------------------------------------------------------------
# The front door
# ----------------------------------------------------------------------------------

_CACHE: Dict[str, Architecture] = {}


def load(model: Union[str, Mapping[str, Any], "Architecture", os.PathLike], task: Optional[str] = None
         ) -> Architecture:
    """Resolve what a user typed to an Architecture.

    Accepts an Architecture, a config dict, a path to a config.json (or to a folder holding
    one), a preset name (``llama-2-7b``), a preset's Hub id (``meta-llama/Llama-2-7b-hf``,
    resolved offline), another Hub id (fetches only config.json, needs ``huggingface_hub``
    and network; ``HF_TOKEN`` honoured), or a parameter count (``"7B"``).
    """
    if isinstance(model, Architecture):
        if task is not None and task != model.task:
            raise VramError(f"task: {model.name} was built for {shown(model.task)}; load its config with task={shown(task)}",
                            field="task")
        return model
    if isinstance(model, Mapping):
        return from_config(model, task=task)
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise VramError(f"model: expected a preset name, config.json path or dict, Hub id or Architecture, "
                        f"got {type(model).__name__}", field="model")
    if len(model) > MAX_TEXT_CHARS:
        raise fail("model", f"a preset name, path or Hub id is at most {MAX_TEXT_CHARS:,} characters", model)
    key = model.strip()
    if not key:
        raise VramError("model: empty; give a preset name (e.g. 'llama-3.1-8b'), a config.json path, "
                        "a Hub id or a parameter count like '7B'", field="model")
    ckey = key if task is None else f"{key}\x00{task}"
    hit = _CACHE.get(ckey)
    if hit is not None:
        return hit
    arch = _load_uncached(key, task)
    if len(_CACHE) > 256:
        _CACHE.clear()
    _CACHE[ckey] = arch
    return arch


def _load_uncached(key: str, task: Optional[str] = None) -> Architecture:
    from . import presets

    if os.path.isdir(key) and os.path.isfile(os.path.join(key, "config.json")):
        return from_config(os.path.join(key, "config.json"), task=task)
    if key.endswith(".json") or os.path.isfile(key):
        return from_config(key, task=task)
    preset = presets.find(key)
    if preset is not None:
        arch = from_config(preset["config"], name=preset["name"], task=task)
        arch.hub_id = preset.get("hub_id")
        return arch
    if "/" in key and not key.startswith((".", "/")):
        from .hub import fetch_config

        cfg = fetch_config(key)
        arch = from_config(cfg, name=key, task=task)
        arch.hub_id = key
        return arch
    if key[:1].isdigit():
        return from_param_count(key)
    raise presets.unknown_preset_error(key)

