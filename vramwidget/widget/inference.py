"""The inference panel: estimate_inference()'s keyword arguments, the weight formats compared,
the phase chart's rows for generate() / serving, and the inference summary (KV cache,
serving budget, longest context)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..show import charts
from .. import gpus
from ..result import Estimate
from ..show.treemap import fmt_gib
from ..units import GIB
from ..fit.verdict import capacity_bytes
from ..fit.verdict import fits as judge_fits
from .state import INFERENCE_KEYWORDS

#: the comparison in inference mode: the same context and batch in three weight formats
INFERENCE_SCENARIOS: Tuple[Tuple[str, Dict[str, Any]], ...] = (
    ("BF16", dict(weights="bf16")),
    ("8-bit (int8)", dict(weights="int8")),
    ("4-bit (NF4)", dict(weights="nf4")),
    ("4-bit (AWQ)", dict(weights="awq-4bit")),
)
_KV_LABELS = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "fp8": "fp8 (E4M3, 1 byte)"}

#: how each phase of an inference estimate is called on the phase chart
_INFERENCE_PHASE_LABELS: Dict[str, str] = {
    "after_load": "after load",
    "prefill": "prefill",
    "decode": "decode",
    "profile": "profiling forward",
    "serving": "serving (KV pool full)",
}


def _short(text: str) -> str:
    """The first clause of a format's description ('bitsandbytes 4-bit NF4')."""
    return text.split(":")[0].split(";")[0].strip()


#: the engine drop-down
ENGINE_LABELS = (("hf", "generate() (transformers)"), ("vllm", "vLLM server"), ("sglang", "SGLang server"))


def inference_options() -> Dict[str, Any]:
    """The weights, KV-cache and engine drop-downs' [value, label] pairs."""
    from ..inference.estimate import KV_CACHE_DTYPES, WEIGHT_FORMATS

    return {
        "weights": [[k, f"{k}: {_short(v)}"] for k, v in WEIGHT_FORMATS.items()],
        "kv_cache_dtype": [["auto", "auto (the compute dtype)"]] + [
            [k, _KV_LABELS.get(k, k)] for k in KV_CACHE_DTYPES],
        "engine": [list(x) for x in ENGINE_LABELS],
    }


class InferencePanel:
    """Inference: generate() or a serving budget."""

    def inference_setup(self) -> Dict[str, Any]:
        """The keyword arguments estimate_inference() gets in inference mode (``gpu`` when a
        known GPU is chosen; ``gpu_memory_utilization`` when set)."""
        kw = {k: getattr(self, k) for k in INFERENCE_KEYWORDS}
        if kw["prompt_len"] is None or kw["prompt_len"] >= kw["context_len"]:
            del kw["prompt_len"]                        # the whole context is the prompt
        if kw["gpu_memory_utilization"] is None:
            del kw["gpu_memory_utilization"]
        if kw["engine"] == "sglang":
            kw.pop("gpu_memory_utilization", None)      # SGLang's budget is mem_fraction_static
        if kw["engine"] == "hf":
            del kw["engine"]                            # the default: generate()
        # the GPUs of one replica: tensor_parallel x pipeline_parallel (the traits training uses too)
        for name in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) != 1:
                kw[name] = getattr(self, name)
        gpu = self._gpu_or_none()
        if gpu is not None:
            kw["gpu"] = gpu.name
        return kw

    def _link_inference(self, name: Optional[str], new: Any) -> None:
        """A serving budget means a serving engine; generate() has none."""
        if name == "gpu_memory_utilization" and new is not None and self.engine == "hf":
            self.engine = "vllm"
        elif name == "gpu_memory_utilization" and new is None and self.engine == "vllm":
            self.engine = "hf"                          # a blank budget is generate()
        elif name == "engine" and new == "hf":
            self.gpu_memory_utilization = None
        elif name == "engine" and new == "vllm" and self.gpu_memory_utilization is None:
            self.gpu_memory_utilization = 0.9

    def _serving_extras(self, arch: Any, kw: Dict[str, Any]) -> Dict[str, Any]:
        """The largest max_model_len that starts and a copyable command (cached per setup)."""
        from ..inference.engines import startable_command
        from ..inference.estimate import InferenceSetup

        def work() -> Dict[str, Any]:
            s = InferenceSetup.from_kwargs(**kw)
            command, why, largest = startable_command(arch, s, gpus.get_gpu(s.gpu), arch.hub_id or arch.name)
            return {"largest_max_model_len": largest, "command": command, "command_note": why}

        return self._answer(("serve", self._key("infer", kw)), work)

    def _summary_inference(self, est: Any, arch: Any, gpu: Optional[gpus.GPU], kw: Dict[str, Any],
                           skipped: List[str]) -> Dict[str, Any]:
        """Inference: the KV cache (per token and in total), weights, the serving budget and
        the longest context that fits the GPU."""
        from ..inference.estimate import MAX_SEARCH_TOKENS

        fits = (bool(est.fits) if est.fits is not None else judge_fits(est.device_total_bytes, capacity_bytes(gpu))) \
            if gpu is not None else None
        out = self._base_summary(est, arch, gpu, skipped, fits, _INFERENCE_PHASE_LABELS)
        longest = self._longest(arch, gpu, kw) if gpu is not None else None
        limit = getattr(arch, "max_position_embeddings", None)
        by_model = bool(longest and limit and longest >= limit)
        if by_model:
            longest = limit   # the model's position limit binds before the memory does
        serving = est.serving
        # the requested sequences' own cache (batch x context tokens); under a serving
        # budget kv_cache_bytes is the engine's whole pool, which is said apart
        if serving:
            # the engine's block-rounded bytes per sequence (per GPU), times the batch
            requested = float(serving.get("bytes_per_sequence") or 0.0) * int(est.setup.get("batch_size") or 1)
        else:
            requested = est.kv_cache_bytes
        inf = {
            "weights": est.setup.get("weights"),
            "kv_cache_dtype": est.setup.get("kv_cache_dtype"),
            "weights_gib": est.weights_bytes / GIB,
            "kv_bytes_per_token": est.kv_bytes_per_token,
            "kv_cache_bytes": est.kv_cache_bytes,
            "kv_cache_gib": est.kv_cache_bytes / GIB,
            "kv_cache_prefill_gib": est.kv_cache_prefill_bytes / GIB,
            "context_len": est.setup.get("context_len"),
            "batch_size": est.setup.get("batch_size"),
            "kv_requested_bytes": requested,
            "kv_pool_bytes": (serving.get("kv_budget_bytes") or est.kv_cache_bytes) if serving else None,
            "kv_pool_tokens": serving.get("kv_tokens") if serving else None,
            "longest_context": longest,
            "longest_context_capped": bool(longest) and longest >= MAX_SEARCH_TOKENS,
            "longest_context_by_model": by_model,
            "max_position_embeddings": getattr(arch, "max_position_embeddings", None),
            "serving": dict(serving) if serving else None,
            "prompt_len": est.setup.get("prompt_len"),
            # what the estimate assumes: the weight format, the transformers (or engine) behaviour
            "assumes": getattr(est, "assumes", ""),
            "allocator_note": est.allocator_note if gpu is not None else "",
        }
        if serving:
            inf["serving"].update(self._serving_extras(arch, kw))
        out["inference"] = inf
        text = (f"peak {fmt_gib(est.peak_allocated_bytes)} allocated at {out['peak_phase_label']}; "
                f"device total {fmt_gib(est.device_total_bytes)}; KV cache "
                f"{est.kv_bytes_per_token / 1024:g} KiB per token, {fmt_gib(est.kv_cache_bytes)} in all")
        if gpu:
            text += f"; {'fits' if fits else 'does not fit'} {gpu.name} ({capacity_bytes(gpu) / GIB:.1f} GiB CUDA total)"
            if inf["allocator_note"]:
                text += f" ({inf['allocator_note']})"
            if longest is not None:
                text += f"; longest context that fits {gpu.name}: {longest:,} tokens"
        if inf["assumes"]:
            text += f"; assumes {inf['assumes']}"
        out["text"] = text
        return out

    def _longest(self, arch: Any, gpu: gpus.GPU, kw: Dict[str, Any]) -> Optional[int]:
        """inference.longest_context for the setup (every field but the context)."""
        from ..inference.estimate import longest_context

        rest = {k: v for k, v in kw.items() if k not in ("context_len", "gpu")}
        # a search over allocator replays: the worker's job (None until it is done)
        return self._answer_later(("longest", self._key("infer", rest), gpu.name),
                                  lambda: longest_context(arch, gpu.name, **rest))


def inference_phase_rows(est: Estimate, *, capacity_bytes: Optional[float] = None,
                          capacity_label: str = "") -> List[Dict[str, Any]]:
    """The phase chart's rows for an inference estimate (after load, prefill, decode; or
    after load, profiling forward, serving): :func:`charts.phase_rows` on the same measure
    (device total at the peak, allocated as a tick)."""
    return charts.phase_rows(est, capacity_bytes=capacity_bytes, capacity_label=capacity_label,
                             phases=list(est.phases_bytes), labels=_INFERENCE_PHASE_LABELS)
