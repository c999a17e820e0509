"""Practitioner defaults: what a setup gets for a field the user leaves out, beyond the
dataclass's default and the stack's (``stacks.py``), because that is how people run it.

One place for the API, the command line and the widget: ``TrainingSetup.from_kwargs``
applies :data:`TRAINING_DEFAULTS` to the fields nobody gave, the widget applies the same
rules to the controls the user has not touched (``widget/training.py``), and
:func:`strategy_for` gives the data-parallel strategy of a run with several replicas and
none named (``estimate_parallel``, the CLI, the config readers, the widget).  Each
applied default is said, in the same words, in ``Estimate.notes``, the CLI's notes and the
widget's summary (``summary["defaults"]``).  A value the user gives always wins.

A rule is data: the field, the value, when it applies (a predicate over the values given
so far, rules applied in order) and the sentence that says it, citing the code it follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Tuple


@dataclass(frozen=True)
class Default:
    """One practitioner default: ``field`` gets ``value`` when ``when(values)`` holds and
    the field was not given; ``note`` says so (the same words everywhere)."""

    field: str
    value: Any
    when: Callable[[Mapping[str, Any]], bool]
    note: str


def _quantized(v: Mapping[str, Any]) -> bool:
    return v.get("quantization", "none") not in ("none", None)


#: training setup defaults, applied in this order (the first can make the second apply)
TRAINING_DEFAULTS: Tuple[Default, ...] = (
    # a quantized base cannot take gradient updates: it trains through adapters
    # (transformers' Trainer refuses to fine-tune a purely quantized model without an adapter:
    # src/transformers/trainer_utils.py, _is_quantized_and_base_model -> "You cannot perform
    # fine-tuning on purely quantized models"); the widget's quantization control links the same way
    Default("method", "qlora", lambda v: _quantized(v),
            "default: method 'qlora' (a quantized base trains only through LoRA adapters); "
            "pass method= yourself to change it"),
    # peft src/peft/utils/other.py prepare_model_for_kbit_training(model,
    # use_gradient_checkpointing=True, ...): QLoRA with transformers + PEFT turns checkpointing
    # on.  Other stacks say what their recipes run in stacks.py (LitGPT's finetune/lora.py
    # runs without; Unsloth's with offloaded checkpointing), so the rule is the hf stack's.
    Default("gradient_checkpointing", "full",
            lambda v: v.get("stack", "hf") == "hf"
            and (v.get("method") == "qlora" or (v.get("method") == "lora" and _quantized(v))),
            "default: gradient_checkpointing 'full' for QLoRA (peft's prepare_model_for_kbit_training "
            "turns it on); pass gradient_checkpointing='none' to estimate without it"),
)


def apply_training_defaults(values: Dict[str, Any]) -> List[Tuple[str, str]]:
    """Fill ``values`` (the setup's keywords as given, stack defaults included) with the
    practitioner defaults for the fields it lacks; returns (field, note) for each applied."""
    said = []
    for d in TRAINING_DEFAULTS:
        if d.field not in values and d.when(values):
            values[d.field] = d.value
            said.append((d.field, d.note))
    return said


#: the note of a run with several data-parallel replicas and no strategy named
STRATEGY_NOTE = ("default: strategy 'ddp' for {replicas} data-parallel replicas (torchrun, accelerate and the "
                 "HF Trainer wrap the model in DistributedDataParallel when nothing shards it); pass strategy= "
                 "to change it")


def strategy_for(num_gpus: Any, tensor_parallel: Any = 1, pipeline_parallel: Any = 1,
                 context_parallel: Any = 1) -> Tuple[str, str]:
    """The strategy of a run whose strategy was not given, and the note that says it ("" when
    the default is "none", one replica: nothing to say).  Values that are not whole numbers
    give "none"; the layout's own checks name them."""
    try:
        mp = int(tensor_parallel or 1) * int(pipeline_parallel or 1) * int(context_parallel or 1)
        n = int(num_gpus or 1)
    except (TypeError, ValueError, OverflowError):
        return "none", ""
    if mp >= 1 and n > mp and n % mp == 0:
        return "ddp", STRATEGY_NOTE.format(replicas=f"{n // mp:,}")
    return "none", ""
