"""One inference run's settings, validated (:class:`InferenceSetup`), and the choices they take."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from ..model.architecture import Architecture
from ..errors import VramError
from ..inputs import MAX_GPUS, check_bool, check_int, check_keywords, check_number, check_text, shown
from ..units import canonical_dtype
from .weights import canonical_weights_format, format_kind, weight_storage

KV_CACHE_DTYPES = ("bf16", "fp16", "fp32", "fp8")
ENGINES = ("hf", "vllm", "sglang")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
MLA_CACHE_CHOICES = ("compressed", "decompressed")
LOGITS_CHOICES = ("last", "all")

#: vLLM's KV-cache block (page) size in tokens
BLOCK_SIZE = 16
#: the page sizes vLLM accepts (vllm/config/cache.py ``BlockSize = Literal[1, 8, 16, 32, 64,
#: 128, 256]``; older releases stop at 128)
VLLM_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
#: vLLM defaults used for serving (both are parameters)
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class InferenceSetup:
    """One inference run's configuration (validated by :meth:`from_kwargs`)."""

    weights: str = "bf16"
    dtype: str = "bfloat16"              # activations / 16-bit parts (compute dtype)
    group_size: int = 128                # GPTQ/AWQ group (-1: one group per column, GPTQ only)
    double_quant: bool = False           # bitsandbytes 4-bit (BitsAndBytesConfig default: off)
    kv_cache_dtype: str = "bfloat16"
    batch_size: int = 1
    context_len: int = 4096
    prompt_len: int = 4096
    attn_implementation: str = "sdpa"
    mla_cache: str = "compressed"
    use_sliding_window: bool = True
    logits: str = "last"
    gpu: Optional[str] = None
    gpu_memory_utilization: Optional[float] = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: Optional[int] = None   # None: the engine's default for the release
    block_size: int = BLOCK_SIZE
    engine: str = "hf"                   # "hf" (generate()), "vllm" or "sglang"
    versions: Dict[str, str] = field(default_factory=dict)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: int = 1
    enforce_eager: bool = False
    enable_chunked_prefill: Optional[bool] = None
    mem_fraction_static: Optional[float] = None
    disable_custom_all_reduce: bool = False
    #: the caching allocator's settings for generate()'s replay: "default", "expandable_segments"
    #: or a PYTORCH_CUDA_ALLOC_CONF string (allocator.parse_alloc_conf)
    allocator: str = "default"
    #: ``generate(min_new_tokens=...)``: with an EOS token, two logits processors copy the
    #: scores every step (generate_ops.sample)
    min_new_tokens: int = 0
    #: the batch's attention mask masks some positions (padded prompts, or a prompt holding
    #: ``pad_token_id`` when generate() infers the mask): a (b, 1, q, kv) mask is built, and
    #: SDPA repeats K/V to every head and runs its memory-efficient kernel
    padding: bool = False

    FIELDS = ("weights", "dtype", "group_size", "double_quant", "kv_cache_dtype", "batch_size", "context_len",
              "prompt_len", "attn_implementation", "mla_cache", "use_sliding_window", "logits", "gpu",
              "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "block_size", "engine",
              "versions", "tensor_parallel", "pipeline_parallel", "data_parallel", "expert_parallel",
              "enforce_eager", "enable_chunked_prefill", "mem_fraction_static", "disable_custom_all_reduce",
              "allocator", "min_new_tokens", "padding")

    @property
    def serving(self) -> bool:
        """A serving engine (vLLM, SGLang) sizes a paged KV cache instead of generate()."""
        return self.engine in ("vllm", "sglang")

    @property
    def chunked_prefill_set(self) -> bool:
        return self.enable_chunked_prefill is not None and bool(self.enable_chunked_prefill)

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def fmt_kind(self) -> str:
        """The weights format's storage family (:func:`~vramwidget.inference.weights.format_kind`)."""
        return format_kind(self.weights)

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        return {k: getattr(self, k) for k in self.FIELDS}

    def stored_weights_bytes(self, arch: Architecture) -> float:
        """Bytes of ``arch``'s weights + quantization constants as this setup's weight format
        stores them on the GPU (:func:`weight_storage`; ``engines.plan`` prices a GPU's share
        with it)."""
        return sum(x.weight_bytes + x.const_bytes for x in weight_storage(arch, self))

    @classmethod
    def from_kwargs(cls, **kw: Any) -> "InferenceSetup":
        check_keywords("inference setting", kw, cls.FIELDS)
        for name in ("weights", "dtype", "kv_cache_dtype", "attn_implementation", "mla_cache", "logits", "engine"):
            if kw.get(name) is not None:
                check_text(name, kw[name], max_chars=64, what="must be a name (text)")
        v: Dict[str, Any] = {}
        w = kw.get("weights")
        v["weights"] = canonical_weights_format(w if w is not None else "bf16")
        kind = cls(weights=v["weights"]).fmt_kind
        d = kw.get("dtype")
        if v["weights"] in ("bf16", "fp16", "fp32"):
            natural = canonical_dtype(v["weights"])
            if d is not None and _dtype16("dtype", d, allow32=True) != natural:
                raise VramError(f"dtype: {v['weights']} weights compute in {natural}; leave dtype unset or use "
                                f"another weights format", field="dtype")
            v["dtype"] = natural
        else:
            default = "float16" if kind in ("gptq", "awq") else "bfloat16"
            v["dtype"] = _dtype16("dtype", d, allow32=False) if d is not None else default
        if kw.get("group_size") is not None:
            g = check_int("group_size", kw["group_size"], lo=1, also=(-1,),
                          what="must be a positive whole number (or -1 for GPTQ's one group per column)")
            if int(g) == -1 and kind == "awq":
                raise VramError("group_size: AWQ needs a positive group size (e.g. 128); -1 is GPTQ-only",
                                field="group_size")
            v["group_size"] = int(g)
        if kw.get("double_quant") is not None:
            check_bool("double_quant", kw["double_quant"])
            v["double_quant"] = kw["double_quant"]
        kvd = kw.get("kv_cache_dtype")
        if kvd is None or (isinstance(kvd, str) and kvd.strip().lower() == "auto"):
            v["kv_cache_dtype"] = v["dtype"]
        else:
            key = str(kvd).strip().lower()
            try:
                cd = canonical_dtype(key)
            except KeyError:
                cd = None
            if cd not in ("bfloat16", "float16", "float32", "float8"):
                raise VramError(f"kv_cache_dtype: unknown {shown(kvd)}; allowed: {', '.join(KV_CACHE_DTYPES)} (or auto: "
                                f"the compute dtype)", field="kv_cache_dtype")
            v["kv_cache_dtype"] = cd
        for name in ("batch_size", "context_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if kw.get(name) is not None:
                v[name] = _posint(name, kw[name])
        if v.get("block_size", BLOCK_SIZE) not in VLLM_BLOCK_SIZES:
            raise VramError(f"block_size: a vLLM KV cache page is one of {', '.join(map(str, VLLM_BLOCK_SIZES))} tokens "
                            f"(vllm/config/cache.py BlockSize), got {shown(v['block_size'])}", field="block_size")
        ctx = v.get("context_len", cls.context_len)
        if kw.get("prompt_len") is not None:
            p = _posint("prompt_len", kw["prompt_len"])
            if p > ctx:
                raise VramError(f"prompt_len: the prompt ({p} tokens) cannot be longer than context_len ({ctx}): "
                                f"context_len counts prompt and generated tokens", field="prompt_len")
            v["prompt_len"] = p
        else:
            v["prompt_len"] = ctx
        for name, allowed in (("attn_implementation", ATTN_IMPLEMENTATIONS), ("mla_cache", MLA_CACHE_CHOICES),
                              ("logits", LOGITS_CHOICES)):
            if kw.get(name) is not None:
                val = str(kw[name]).strip().lower()
                if val == "flash_attention" or val == "fa2":
                    val = "flash_attention_2"
                if val not in allowed:
                    raise VramError(f"{name}: unknown {shown(kw[name])}; allowed: {', '.join(allowed)}", field=name)
                v[name] = val
        if kw.get("use_sliding_window") is not None:
            check_bool("use_sliding_window", kw["use_sliding_window"])
            v["use_sliding_window"] = kw["use_sliding_window"]
        g = kw.get("gpu")
        if g is not None and g != "":
            from ..gpus import get_gpu

            v["gpu"] = get_gpu(g).name
        for name in ("gpu_memory_utilization", "mem_fraction_static"):
            u = kw.get(name)
            if u is not None:
                check_number(name, u, lo=0, hi=1, lo_open=True, what="must be a fraction in (0, 1], e.g. 0.9")
                if v.get("gpu") is None:
                    raise VramError(f"{name}: a serving budget needs a GPU (set gpu, e.g. 'H100-80GB')",
                                    field="gpu")
                v[name] = float(u)
        eng = kw.get("engine")
        if eng is None or eng == "":
            eng = ("sglang" if v.get("mem_fraction_static") is not None
                   else "vllm" if v.get("gpu_memory_utilization") is not None else "hf")
        eng = str(eng).strip().lower()
        eng = {"transformers": "hf", "generate": "hf", "huggingface": "hf"}.get(eng, eng)
        if eng not in ENGINES:
            raise VramError(f"engine: unknown {shown(kw.get('engine'))}; allowed: {', '.join(ENGINES)}", field="engine")
        v["engine"] = eng
        if eng == "hf" and v.get("gpu_memory_utilization") is not None:
            raise VramError("engine: generate() ('hf') has no gpu_memory_utilization; use engine='vllm'",
                            field="engine")
        if eng in ("vllm", "sglang") and v.get("gpu") is None:
            raise VramError(f"gpu: the {eng} engine sizes its KV cache from a GPU's memory (set gpu, e.g. "
                            f"'H100-80GB')", field="gpu")
        if eng == "sglang" and v.get("gpu_memory_utilization") is not None:
            raise VramError("gpu_memory_utilization: the sglang engine's budget is mem_fraction_static", field="engine")
        if eng == "vllm" and v.get("mem_fraction_static") is not None:
            raise VramError("mem_fraction_static: that is the sglang engine's setting; the vllm engine uses "
                            "gpu_memory_utilization", field="engine")
        ver = kw.get("versions")
        if ver is not None:
            if isinstance(ver, str):
                ver = {eng if eng != "hf" else "vllm": ver}
            if not isinstance(ver, dict):
                raise VramError(f"versions: a dict like {{'vllm': '0.6.4'}}, got {shown(ver)}", field="versions")
            from .engines import check_release, parse_version

            for k2, val in ver.items():
                if k2 not in ("vllm", "vllm_runtime", "sglang", "transformers"):
                    raise VramError(f"versions: unknown key {shown(k2)}; allowed: vllm, vllm_runtime (v0 or v1), "
                                    f"sglang, transformers", field="versions")
                if k2 in ("vllm", "sglang"):
                    check_release(k2, val)
                elif k2 != "vllm_runtime":
                    parse_version(val)
            if "vllm" in ver or "vllm_runtime" in ver:
                from .engines import vllm_release

                vllm_release(ver.get("vllm"), ver.get("vllm_runtime"))
            v["versions"] = {str(k2): str(val) for k2, val in ver.items()}
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel", "expert_parallel"):
            if kw.get(name) is not None:   # GPUs of one deployment: at most inputs.MAX_GPUS
                v[name] = check_int(name, kw[name], lo=1, hi=MAX_GPUS)
        for name in ("enforce_eager", "disable_custom_all_reduce", "enable_chunked_prefill"):
            if kw.get(name) is not None:
                v[name] = check_bool(name, kw[name])
        if kw.get("allocator") is not None:
            from ..training import check_allocator_conf

            v["allocator"] = check_allocator_conf(kw["allocator"])
        if kw.get("min_new_tokens") is not None:
            v["min_new_tokens"] = check_int("min_new_tokens", kw["min_new_tokens"], lo=0)
        if kw.get("padding") is not None:
            v["padding"] = check_bool("padding", kw["padding"])
        return cls(**v)


def _dtype16(name: str, value: Any, allow32: bool) -> str:
    try:
        d = canonical_dtype(str(value))
    except KeyError:
        d = None
    ok = ("bfloat16", "float16") + (("float32",) if allow32 else ())
    if d not in ok:
        raise VramError(f"{name}: must be one of {', '.join(ok)}, got {shown(value)}", field=name)
    return d


def _posint(name: str, value: Any) -> int:
    return check_int(name, value, lo=1)
