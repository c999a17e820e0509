"""Read a user's own training config and turn it into an estimate's inputs.

``from_training_config(path_or_dict)`` recognises the config files people already have:

==============  ========================================================================
format          what it reads
==============  ========================================================================
``hf``          HF ``TrainingArguments`` / TRL ``SFTConfig`` JSON (``to_json_string()``),
                with a PEFT ``LoraConfig`` and a ``BitsAndBytesConfig`` beside it
``axolotl``     an axolotl YAML (``base_model``, ``adapter``, ``micro_batch_size`` ...)
``torchtune``   a torchtune recipe YAML (``model._component_``, ``batch_size`` ...)
``llamafactory`` a LLaMA-Factory YAML (``model_name_or_path``, ``finetuning_type`` ...)
``litgpt``      a LitGPT finetune YAML (``checkpoint_dir``, ``precision``, ``train`` ...)
``deepspeed``   a DeepSpeed JSON (``zero_optimization`` stage, offload, bucket sizes)
``accelerate``  an accelerate YAML (``distributed_type: FSDP`` / ``DEEPSPEED``)
==============  ========================================================================

Each format is one module here with a ``read(raw, ctx) -> None`` that records what it maps
on a :class:`~vramwidget.readers._common.Mapper`.  The result, a :class:`TrainingConfig`,
holds the model (when the file names one), the setup keywords of
:func:`vramwidget.estimate`, the parallel layout of :func:`vramwidget.estimate_parallel`,
and every field that was ignored with the reason.  Nothing here imports torch or the
training stacks themselves: the files are read as data.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

from ..errors import VramError
from ..inputs import shown
from ._common import Mapper, TrainingConfig, check_size, load_file
from . import accelerate, axolotl, deepspeed, hf, litgpt, llamafactory, torchtune

#: format name -> reader module (each has ``detect(raw) -> int`` and ``read(raw, mapper)``)
READERS = {
    "hf": hf,
    "axolotl": axolotl,
    "torchtune": torchtune,
    "llamafactory": llamafactory,
    "litgpt": litgpt,
    "deepspeed": deepspeed,
    "accelerate": accelerate,
}

FORMATS = tuple(READERS)

__all__ = ["FORMATS", "TrainingConfig", "from_training_config", "load_file"]



def detect(raw: Mapping[str, Any]) -> str:
    """The format whose reader recognises the most of ``raw``'s keys."""
    scores = {name: mod.detect(raw) for name, mod in READERS.items()}
    best = max(scores, key=lambda k: scores[k])
    if scores[best] <= 0:
        keys = ", ".join(shown(k) for k in list(raw)[:6])
        raise VramError(f"config: not a training config vramwidget can read (keys: {keys}); formats: "
                        f"{', '.join(FORMATS)}", field="config")
    return best


def from_training_config(source: Union[str, os.PathLike, Mapping[str, Any]], *,
                         format: Optional[str] = None) -> TrainingConfig:
    """Read a training config file (or its parsed dict) into model, setup and parallel layout.

    Parameters
    ----------
    source:
        a path to a JSON or YAML file, or the parsed mapping.  Files that a config names
        by path (a DeepSpeed JSON from a TrainingArguments/axolotl/LLaMA-Factory config, a
        PEFT ``adapter_config.json`` beside a TrainingArguments JSON) are read too when
        they exist, relative to the config's folder.
    format:
        one of :data:`FORMATS`; detected from the keys when left out.

    Returns
    -------
    TrainingConfig
        ``.model``, ``.setup`` (keywords of :func:`vramwidget.estimate`), ``.parallel``
        (keywords of :func:`vramwidget.estimate_parallel`), ``.ignored`` (field, reason)
        and ``.mapped`` (field, keyword, value); ``.estimate()`` runs it.
    """
    base_dir = None
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        raw = load_file(path)
        base_dir = os.path.dirname(os.path.abspath(path))
        name = os.path.basename(path)
    elif isinstance(source, Mapping):
        check_size(source, "config: <dict>")
        raw = dict(source)
        name = "<dict>"
    else:
        raise VramError(f"config: expected a file path or a dict, got {type(source).__name__}", field="config")
    if format is None:
        fmt = detect(raw)
    else:
        if not isinstance(format, str) or format not in READERS:
            raise VramError(f"format: unknown config format {shown(str(format)[:40])}; allowed: {', '.join(FORMATS)}",
                            field="format")
        fmt = format
    m = Mapper(fmt, raw, base_dir=base_dir, source=name)
    try:
        READERS[fmt].read(raw, m)
    except VramError as e:   # a field the reader refused (not a number, a contradiction ...): say which file
        field = getattr(e, "field", None) or "config"
        raise VramError(f"config ({fmt}, {name}): {e}", field=field) from None
    except RecursionError:
        raise VramError(f"config ({fmt}, {name}): nests deeper than a training config", field="config") from None
    return m.finish()
