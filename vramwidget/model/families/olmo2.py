"""OLMo 2: Llama that normalises outputs instead of inputs (``post_attention_layernorm`` on
the attention output, ``post_feedforward_layernorm`` on the MLP output), with q/k RMSNorm
over all heads (a*d and kv*d wide); its block norms apply the weight in fp32
(``(w * x).to(dtype)``); transformers ``models/olmo2/modular_olmo2.py``."""

from .base import register
from .llama import Llama


@register
class Olmo2(Llama):
    model_types = ("olmo2",)
    gguf_arch = "olmo2"
    pre_norms = False
    out_norms = True
    qk_norm = "full"
    gemma_norm = True
