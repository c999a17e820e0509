"""What every config reader shares: the :class:`Mapper` that records each field's fate, and
the :class:`TrainingConfig` it produces."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from ..errors import VramError

#: fields that set nothing about memory (optimiser hyper-parameters, logging, data paths ...)
_NO_MEMORY_EFFECT = re.compile(
    r"(^|[._])(lr|learning_rate|min_lr|epochs?|num_train_epochs|warmup\w*|lr_scheduler\w*|scheduler|"
    r"logging\w*|log_\w+|logger\w*|metric_logger|save\w*|eval\w*|val_\w+|wandb\w*|hub_\w+|push_to_hub|report_to|"
    r"seed|data_seed|output_dir|out_dir|dataset\w*|data|tokenizer\w*|chat_template|template|special_tokens|"
    r"profiler|resume\w*|run_name|project|dataloader\w*|weight_decay|adam_\w+|betas?|eps|max_grad_norm|"
    r"clip_grad_norm|gradient_clipping|max_steps\w*|num_workers|preprocessing_num_workers|overwrite_\w+|"
    r"plot_loss|do_train|do_eval|stage|strict|max_samples|shuffle|train_on_inputs|group_by_length|"
    r"early_stopping\w*|debug|local_rank|ddp_timeout|comms_config|monitor_config|compute_environment|"
    r"machine_rank|main_training_function|rdzv_backend|same_network|tpu_\w+|use_cpu|main_process_\w+|"
    r"interval|max_new_tokens|max_iters|initial_validation|final_validation|lora_model_dir|"
    r"lora_fan_in_fan_out|trust_remote_code|recipe_checkpoint|checkpoint_files|model_type|"
    r"tokenizer_type|device|steps_per_print|wall_clock_breakdown|zero_allow_untested_optimizer|"
    r"gradient_checkpointing_kwargs|use_reentrant|label_names|remove_unused_columns|neftune\w*|"
    r"loss_scale\w*|initial_scale_power|hysteresis|min_loss_scale|downcast_bf16|ddp_\w+|"
    r"dynamo_config|enable_cpu_affinity|gpu_ids|seq_parallel_communication_data_type|"
    r"average_tokens_across_devices|label_smoothing_factor|auto_find_batch_size|include_\w+|disable_tqdm|"
    r"prediction_loss_only|per_device_eval_batch_size|accelerator_config|batch_eval_metrics|"
    r"greater_is_better|ignore_data_skip|length_column_name|load_best_model_at_end|restore_callback_states\w*|"
    r"skip_memory_metrics|train_sampling_strategy|trackio_\w+|full_determinism|enable_jit_checkpoint|"
    r"parallelism_config|liger_kernel_config|torch_empty_cache_steps|torch_compile_\w+|fp16_full_eval|"
    r"bf16_full_eval|dataset_text_field|completion_only_loss|assistant_only_loss|quant_method|_load_in_\w+|"
    r"llm_int8_\w+|bnb_4bit_compute_dtype|bnb_4bit_quant_storage|max_norm|tie_embeddings|mask_prompt|"
    r"prompt_style|ignore_index|download_dir|class_path|init_args|val_split_fraction|deepspeed_multinode_launcher|"
    r"zero3_init_flag|zero3_save_16bit_model|num_machines|distributed_type|sub_group_size|contiguous_gradients|"
    r"stage3_\w+|pin_memory|train_batch_size|log_peak_memory_stats|output_proj|use_cache|optim_target_modules|"
    r"task_type|bias|fan_in_fan_out|inference_mode|init_lora_weights|revision|peft_version|ddp_timeout)$")


#: the reason given for a switch that is off (false, 0, "no"): nothing to model
OFF = "off: no effect on memory"
#: reasons that the CLI's text output summarises instead of listing
QUIET_REASONS = ("no effect on memory", OFF, "read: the default, nothing to change")
READ_DEFAULT = QUIET_REASONS[2]


def _leaves(d: Mapping[str, Any], prefix: str = "") -> Iterator[Tuple[str, Any]]:
    for k, v in d.items():
        p = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            yield from _leaves(v, p)
        else:
            yield p, v


def _short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


@dataclass
class TrainingConfig:
    """A training config read into vramwidget's inputs.

    ``model`` is what the file names (a Hub id, a path or a preset), or None; ``setup`` the
    keywords of :func:`vramwidget.estimate`; ``parallel`` those of
    :func:`vramwidget.estimate_parallel` beyond the setup; ``mapped`` lists (field,
    keyword, value) for every field that was used, ``ignored`` (field, reason) for every
    other field; ``notes`` states what was assumed.
    """

    format: str
    source: str
    model: Optional[Any] = None
    setup: Dict[str, Any] = field(default_factory=dict)
    parallel: Dict[str, Any] = field(default_factory=dict)
    mapped: List[Tuple[str, str, Any]] = field(default_factory=list)
    ignored: List[Tuple[str, str]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    #: fields whose value could not be used as written ("two" for a batch size, 2048.7 tokens):
    #: each is also in ``ignored``; the CLI prints them and the estimate's notes carry them
    warnings: List[str] = field(default_factory=list)

    @property
    def is_parallel(self) -> bool:
        """True when the config describes more than one GPU or a sharding strategy."""
        return self.parallel.get("num_gpus", 1) > 1 or self.parallel.get("strategy", "none") != "none"

    def estimate(self, model: Any = None, **overrides: Any):
        """Run the estimate: :func:`vramwidget.estimate` or, for a sharded run,
        :func:`vramwidget.estimate_parallel`.  ``model`` overrides the file's model;
        ``overrides`` override setup or parallel keywords."""
        from ..estimate import estimate
        from ..parallel.estimate import PARALLEL_KEYS, estimate_parallel

        m = model if model is not None else self.model
        if m is None:
            raise VramError(f"model: the {self.format} config {self.source} names no model; give one "
                            f"(vramwidget estimate MODEL --from FILE)", field="model")
        setup = {**self.setup, **{k: v for k, v in overrides.items() if k not in PARALLEL_KEYS}}
        par = {**self.parallel, **{k: v for k, v in overrides.items() if k in PARALLEL_KEYS}}
        if par.get("num_gpus", 1) > 1 or par.get("strategy", "none") != "none":
            if par.get("strategy", "none") == "none":
                # several processes and no sharding configured: torchrun/accelerate run the
                # HF Trainer (and the other stacks' recipes) under DistributedDataParallel;
                # estimate_parallel chooses it (defaults.strategy_for) and says so
                par.pop("strategy", None)
            return _said(estimate_parallel(m, **par, **setup), self.warnings)
        return _said(estimate(m, **setup), self.warnings)

    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON-able form (what ``estimate --from FILE --json`` reports under ``config``)."""
        return {"format": self.format, "source": self.source, "model": self.model, "setup": dict(self.setup),
                "parallel": dict(self.parallel),
                "mapped": [{"field": f, "keyword": k, "value": v} for f, k, v in self.mapped],
                "ignored": [{"field": f, "reason": r} for f, r in self.ignored], "notes": list(self.notes),
                "warnings": list(self.warnings)}

    def __repr__(self) -> str:
        lines = [f"TrainingConfig({self.format}, {self.source}): model {self.model!r}"]
        if self.setup:
            lines.append("  setup: " + ", ".join(f"{k}={v!r}" for k, v in self.setup.items()))
        if self.parallel:
            lines.append("  parallel: " + ", ".join(f"{k}={v!r}" for k, v in self.parallel.items()))
        lines.append(f"  {len(self.mapped)} field(s) mapped, {len(self.ignored)} ignored")
        return "\n".join(lines)


def _said(result: Any, warnings: List[str]) -> Any:
    """The estimate of a config, its notes starting with what the config could not say."""
    for target in (result, getattr(result, "per_gpu", None)):
        if target is not None:
            target.notes[:0] = [f"warning: config {w}" for w in warnings if f"warning: config {w}" not in target.notes]
    return result


class Mapper:
    """Records, field by field, what a reader makes of a config."""

    def __init__(self, fmt: str, raw: Mapping[str, Any], *, base_dir: Optional[str] = None,
                 source: str = "<dict>") -> None:
        self.fmt = fmt
        self.raw = raw
        self.base_dir = base_dir
        self.cfg = TrainingConfig(format=fmt, source=source)
        self._seen: set = set()

    # -- reading ----------------------------------------------------------------------
    def get(self, path: str, default: Any = None) -> Any:
        """The value at a dotted path (``zero_optimization.stage``), marked as read."""
        cur: Any = self.raw
        for part in path.split("."):
            if not isinstance(cur, Mapping) or part not in cur:
                return default
            cur = cur[part]
        self._seen.add(path)
        return cur

    def has(self, path: str) -> bool:
        """Whether the dotted path exists (without marking it read)."""
        cur: Any = self.raw
        for part in path.split("."):
            if not isinstance(cur, Mapping) or part not in cur:
                return False
            cur = cur[part]
        return True

    def sibling(self, rel: Any) -> Optional[Dict[str, Any]]:
        """A file the config names by path (relative to the config's folder), read when it exists."""
        if not isinstance(rel, str) or self.base_dir is None:
            return None
        for cand in (rel, os.path.join(self.base_dir, rel)):
            if os.path.isfile(cand):
                return load_file(cand)
        return None

    def whole(self, value: Any, where: str) -> Optional[int]:
        """``value`` (read from ``where``) as a whole number; None when unset or "auto".  A
        value that is not one (2048.7, "two", nan) is not used and not truncated: a warning
        (:meth:`warn`) says so, and the estimate takes the setup's default instead."""
        try:
            return integer(value, where)
        except VramError as e:
            self.warn(where, f"{str(e).split(': ', 1)[1]}: not used (the estimate takes the default)")
            return None

    def real(self, value: Any, where: str) -> Optional[float]:
        """``value`` as a number (see :meth:`whole`)."""
        try:
            return number(value, where)
        except VramError as e:
            self.warn(where, f"{str(e).split(': ', 1)[1]}: not used (the estimate takes the default)")
            return None

    def numbers(self, fields: Mapping[str, Tuple[str, Any]], prefix: str = "", source: Any = None) -> None:
        """Map number fields: ``{field: (keyword, converter)}``, converter :func:`integer` or
        :func:`number`; fields that are absent or not numbers are left alone.  With
        ``source`` (a mapping) the fields are read from it instead of the config."""
        for key, (target, conv) in fields.items():
            raw = source.get(key) if source is not None else self.get(prefix + key)
            v = self.whole(raw, prefix + key) if conv is integer else self.real(raw, prefix + key)
            if v is not None:
                self.set(target, v, prefix + key)

    # -- recording --------------------------------------------------------------------
    def set(self, key: str, value: Any, src: str) -> None:
        """Map a field to a setup keyword of estimate()."""
        self.cfg.setup[key] = value
        self.cfg.mapped.append((src, key, value))

    def par(self, key: str, value: Any, src: str) -> None:
        """Map a field to a keyword of estimate_parallel()."""
        self.cfg.parallel[key] = value
        self.cfg.mapped.append((src, key, value))

    def par_item(self, key: str, item: str, value: Any, src: str) -> None:
        """Map a field to one entry of a mapping keyword of estimate_parallel()
        (``zero_config``: DeepSpeed's own ZeRO keys)."""
        self.cfg.parallel.setdefault(key, {})[item] = value
        self.cfg.mapped.append((src, f"{key}[{item!r}]", value))

    def model(self, value: Any, src: str) -> None:
        """The model the config names."""
        self.cfg.model = value
        self.cfg.mapped.append((src, "model", value))

    def ignore(self, path: str, why: str) -> None:
        """A field that was read but not used, with the reason."""
        self._seen.add(path)
        self.cfg.ignored.append((path, why))

    def warn(self, path: str, text: str) -> None:
        """A field read but not used because its value is wrong (or a change was made to it):
        listed with the other ignored fields and said in ``warnings`` (printed by the CLI's
        plain output, carried into the estimate's notes)."""
        self._seen.add(path)
        self.cfg.ignored.append((path, f"warning: {text}"))
        self.cfg.warnings.append(f"{path}: {text}")

    def note(self, text: str) -> None:
        """An assumption the reader made."""
        if text not in self.cfg.notes:
            self.cfg.notes.append(text)

    # -- the end ----------------------------------------------------------------------
    def _covered(self, path: str) -> bool:
        parts = path.split(".")
        return any(".".join(parts[:i]) in self._seen for i in range(1, len(parts) + 1))

    def finish(self) -> TrainingConfig:
        """Every unread field into ``ignored``; setup keywords this version cannot take too."""
        from ..parallel.estimate import PARALLEL_KEYS
        from ..training import CHOICES, TrainingSetup, check_setup_choice

        cfg = self.cfg
        accounted = {f for f, _, _ in cfg.mapped} | {f for f, _ in cfg.ignored}
        for path, value in _leaves(self.raw):
            parts = path.split(".")
            if any(".".join(parts[:i]) in accounted for i in range(1, len(parts) + 1)):
                continue
            if value is None or value == "" or value == [] or value == {}:
                continue  # an unset field
            if value is False or value == 0 or (isinstance(value, str) and value.lower() in ("no", "none", "false")):
                cfg.ignored.append((path, OFF))
                continue
            if self._covered(path):
                cfg.ignored.append((path, READ_DEFAULT))
                continue
            why = "no effect on memory" if any(_NO_MEMORY_EFFECT.search(p) for p in path.split(".")) \
                else f"not understood ({_short(value, 30)}): check it does not change memory"
            cfg.ignored.append((path, why))
        fields = set(TrainingSetup.__dataclass_fields__)
        for key in list(cfg.setup):
            value = cfg.setup[key]
            src = next((f for f, k, _ in reversed(cfg.mapped) if k == key), key)
            if key not in fields:
                cfg.setup.pop(key)
                cfg.ignored.append((src, f"{key}={_short(value)} is not modelled by this version of vramwidget"))
            elif key in CHOICES:
                try:
                    cfg.setup[key] = check_setup_choice(key, value)
                except VramError as e:
                    cfg.setup.pop(key)
                    cfg.ignored.append((src, f"not modelled: {e}"))
        for key in list(cfg.parallel):
            if key not in PARALLEL_KEYS:
                src = next((f for f, k, _ in reversed(cfg.mapped) if k == key), key)
                cfg.ignored.append((src, f"{key}={_short(cfg.parallel.pop(key))} is not modelled by this version"))
        try:
            TrainingSetup.from_kwargs(**cfg.setup)
        except VramError as e:
            raise VramError(f"config ({self.fmt}, {cfg.source}): {e}", field=e.field) from None
        return cfg


# -- values shared by several formats ------------------------------------------------------

def truthy(value: Any) -> bool:
    """YAML/JSON booleans as written in the wild: true/"true"/"yes"/1/"auto" are true."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "yes", "1", "auto", "on")
    return bool(value)


def is_auto(value: Any) -> bool:
    """DeepSpeed's and HF's "auto": filled in from elsewhere at launch."""
    return isinstance(value, str) and value.strip().lower() == "auto"


def number(value: Any, where: Optional[str] = None) -> Optional[float]:
    """A number written as 5e8, "5e8" or 500000000; None for an unset value or "auto".

    With ``where`` (the field's path in the file) anything else present is an error naming
    the field: a string that is not a number, nan, inf, a boolean, a list.  Without it the
    value is only looked at (None for anything that is not a number)."""
    if value is None or is_auto(value) or (isinstance(value, str) and not value.strip()):
        return None
    x: Optional[float] = None
    if isinstance(value, float):
        x = value
    elif isinstance(value, int) and not isinstance(value, bool):
        x = float(value) if abs(value) < 10 ** 300 else float("inf")     # 10**400 is no setting
    elif isinstance(value, str) and len(value) <= 64:
        try:
            x = float(value)
        except ValueError:
            x = None
    if x is not None and not math.isfinite(x):
        x = None
    if x is None and where is not None:
        raise VramError(f"{where}: must be a number, got {_short(value, 40)}", field=where)
    return x


def integer(value: Any, where: Optional[str] = None) -> Optional[int]:
    """A whole number (see :func:`number`), else None; with ``where`` a value that is not a
    whole number (2048.7, "two", nan) is an error naming the field, never truncated."""
    x = number(value, where)
    if x is None:
        return None
    if x != int(x):
        if where is not None:
            raise VramError(f"{where}: must be a whole number, got {_short(value, 40)} (not truncated)", field=where)
        return None
    return int(x)


#: the LoRA numbers as axolotl and LitGPT spell them (peft's r is lora_r there)
LORA_NUMBERS = {"lora_r": ("lora_r", integer), "lora_alpha": ("lora_alpha", number),
                "lora_dropout": ("lora_dropout", number)}


#: HF Trainer / TRL / axolotl / LLaMA-Factory ``optim`` names -> vramwidget optimizers.
#: transformers/training_args.py ``OptimizerNames`` lists the names.
HF_OPTIMIZERS = {
    "adamw_torch": "adamw", "adamw_hf": "adamw", "adamw": "adamw", "adamw_torch_fused": "adamw_fused",
    "adamw_bnb_8bit": "adamw_8bit", "adamw_8bit": "adamw_8bit", "bnb_8bit": "adamw_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit", "paged_adamw_32bit": "paged_adamw", "paged_adamw": "paged_adamw",
    "adafactor": "adafactor", "sgd": "sgd", "lion_32bit": "lion", "lion": "lion", "paged_lion_32bit": "lion",
    "galore_adamw": "galore_adamw", "galore_adamw_8bit": "galore_adamw_8bit",
}

#: module names people write -> the names vramwidget's LoRA targets use (transformers' names)
LORA_MODULE_NAMES = {
    "q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "o_proj",
    "output_proj": "o_proj",  # torchtune
    "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
    "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",  # torchtune's FeedForward
    "lm_head": "lm_head", "output": "lm_head", "embed_tokens": "embed_tokens",
}


def lora_targets(value: Any) -> Optional[Tuple[str, ...]]:
    """A target_modules value (list, comma string, or "all-linear"/"all") in vramwidget's spelling."""
    if value is None:
        return None
    if isinstance(value, str):
        items = [x.strip() for x in value.split(",") if x.strip()]
    elif isinstance(value, (list, tuple)):
        items = [str(x) for x in value]
    else:
        return None
    if any(x in ("all", "all-linear", "all_linear") for x in items):
        return ("all-linear",)
    return tuple(dict.fromkeys(LORA_MODULE_NAMES.get(x, x) for x in items)) or None


def dtype_name(value: Any) -> Optional[str]:
    """"bfloat16" / "torch.bfloat16" / "bf16" -> "bfloat16" (likewise float16, float32); else None."""
    if not isinstance(value, str):
        return None
    v = value.strip().lower().replace("torch.", "")
    return {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
            "float32": "float32", "fp32": "float32", "float": "float32", "auto": "auto"}.get(v)


# the file reader lives here, beside its one caller, so the package's __init__ and this
# module do not import each other (readers/__init__ re-exports it)
_MAX_FILE_BYTES = 4 * 2**20  # a training config is a few KB; refuse anything absurd
#: nesting deeper than this is not a training config (the deepest real ones nest 4-5 levels)
MAX_DEPTH = 32
#: values in one config (every key, list item and leaf, aliases counted each time they are
#: reached): a config has hundreds; a YAML alias bomb has billions
MAX_VALUES = 100_000


def load_file(path: str) -> Dict[str, Any]:
    """A JSON or YAML file's top-level mapping; anything else (not a file, not text, too
    large, too deep, not a mapping, not valid) is one VramError naming the file."""
    path_text = path if len(path) <= 80 else path[:77] + "..."
    what = f"config: {path_text!r}"
    if not os.path.isfile(path):
        raise VramError(f"config: no such file {path_text!r}", field="config")
    if os.path.getsize(path) > _MAX_FILE_BYTES:
        raise VramError(f"{what} is larger than {_MAX_FILE_BYTES // 2**20} MiB; a training config is a few KB",
                        field="config")
    try:
        with open(path, "rb") as f:
            blob = f.read(_MAX_FILE_BYTES + 1)
    except OSError as e:
        raise VramError(f"{what} cannot be read ({e.strerror or e})", field="config") from None
    if b"\x00" in blob:
        raise VramError(f"{what} is a binary file, not a JSON or YAML config", field="config")
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise VramError(f"{what} is not UTF-8 text (byte {e.start:,}): not a JSON or YAML config",
                        field="config") from None
    if not text.strip():
        raise VramError(f"{what} is empty", field="config")
    return check_mapping(parse_text(text, what, json_first=path.lower().endswith(".json")), what)


def parse_text(text: str, what: str, *, json_first: bool = False) -> Any:
    """JSON (``json_first``) or YAML text parsed, with the nesting limit: one VramError
    ``what ...`` for invalid or absurd text."""
    if json_first:
        try:
            data = json.loads(text, parse_constant=_json_constant)
        except json.JSONDecodeError as e:
            raise VramError(f"{what} is not valid JSON ({e.msg} at line {e.lineno})", field="config") from None
        except RecursionError:
            raise VramError(f"{what} nests deeper than a training config (more than {MAX_DEPTH} levels)",
                            field="config") from None
        except ValueError as e:    # NaN / Infinity, refused by _json_constant
            raise VramError(f"{what}: {e}", field="config") from None
    else:
        data = parse_yaml(text, what, "config")
    check_size(data, what)
    return data


def _json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a training config can hold")


def check_mapping(data: Any, what: str) -> Dict[str, Any]:
    """The parsed file's top level must be a mapping of settings."""
    if not isinstance(data, dict):
        raise VramError(f"{what} holds a {type(data).__name__}, not a mapping of settings", field="config")
    return data


def check_size(data: Any, what: str) -> None:
    """Nesting up to :data:`MAX_DEPTH` and up to :data:`MAX_VALUES` values, counted without
    recursion (aliases of a YAML file are counted each time they are reached, so an alias
    bomb stops at the limit instead of expanding)."""
    stack = [(data, 0)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise VramError(f"{what} holds more than {MAX_VALUES:,} values: not a training config", field="config")
        if depth > MAX_DEPTH:
            raise VramError(f"{what} nests deeper than a training config (more than {MAX_DEPTH} levels)",
                            field="config")
        if isinstance(node, Mapping):
            for k, v in node.items():
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise VramError(f"{what} has a key that is not text ({_short(k, 30)})", field="config")
                stack.append((v, depth + 1))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)
        # leaves (numbers, text, nan, YAML timestamps ...) are checked by the field that reads them


def parse_yaml(text: str, what: str, field: str) -> Any:
    """YAML text (JSON is a subset) parsed safely; VramError "``what`` is not valid YAML" otherwise
    (a document nested too deeply for the parser is refused the same way)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise VramError(f"{what} is not valid YAML or JSON ({str(e).splitlines()[0][:60]})", field=field) from None
    except RecursionError:
        raise VramError(f"{what} nests deeper than a training config (more than {MAX_DEPTH} levels)",
                        field=field) from None
    except (ValueError, TypeError, OverflowError) as e:   # e.g. a timestamp out of range
        raise VramError(f"{what} is not valid YAML ({type(e).__name__}: {str(e)[:60]})", field=field) from None
