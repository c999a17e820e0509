"""Units and element sizes. Bytes internally; GiB (2**30) in the UI, GB (10**9) on request."""

from __future__ import annotations

KIB = 2**10
MIB = 2**20
GIB = 2**30
GB = 10**9

#: CUDA context (not in torch's allocated memory; nvidia-smi shows it): measured 620.8 MiB
#: on the H200 (driver for CUDA 13); 300-700 MiB across GPUs and drivers.  Here, not in
#: estimate.py, so that the GPU catalogue can use it without importing the estimator.
CUDA_CONTEXT_BYTES = 620.8 * MIB

#: bytes per element of each storage dtype we model
DTYPE_BYTES = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "float8": 1.0,
    "int8": 1.0,
    "uint8": 1.0,
    "nf4": 0.5,
    "fp4": 0.5,
    "int64": 8.0,
}

DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "f32": "float32", "torch.float32": "float32",
    "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "fp16": "float16", "half": "float16", "f16": "float16", "torch.float16": "float16",
    "fp8": "float8", "float8_e4m3fn": "float8", "e4m3": "float8",
    "int4": "nf4",
}


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16'; raises KeyError on unknown names (callers wrap it)."""
    key = str(name).strip().lower()
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise KeyError(name)
    return key


def dtype_bytes(name: str) -> float:
    """Bytes per element of a dtype name ('bf16' -> 2.0)."""
    return DTYPE_BYTES[canonical_dtype(name)]


def to_mib(nbytes: float) -> float:
    """Bytes in MiB (2**20)."""
    return nbytes / MIB


def to_gib(nbytes: float) -> float:
    """Bytes in GiB (2**30)."""
    return nbytes / GIB


def to_gb(nbytes: float) -> float:
    """Bytes in GB (10**9)."""
    return nbytes / GB
