"""The KV cache's layout: what one layer caches per token (keys and values, MLA's latent, a
hybrid's fixed-size states)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..model.architecture import Architecture
from ..units import DTYPE_BYTES


@dataclass(frozen=True)
class KVLayout:
    """What one layer caches per token: ``k_elems`` + ``v_elems`` elements of ``elem_bytes``."""

    k_elems: int
    v_elems: int
    elem_bytes: float
    full_layers: int
    sliding_layers: int
    window: Optional[int]
    kind: str            # "kv heads" or "mla latent" or "mla decompressed"
    formula: str
    #: a hybrid's other layers: a fixed-size state per sequence (conv / linear attention / SSM)
    state_bytes_per_seq: float = 0.0

    @property
    def layer_bytes_per_token(self) -> float:
        return (self.k_elems + self.v_elems) * self.elem_bytes

    @property
    def bytes_per_token(self) -> float:
        """All layers, no window: what each new token of one sequence adds (until a window fills)."""
        return self.layer_bytes_per_token * (self.full_layers + self.sliding_layers)

    def layer_tokens(self, tokens: int, sliding: bool) -> int:
        """Tokens whose storage a layer holds: a sliding layer min(S, W) after a decode step."""
        if sliding and self.window:
            return min(tokens, self.window)
        return tokens


def kv_layout(arch: Architecture, kv_dtype: str = "bfloat16", mla_cache: str = "compressed",
              use_sliding_window: bool = True) -> KVLayout:
    """Per layer and token: keys and values of every KV head, 2 x kv x d elements (GQA/MQA
    share heads; MoE changes nothing).  MLA (DeepSeek-V2/V3) as transformers 5 caches it:
    the normalised latent (kv_lora_rank) + the rotary key (qk_rope_head_dim); decompressed:
    a x (d_nope + d_rope) keys + a x d_v values."""
    eb = DTYPE_BYTES[kv_dtype]
    L = arch.num_layers if arch.kv_cache_layers is None else arch.kv_cache_layers
    sl = arch.sliding_layers if (use_sliding_window and arch.sliding_window) else 0
    window = arch.sliding_window if sl else None
    if arch.mla:
        m = arch.mla
        if mla_cache == "compressed":
            k, v = m["kv_lora_rank"], m["qk_rope_head_dim"]
            return KVLayout(k, v, eb, L - sl, sl, window, "mla latent",
                            f"(kv_lora_rank {k} + qk_rope_head_dim {v}) x {eb:g} B")
        a = arch.num_heads
        k = a * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"])
        v = a * m["v_head_dim"]
        return KVLayout(k, v, eb, L - sl, sl, window, "mla decompressed",
                        f"a x (d_nope + d_rope) + a x d_v = {k} + {v} elements x {eb:g} B")
    kvd = arch.num_kv_heads * arch.head_dim
    # the fixed-size states live in the model's dtype (transformers' hybrid caches allocate
    # them like the keys), whatever the KV cache's own dtype
    return KVLayout(kvd, kvd, eb, L - sl, sl, window, "kv heads",
                    f"2 x kv {arch.num_kv_heads} x d {arch.head_dim} x {eb:g} B",
                    state_bytes_per_seq=arch.state_elems_per_seq * max(eb, 2.0))
