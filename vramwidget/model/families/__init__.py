"""Model families as plug-ins: one module per family, a registry from ``model_type``.

Each module declares a family's parameter tensors and its block trace, composed from the
shared building blocks in :mod:`~vramwidget.model.families.blocks`; a family that is "Llama with
X" subclasses :class:`~vramwidget.model.families.llama.Llama` and overrides X.  Importing this
package registers every family; :func:`family_for` looks one up.  See
docs/adding-a-model-family.md.
"""

from .base import ALIASES, REGISTRY, Family, family_for, register, resolve_model_type, supported_model_types

# registration order is the order ``supported_model_types()`` lists them in
from . import llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe  # noqa: E402,F401
from . import gemma, gemma2, gemma3, phi3  # noqa: E402,F401
from . import gpt2, gpt_neox, opt, bloom, falcon  # noqa: E402,F401
from . import olmo, olmo2, olmoe, deepseek, smollm3  # noqa: E402,F401
# issue 11: this year's families
from . import gpt_oss, llama4, glm4_moe, lfm2  # noqa: E402,F401
from . import vision, vlm, encoders  # noqa: E402,F401
from . import t5, bert, bart  # noqa: E402,F401
from . import qwen3_next  # noqa: E402,F401

__all__ = ["ALIASES", "REGISTRY", "Family", "family_for", "register", "resolve_model_type",
           "supported_model_types"]
