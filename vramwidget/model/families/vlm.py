"""Vision-language models (image-text-to-text): a text decoder family, a vision tower
(:mod:`.vision`) and a projector, counted as the ``...ForConditionalGeneration`` class a user
fine-tunes (``task="image_text_to_text"``).

The Architecture's shape numbers, config and block trace are the text decoder's; the vision
tower is a side tower (``Architecture.towers["vision"]``) whose blocks are traced at their
own token count: ``images_per_sample`` images of ``image_patches`` patches each (default:
the tower's own resolution).  The text sequence (``seq_len``) includes the image tokens the
projector produces.  Parameter names follow transformers 5 (``model.language_model.``,
``model.vision_tower.`` / ``model.visual.``, ``model.multi_modal_projector.``, ``lm_head``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .base import REGISTRY, TOWERS, Family, register
from .blocks import ParamBuilder, config_get, required_count
from ...errors import VramError


class VisionLanguage(Family):
    """Base: compose ``text_type``'s and ``vision_type``'s families and add the projector."""

    task = "image_text_to_text"
    tasks = ("image_text_to_text",)
    reads_text_config = True
    text_type: str = ""
    vision_type: str = ""
    #: the multimodal model ties lm_head to the text embeddings when the config does not say
    default_tie: bool = False

    @property
    def text(self) -> Family:
        return REGISTRY[self.text_type]

    @property
    def vision(self) -> Family:
        return TOWERS[self.vision_type]

    def text_config(self, cfg: Mapping[str, Any]) -> Dict[str, Any]:
        """The decoder's config (``text_config``, or the top level of an old flat config)."""
        tc = cfg.get("text_config")
        if isinstance(tc, Mapping):
            out = dict(tc)
        else:
            out = {k: v for k, v in cfg.items() if k not in ("vision_config", "model_type")}
        out["model_type"] = self.text_type
        if "tie_word_embeddings" in cfg:
            out["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        else:
            out.setdefault("tie_word_embeddings", self.default_tie)
        return out

    def vision_config(self, cfg: Mapping[str, Any]) -> Dict[str, Any]:
        """The vision tower's config (``vision_config``)."""
        vc = cfg.get("vision_config")
        if not isinstance(vc, Mapping):
            raise VramError(f"config: {self.model_types[0]} needs a 'vision_config' (the vision tower)",
                            field="vision_config")
        return dict(vc)

    def projector(self, b: ParamBuilder, cfg: Mapping[str, Any], vcfg: Mapping[str, Any], h_text: int) -> None:
        """The projector's tensors (top level, vision group)."""
        raise NotImplementedError

    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        """The decoder's tensors, the tower's (each block's instance its own) and the
        projector's; ``towers`` holds the tower's own architecture as keyword arguments of
        :class:`~vramwidget.model.architecture.Architecture` (architecture.from_config builds it)."""
        tcfg = self.text_config(cfg)
        info = self.text.params(tcfg, self.text_type)
        tensors = [replace(t, name="model.language_model." + t.name[len("model."):]) if t.name.startswith("model.")
                   else t for t in info["tensors"]]
        vcfg = self.vision_config(cfg)
        vinfo = self.vision.params(vcfg, self.vision_type)
        vision = dict(vinfo, name=f"{mt} vision tower", model_type=self.vision_type, config=vcfg)
        vt = [replace(t, tower="vision", layers=None) for t in vinfo["tensors"]]
        pb = ParamBuilder(1)
        self.projector(pb, cfg, vcfg, info["hidden_size"])
        vt += [replace(t, tower="vision") for t in pb.tensors]
        info = dict(info)
        info["tensors"] = tensors + vt
        info["towers"] = {"vision": vision}
        info["text_config"] = tcfg
        return info

    # -- the decoder is the text family's ---------------------------------------------
    def block(self, tr: Any, ctx: Any, x: Any) -> Any:
        return self.text.block(tr, ctx, x)

    def final_norm(self, tr: Any, ctx: Any, x: Any) -> Any:
        return self.text.final_norm(tr, ctx, x)

    def head_saved(self, arch: Any, T: int, full: bool) -> List[Tuple[str, float, str]]:
        return self.text.head_saved(arch, T, full)

    def inference_mlp(self, arch: Any, T: int, c: float) -> List[Tuple[str, float, str]]:
        return self.text.inference_mlp(arch, T, c)

    def layer_kinds(self, arch: Any) -> Optional[List[Tuple[str, int]]]:
        return self.text.layer_kinds(arch)

    def layer_order(self, arch: Any) -> Optional[List[str]]:
        return self.text.layer_order(arch)

    def trace_key(self, arch: Any, setup: Any) -> Any:
        return self.text.trace_key(arch, setup)

    def tower_tokens(self, arch: Any, tower: str, setup: Any) -> int:
        """images_per_sample x patches per image (``image_patches``, or the tower's own)."""
        if tower != "vision" or not setup.images_per_sample:
            return 0
        v = arch.towers["vision"]
        patches = setup.image_patches or self.vision.patches(v.config)
        return setup.images_per_sample * patches

    def notes(self, arch: Any) -> List[str]:
        v = arch.towers.get("vision")
        return [f"{arch.model_type}: the vision tower's activations count when images_per_sample > 0 (each image "
                f"{self.vision.patches(v.config) if v is not None else '?'} patches by default; image_patches "
                f"overrides); seq_len includes the image tokens"]


@register
class Gemma3(VisionLanguage):
    model_types = ("gemma3",)
    tasks = ("image_text_to_text",)
    text_type = "gemma3_text"
    vision_type = "siglip_vision_model"
    default_tie = True
    gguf_arch = "gemma3"
    sdpa_supported = True

    def vision_config(self, cfg: Mapping[str, Any]) -> Dict[str, Any]:
        """SigLIP without the pooling head unless the config asks for it."""
        vc = VisionLanguage.vision_config(self, cfg)
        vc.setdefault("vision_use_head", False)   # Gemma3Config's default vision config has no head
        return vc

    def projector(self, b: ParamBuilder, cfg: Mapping[str, Any], vcfg: Mapping[str, Any], h_text: int) -> None:
        hv = required_count(vcfg, "vision hidden size", "hidden_size")
        b.top("model.multi_modal_projector.mm_input_projection_weight", (hv, h_text), "mlp_up",
              "mm_input_projection")
        b.top("model.multi_modal_projector.mm_soft_emb_norm.weight", (hv,), "norm", "mm_soft_emb_norm")


@register
class Mistral3(VisionLanguage):
    model_types = ("mistral3",)
    text_type = "mistral"
    vision_type = "pixtral"
    default_tie = True     # Mistral3Config.tie_word_embeddings defaults to true

    def projector(self, b: ParamBuilder, cfg: Mapping[str, Any], vcfg: Mapping[str, Any], h_text: int) -> None:
        hv = required_count(vcfg, "vision hidden size", "hidden_size")
        m = int(config_get(cfg, "spatial_merge_size", default=2) or 2)
        bias = bool(config_get(cfg, "multimodal_projector_bias", default=False))
        layer = cfg.get("vision_feature_layer", -1)
        n_feat = len(layer) if isinstance(layer, list) else 1
        P = "model.multi_modal_projector."
        b.top(P + "norm.weight", (hv,), "norm", "norm")
        b.top(P + "patch_merger.merging_layer.weight", (hv, hv * m * m), "mlp_up", "merging_layer")
        b.top(P + "linear_1.weight", (h_text, hv * n_feat), "mlp_up", "linear_1")
        if bias:
            b.top(P + "linear_1.bias", (h_text,), "mlp_up", "linear_1")
        b.top(P + "linear_2.weight", (h_text, h_text), "mlp_down", "linear_2")
        if bias:
            b.top(P + "linear_2.bias", (h_text,), "mlp_down", "linear_2")


@register
class Qwen25VL(VisionLanguage):
    model_types = ("qwen2_5_vl",)
    text_type = "qwen2"
    vision_type = "qwen2_5_vl_vision"

    def vision_config(self, cfg: Mapping[str, Any]) -> Dict[str, Any]:
        """The merger projects to the decoder's width (``out_hidden_size``)."""
        vc = VisionLanguage.vision_config(self, cfg)
        tc = cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else cfg
        vc.setdefault("out_hidden_size", tc.get("hidden_size"))
        return vc

    def projector(self, b: ParamBuilder, cfg: Mapping[str, Any], vcfg: Mapping[str, Any], h_text: int) -> None:
        pass   # the merger is part of the vision tower (model.visual.merger)

    def text_config(self, cfg: Mapping[str, Any]) -> Dict[str, Any]:
        tc = VisionLanguage.text_config(self, cfg)
        tc.pop("rope_scaling", None)   # mrope sections change no shapes
        return tc
