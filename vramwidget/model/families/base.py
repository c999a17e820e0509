"""The family interface and the registry that maps a config's ``model_type`` to a family.

A family is a class with two halves, both built from the shared blocks of
:mod:`vramwidget.model.families.blocks`:

* ``params(cfg, model_type)``: every parameter tensor the transformers model class
  instantiates (the dict becomes an :class:`~vramwidget.model.architecture.Architecture`);
* ``block(tr, ctx, x)``: one transformer block's forward, op by op, recording what
  autograd saves (see :mod:`vramwidget.model.activations` for the rules).

plus a few small hooks the estimators ask (the final norm before the output head, whether
SDPA can run the attention, the inference working set of the MLP...).  A family that is
"Llama with X" subclasses :class:`~vramwidget.model.families.llama.Llama` and overrides X, the way
transformers' ``modular_<name>.py`` files do.  ``register`` adds a family for its
``model_types``; nothing outside ``vramwidget/model/families`` branches on a model type.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple, Type

from ...errors import VramError
from ...inputs import shown

#: model_type -> the family instance that models it (registration order is kept)
REGISTRY: Dict[str, "Family"] = {}
#: model_type spellings that mean another registered type (e.g. a multimodal wrapper)
ALIASES: Dict[str, str] = {}
#: side towers (vision encoders): families that are no model class of their own
TOWERS: Dict[str, "Family"] = {}


class Family:
    """Base class of a model family (see the module docstring)."""

    #: the config.json ``model_type`` values this family models
    model_types: Tuple[str, ...] = ()
    #: other spellings of a model type that resolve to ``model_types[0]``
    aliases: Tuple[str, ...] = ()
    #: the transformers model class counted by default ("causal_lm", "image_text_to_text",
    #: "seq2seq_lm", "masked_lm") and the other tasks a ``task`` keyword may pick
    task: str = "causal_lm"
    tasks: Tuple[str, ...] = ("causal_lm",)
    #: an encoder-decoder (a config's ``is_encoder_decoder`` is refused by other families)
    encoder_decoder: bool = False
    #: kinds of blocks (Architecture.layer_kinds) that read the decoder's target tokens
    #: (``TrainingSetup.target_len``) rather than the input's ``seq_len``; the output head and
    #: the loss then read them too.  Empty: one sequence (a decoder-only or an encoder model)
    target_kinds: Tuple[str, ...] = ()
    #: "gated" (gate, up, down) or "plain" (fc, proj); "rms" or "layernorm"
    mlp_kind: str = "gated"
    norm_kind: str = "rms"
    #: SDPA can run this family's attention (False: ALiBi or another additive bias that
    #: transformers only implements eagerly)
    sdpa_supported: bool = True
    #: rotary position embeddings (their cos/sin live through an inference forward)
    rotary: bool = True
    #: llama.cpp's architecture name (LLM_ARCH_*, as convert_hf_to_gguf.py maps the HF class), for
    #: its quantization-mix rules (src/llama-quant.cpp); Mistral and Mixtral convert as "llama"
    gguf_arch: str = "llama"
    #: peft's default LoRA targets for the measuring harness (None: q_proj, k_proj, ...)
    default_lora_targets: Optional[Tuple[str, ...]] = None

    #: the loss upcasts the logits to fp32 (transformers' ForCausalLMLoss); False: the model
    #: calls CrossEntropyLoss on the logits as they are (T5ForConditionalGeneration)
    loss_upcast: bool = True

    #: the family reads a multimodal config's ``text_config`` itself (else the text part is used)
    reads_text_config: bool = False

    # -- parameters -------------------------------------------------------------------
    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        """The Architecture fields (``tensors`` and the shape numbers) for a config."""
        raise NotImplementedError

    def params_for_task(self, cfg: Mapping[str, Any], mt: str, task: str) -> Dict[str, Any]:
        """``params`` for the model class of ``task`` (one of ``tasks``)."""
        return self.params(cfg, mt)

    def check_task(self, task: Optional[str]) -> str:
        """``task`` validated against the family's model classes (None: the default)."""
        if task is None:
            return self.task
        if task not in self.tasks:
            raise VramError(f"task: {self.model_types[0]} is modelled as {', '.join(self.tasks)}; got {shown(task)}",
                            field="task")
        return task

    def trace_key(self, arch: Any, setup: Any) -> Any:
        """What else (beyond the size-free setup) changes the block trace, e.g. whether the
        sequence is longer than a chunked-attention window (the trace is cached per value)."""
        return None

    def notes(self, arch: Any) -> List[str]:
        """What the estimate assumes about this family (shown on every estimate)."""
        return head_dim_notes(arch)

    def has_target(self, arch: Any) -> bool:
        """Whether the model has a decoder stack of its own that reads the target tokens
        (``target_len``): a block kind of ``target_kinds`` is in its layers."""
        kinds = self.layer_kinds(arch) or []
        return any(k in self.target_kinds for k, _ in kinds)

    def layer_kinds(self, arch: Any) -> Optional[List[Tuple[str, int]]]:
        """Kinds of blocks and how many of each, when they differ (see Architecture.layer_kinds)."""
        return arch.layer_kinds

    def layer_order(self, arch: Any) -> Optional[List[str]]:
        """The kind of each layer, by index (None when every block is alike):
        ``Architecture.layer_order``, else the kinds of ``layer_kinds`` in the order listed."""
        if arch.layer_order:
            return list(arch.layer_order)
        kinds = self.layer_kinds(arch)
        if not kinds:
            return None
        return [kind for kind, count in kinds for _ in range(count)]

    def tower_tokens(self, arch: Any, tower: str, setup: Any) -> int:
        """Tokens one side tower processes per sample (a vision tower: images x patches)."""
        return 0

    def tower_attention_layout(self, images: int, patches: int, setup: Any) -> Tuple[int, int]:
        """How this tower's attention sees ``images`` images of ``patches`` patches each:
        (sequences, tokens per sequence).  Default: one sequence per image."""
        return images, patches

    def tower_layer_layouts(self, arch: Any, images: int, patches: int, setup: Any
                            ) -> List[Tuple[Tuple[int, int], int]]:
        """The attention layouts of this tower's layers and how many layers use each:
        [((sequences, tokens per sequence), layers)].  Default: every layer one layout."""
        return [(self.tower_attention_layout(images, patches, setup), arch.num_layers)]

    def tower_saved_once(self, arch: Any, images: int, patches: int, setup: Any, backend: str, dtype: str
                         ) -> List[Tuple[str, float, str]]:
        """Tensors this tower saves once for all its blocks (name, bytes, formula): none by default."""
        return []

    # -- training trace ---------------------------------------------------------------
    def block(self, tr: Any, ctx: Any, x: Any) -> Any:
        """One block's forward; records the tensors autograd saves in ``tr``."""
        raise NotImplementedError

    def final_norm(self, tr: Any, ctx: Any, x: Any) -> Any:
        """The norm between the last block and the output head."""
        raise NotImplementedError

    def reads_encoder(self, tensor: Any) -> bool:
        """A decoder block's parameter that runs over the encoder's tokens, not the target's
        (an encoder-decoder's cross-attention k and v projections): none by default."""
        return False

    def head_saved(self, arch: Any, T: int, full: bool) -> List[Tuple[str, float, str]]:
        """Extra tensors saved outside the blocks (name, bytes, formula): none by default."""
        return []

    # -- inference working sets -------------------------------------------------------
    def inference_mlp(self, arch: Any, T: int, c: float) -> List[Tuple[str, float, str]]:
        """Live tensors of a dense MLP during an inference forward of T tokens (c bytes)."""
        raise NotImplementedError


def register(cls: Type[Family]) -> Type[Family]:
    """Class decorator: make ``cls`` the family of its ``model_types`` (and aliases)."""
    inst = cls()
    for mt in cls.model_types:
        REGISTRY[mt] = inst
    for al in cls.aliases:
        ALIASES[al] = cls.model_types[0]
    return cls


def register_tower(cls: Type[Family]) -> Type[Family]:
    """Class decorator: a tower family (a VLM's vision encoder), found by ``family_for`` but not
    a supported model type of its own."""
    inst = cls()
    for mt in cls.model_types:
        TOWERS[mt] = inst
    return cls


def supported_model_types() -> Tuple[str, ...]:
    """Every model_type with an analytic family, in registration order."""
    return tuple(REGISTRY)


def resolve_model_type(mt: str) -> str:
    """A config's model_type, aliases resolved (``gemma3`` -> its registered type)."""
    return ALIASES.get(mt, mt)


def family_for(mt: str) -> Family:
    """The family registered for ``mt``; a VramError listing the supported types otherwise."""
    fam = REGISTRY.get(resolve_model_type(mt)) or TOWERS.get(mt)
    if fam is None:
        raise VramError(f"config: model_type {shown(mt)} is not supported; supported: "
                        + ", ".join(supported_model_types()), field="model_type")
    return fam


def head_dim_notes(arch: Any) -> List[str]:
    """A config with no ``head_dim`` whose heads do not divide the hidden size: transformers
    floors the division (``blocks.dims``), so the attention is narrower than the hidden size.
    Legal, as transformers builds it; said because it is rarely what a config's author meant."""
    cfg = getattr(arch, "config", None) or {}
    h, a, d = arch.hidden_size, arch.num_heads, arch.head_dim
    if cfg.get("head_dim") is not None or not a or h % a == 0 or d != h // a:
        return []
    return [f"warning: num_attention_heads ({a:,}) does not divide hidden_size ({h:,}) and the config gives no "
            f"head_dim: head_dim = {h:,} // {a:,} = {d:,}, as transformers computes it (q_proj has {a * d:,} "
            f"outputs, not {h:,})"]

