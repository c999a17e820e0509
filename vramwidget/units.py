"""Units and element sizes. Bytes internally; GiB (2**30) in the UI, GB (10**9) on request."""

from __future__ import annotations

KIB = 2**10
MIB = 2**20
GIB = 2**30
TIB = 2**40
GB = 10**9

#: CUDA context (not in torch's allocated memory; nvidia-smi shows it): measured 620.8 MiB
#: on the H200 (driver for CUDA 13); 270-700 MiB across GPUs and drivers.  What an estimate
#: made without a GPU counts (vramwidget.estimate re-exports it); on a chosen card the card's
#: own figure counts instead (gpus.context_for, by generation: data/gpus.json cuda_context).
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


def fmt_bytes(nbytes: float) -> str:
    """Bytes with an automatic binary unit and thousands separators, the one format of the
    widget, the notebooks and the CLI: '512 KiB', '612 MiB', '9.96 GiB', '23.5 GiB',
    '1,234 GiB', '2.10 TiB'.  Three significant digits from 1 GiB; whole MiB below."""
    b = float(nbytes)
    sign = "-" if b < 0 else ""
    b = abs(b)
    if b >= TIB:
        t = b / TIB
        return f"{sign}{t:,.0f} TiB" if t >= 100 else f"{sign}{t:.1f} TiB" if t >= 10 else f"{sign}{t:.2f} TiB"
    if b >= GIB:
        g = b / GIB
        return f"{sign}{g:,.0f} GiB" if g >= 100 else f"{sign}{g:.1f} GiB" if g >= 10 else f"{sign}{g:.2f} GiB"
    if b >= MIB:
        return f"{sign}{b / MIB:,.0f} MiB"
    if b >= KIB:
        return f"{sign}{b / KIB:,.0f} KiB"
    return f"{sign}{b:,.0f} B"
