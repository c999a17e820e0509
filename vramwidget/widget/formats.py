"""The number-format panel: the bits, range and precision of each storage dtype (the seeds'
FP32 / BF16 / FP16 comparison), as rows the frontend draws."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

def _float_format(name: str, exp_bits: int, man_bits: int, *, max_value: Optional[float] = None,
                  note: str = "") -> Dict[str, Any]:
    bias = 2 ** (exp_bits - 1) - 1
    if max_value is None:  # IEEE-style: the top exponent is reserved for inf/nan
        max_value = (2 - 2.0 ** -man_bits) * 2.0 ** bias
    min_normal = 2.0 ** (1 - bias)
    return {
        "name": name, "bits": 1 + exp_bits + man_bits, "bytes": (1 + exp_bits + man_bits) / 8,
        "sign": 1, "exponent": exp_bits, "mantissa": man_bits,
        "max": max_value, "min_normal": min_normal,
        "min_subnormal": min_normal * 2.0 ** -man_bits,
        "epsilon": 2.0 ** -man_bits,
        "decimal_digits": round(math.log10(2.0 ** (man_bits + 1)), 1),
        "note": note,
    }


def number_formats() -> List[Dict[str, Any]]:
    """FP32, BF16, FP16, FP8 (E4M3, E5M2), INT8 and NF4: bits, range and precision.

    ``epsilon`` is the gap between 1 and the next number (2^-mantissa); ``max`` and
    ``min_normal`` bound the range; E4M3 follows the OCP "fn" variant (no inf, max 448).
    """
    return [
        _float_format("FP32", 8, 23, note="full precision; master weights and Adam moments in mixed precision"),
        _float_format("BF16", 8, 7, note="FP32's range with 8 bits of precision: no loss scaling needed"),
        _float_format("FP16", 5, 10, note="more precision than BF16 but max 65504: needs loss scaling"),
        _float_format("FP8 E4M3", 4, 3, max_value=448.0, note="forward activations/weights in FP8 training"),
        _float_format("FP8 E5M2", 5, 2, note="gradients in FP8 training (wider range)"),
        {"name": "INT8", "bits": 8, "bytes": 1, "sign": 1, "exponent": 0, "mantissa": 7,
         "max": 127.0, "min_normal": 1.0, "min_subnormal": 1.0, "epsilon": 1.0,
         "decimal_digits": 2.1,
         "note": "integers -128..127 times a per-row/block scale (LLM.int8, 8-bit optimizers)"},
        {"name": "NF4", "bits": 4, "bytes": 0.5, "sign": 1, "exponent": 0, "mantissa": 3,
         "max": 1.0, "min_normal": 0.0796, "min_subnormal": 0.0796, "epsilon": 0.0796,
         "decimal_digits": 1.2,
         "note": "16 levels at normal-distribution quantiles in [-1, 1] times a per-block (64) absmax; "
                 "QLoRA's storage format, dequantized to BF16 for each matmul"},
    ]

