"""The input contract: every value a user can give is checked here, before it is used.

One layer for every entry point (the API, the CLI, the widget's traits, config readers):

* types first: a value of the wrong type is a :class:`VramError`, never a ``TypeError``
  from deep inside (``lora_targets=5``, ``method=['lora']``, ``limit='abc'``);
* ranges from the model where it has them (positions, heads, layers: checked where the
  model is known) and from physics where it does not: whole numbers above
  :data:`MAX_COUNT` and estimates above :data:`MAX_BYTES` (1 PiB) are input errors;
* messages are one line naming the field and the value, the value shortened to
  :data:`MAX_SHOWN_CHARS` characters;
* nothing here takes time or memory in proportion to a hostile input's size: text is cut
  before it is printed or compared, containers are looked at only up to
  :data:`MAX_ITEMS` items.

A field is declared once as a :class:`Field` (name, kind, default, allowed values or
range); ``TrainingSetup`` keeps a table of them, and adding a setup keyword is adding
one declaration there.
"""

from __future__ import annotations

import difflib
import math
import reprlib
from dataclasses import dataclass, field as dc_field
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

from .errors import VramError

#: values in messages are shortened to this many characters
MAX_SHOWN_CHARS = 80
#: an estimate above this is an input error (1 PiB: no GPU, node or cluster holds it)
MAX_BYTES = 2 ** 50
#: whole numbers (batch, tokens, GPUs, ranks ...) above this are input errors: float64 holds
#: every integer up to 2**53 exactly, and 2**53 tokens of one byte are 8 PiB
MAX_COUNT = 2 ** 53
#: GPUs of one run above this are input errors: more than any cluster announced (xAI's Colossus,
#: ~200,000 GPUs, 2025; Llama 3 405B trained on 16,384 H100s, arXiv 2407.21783 section 3.3)
MAX_GPUS = 2 ** 18
#: names, paths and Hub ids longer than this are input errors (Linux's PATH_MAX is 4096)
MAX_TEXT_CHARS = 4096
#: list inputs (LoRA targets, quantized groups ...) longer than this are input errors
MAX_ITEMS = 256
#: close-match hints are looked for only in words up to this long (difflib is quadratic)
_HINT_CHARS = 64

_REPR = reprlib.Repr()
_REPR.maxstring = MAX_SHOWN_CHARS
_REPR.maxother = MAX_SHOWN_CHARS
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxdict = 6
_REPR.maxlevel = 3
_REPR.maxlong = 40


def shown(value: Any) -> str:
    """``repr(value)`` in at most :data:`MAX_SHOWN_CHARS` characters, in time that does not
    grow with the value's size (a 2 GB string is cut before it is quoted)."""
    if isinstance(value, str) and len(value) > MAX_SHOWN_CHARS:
        text = repr(value[:40]) + f"... ({len(value):,} characters)"
    else:
        try:
            text = _REPR.repr(value)
        except Exception:  # a user object whose __repr__ fails
            text = f"<{type(value).__name__}>"
    if len(text) > MAX_SHOWN_CHARS:
        text = text[:MAX_SHOWN_CHARS - 3] + "..."
    return text.replace("\n", " ")


def close_match(word: Any, options: Iterable[str], n: int = 1, cutoff: float = 0.6) -> list:
    """difflib's close matches, only for short strings (difflib is quadratic in length)."""
    if not isinstance(word, str) or len(word) > _HINT_CHARS:
        return []
    return difflib.get_close_matches(word, list(options), n=n, cutoff=cutoff)


def fail(name: str, what: str, value: Any = None, *, show_value: bool = True) -> VramError:
    """The one-line error for ``name``: ``"name: what, got <value>"``."""
    msg = f"{name}: {what}" + (f", got {shown(value)}" if show_value else "")
    return VramError(msg.replace("\n", " "), field=name)


# ---------------------------------------------------------------------------------------
# single values
# ---------------------------------------------------------------------------------------

def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, *, lo: int = 1, hi: int = MAX_COUNT, also: Tuple[int, ...] = (),
              what: Optional[str] = None) -> int:
    """A whole number in [lo, hi] (or one of ``also``); 4.0 is 4, 4.5 and '4' are errors."""
    desc = what or (f"must be a whole number >= {lo}" + (f" and <= {hi:,}" if hi < MAX_COUNT else ""))
    if not _is_number(value):
        raise fail(name, desc, value)
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise fail(name, desc, value)
        if abs(value) > MAX_COUNT:
            raise fail(name, f"{desc}; above 2**53 is not a real setup", value)
        value = int(value)
    if value in also:
        return value
    if value < lo:
        raise fail(name, desc, value)
    if value > hi:
        raise fail(name, desc if hi < MAX_COUNT else f"{desc}; above 2**53 is not a real setup", value)
    return value


def check_number(name: str, value: Any, *, lo: Optional[float] = None, hi: Optional[float] = None,
                 lo_open: bool = False, hi_open: bool = False, what: Optional[str] = None) -> float:
    """A finite number within the bounds."""
    if what is None and lo is not None and hi is not None:
        what = f"must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if what is None:
        parts = []
        if lo is not None:
            parts.append(f"{'>' if lo_open else '>='} {lo:g}")
        if hi is not None:
            parts.append(f"{'<' if hi_open else '<='} {hi:g}")
        what = "must be a finite number" + (" " + " and ".join(parts) if parts else "")
    if not _is_number(value) or (isinstance(value, int) and abs(value) > MAX_COUNT):
        raise fail(name, what, value)
    x = float(value)
    if not math.isfinite(x):
        raise fail(name, what, value)
    if lo is not None and (x < lo or (lo_open and x == lo)):
        raise fail(name, what, value)
    if hi is not None and (x > hi or (hi_open and x == hi)):
        raise fail(name, what, value)
    return x


def check_bool(name: str, value: Any) -> bool:
    """True or False (not 'yes', not 1)."""
    if not isinstance(value, bool):
        raise fail(name, "must be true or false", value)
    return value


def check_text(name: str, value: Any, *, max_chars: int = MAX_TEXT_CHARS, what: str = "must be text") -> str:
    """A string of at most ``max_chars`` characters."""
    if not isinstance(value, str):
        raise fail(name, what, value)
    if len(value) > max_chars:
        raise fail(name, f"{what} of at most {max_chars:,} characters", value)
    return value


def check_choice(name: str, value: Any, allowed: Sequence[str], aliases: Optional[Mapping[Any, str]] = None) -> str:
    """One of ``allowed`` (case and surrounding spaces ignored; ``aliases`` map other spellings)."""
    aliases = aliases or {}
    key: Any = value
    if isinstance(value, str):
        if len(value) > MAX_TEXT_CHARS:
            raise fail(name, f"must be one of {', '.join(allowed)}", value)
        key = value.strip().lower()
    elif not (value is None or isinstance(value, bool)):
        raise fail(name, f"must be one of {', '.join(allowed)}", value)
    key = aliases.get(key, key)
    if key not in allowed:
        hint = close_match(key, allowed)
        raise fail(name, f"{shown(value)} is not one of {', '.join(allowed)}"
                   + (f" (did you mean {hint[0]!r}?)" if hint else ""), show_value=False)
    return key


def check_names(name: str, value: Any, *, allowed: Optional[Sequence[str]] = None,
                canon: Optional[Callable[[str], Optional[str]]] = None, empty: str = "name at least one",
                min_items: int = 1) -> Tuple[str, ...]:
    """A list of names (or one comma-separated string): each a string, each allowed."""
    if isinstance(value, str):
        if len(value) > MAX_TEXT_CHARS:
            raise fail(name, "must be a list of names", value)
        value = [x.strip() for x in value.split(",") if x.strip()]
    if not isinstance(value, (list, tuple)):
        raise fail(name, "must be a list of names" + (f" from {', '.join(allowed)}" if allowed else ""), value)
    if len(value) > MAX_ITEMS:
        raise fail(name, f"at most {MAX_ITEMS} names", value)
    out = []
    for x in value:
        if not isinstance(x, str) or not x.strip() or len(x) > 256:
            raise fail(name, "each entry must be a name (text)", x)
        c = canon(x) if canon else x.strip()
        if allowed is not None and c not in allowed:
            raise fail(name, f"{shown(x)} is not one of {', '.join(allowed)}", show_value=False)
        out.append(c)
    if len(out) < min_items:
        raise fail(name, empty + (f"; allowed: {', '.join(allowed)}" if allowed else ""), show_value=False)
    return tuple(dict.fromkeys(out))


def check_keywords(kind: str, given: Iterable[str], allowed: Iterable[str]) -> None:
    """Unknown keyword names: a VramError naming each (with a close match) and the allowed ones."""
    allowed = sorted(allowed)
    unknown = sorted((k for k in given if k not in allowed), key=str)
    if not unknown:
        return
    hints = []
    for u in unknown[:3]:
        m = close_match(u, allowed)
        hints.append(shown(u) + (f" (did you mean {m[0]!r}?)" if m else ""))
    raise VramError(f"unknown {kind} {', '.join(hints)}; allowed: {', '.join(allowed)}",
                    field=unknown[0] if isinstance(unknown[0], str) and len(unknown[0]) <= 64 else None)


def check_total(nbytes: float, what: str, inputs: Mapping[str, Any],
                usual: Optional[Mapping[str, float]] = None) -> None:
    """An estimate above :data:`MAX_BYTES` (1 PiB) is an input error naming the inputs that
    scale it: no GPU or cluster holds that much.  ``usual``: the usual size of some of the
    inputs; those are named furthest above it first (per unit of it; ties keep their order),
    the rest after them."""
    if nbytes == nbytes and nbytes <= MAX_BYTES:
        return
    if usual:
        scaled = sorted((k for k in inputs if k in usual), key=lambda k: -inputs[k] / usual[k])
        inputs = dict({k: inputs[k] for k in scaled}, **{k: v for k, v in inputs.items() if k not in usual})
    field = next(iter(inputs), None)
    given = ", ".join(f"{k}={shown(v)}" for k, v in inputs.items())
    # "at least": a plan read at a size cuts each request to 1 PiB + 1 TiB
    # (plan/views.py SATURATED_REQUEST_BYTES), so a total beyond that is a lower bound
    amount = f"at least {nbytes / 2 ** 50:,.3g} PiB" if math.isfinite(nbytes) else "beyond any number"
    raise VramError(f"{field}: {what} would need {amount} (more than 1 PiB: not a real setup); "
                    f"check {given}"[:400], field=field)


# ---------------------------------------------------------------------------------------
# declared fields
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Field:
    """One input field: its name, kind, default and what is allowed.

    kinds: ``choice`` (``choices``: a callable returning the allowed values, ``aliases``),
    ``int`` (``lo``/``hi``), ``number`` (``lo``/``hi``, ``lo_open``/``hi_open``), ``bool``,
    ``names`` (a list of strings; ``choices`` restricts them, ``canon`` maps spellings,
    ``min_items``), ``text``, ``custom`` (``parse`` checks and converts).  ``none`` says what None means: ``"default"`` (use the default),
    ``"none"`` (None is a value of its own) or ``"error"``.
    """

    name: str
    kind: str
    default: Any = None
    doc: str = ""
    choices: Optional[Callable[[], Sequence[str]]] = None
    aliases: Mapping[Any, str] = dc_field(default_factory=dict)
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    canon: Optional[Callable[[str], Optional[str]]] = None
    none: str = "default"
    empty: str = "name at least one"
    min_items: int = 1
    parse: Optional[Callable[[Any], Any]] = None

    def check(self, value: Any) -> Any:
        """The canonical value, or a VramError naming this field and the value."""
        if value is None and self.none != "error" and None not in self.aliases:
            return self.default if self.none == "default" else None
        k = self.kind
        if k == "choice":
            return check_choice(self.name, value, tuple(self.choices()), self.aliases)
        if k == "int":
            return check_int(self.name, value, lo=int(self.lo if self.lo is not None else 1),
                             hi=int(self.hi if self.hi is not None else MAX_COUNT))
        if k == "number":
            return check_number(self.name, value, lo=self.lo, hi=self.hi, lo_open=self.lo_open,
                                hi_open=self.hi_open)
        if k == "bool":
            return check_bool(self.name, value)
        if k == "names":
            return check_names(self.name, value, allowed=tuple(self.choices()) if self.choices else None,
                               canon=self.canon, empty=self.empty, min_items=self.min_items)
        if k == "custom":
            return self.parse(value)
        if k == "text":
            return check_text(self.name, value)
        raise AssertionError(f"unknown field kind {k!r}")


# ---------------------------------------------------------------------------------------
# widget traits
# ---------------------------------------------------------------------------------------

def check_trait_value(name: str, trait: Any, value: Any) -> Any:
    """What a trait of this type can hold, as a VramError naming the trait: a whole number for
    an Int (4.0 is 4), a finite number for a Float, true/false for a Bool, text for a
    Unicode (``config_json`` up to a large config.json, others up to
    :data:`MAX_TEXT_CHARS`), a list of names for a List.  Ranges and allowed values are
    checked by the estimate the widget runs (the trait keeps the value as entered and the
    widget shows the error)."""
    import traitlets as t

    if value is None and trait.allow_none:
        return None
    if isinstance(trait, t.Bool):
        return check_bool(name, value)
    if isinstance(trait, t.Int):
        return check_int(name, value, lo=-MAX_COUNT, what="must be a whole number")
    if isinstance(trait, t.Float):
        return check_number(name, value)
    if isinstance(trait, t.Unicode):
        return check_text(name, value, max_chars=1 << 24 if name == "config_json" else MAX_TEXT_CHARS)
    if isinstance(trait, t.List):
        if not isinstance(value, (list, tuple)) or len(value) > MAX_ITEMS \
                or not all(isinstance(x, str) and len(x) <= 256 for x in value):
            raise fail(name, "must be a list of names", value)
        return list(value)
    return value


def guard_traits(cls: Any, names: Iterable[str]) -> Any:
    """Check every value given to the traits ``names`` of a HasTraits class before traitlets
    does: a value of the wrong type raises VramError (never traitlets' TraitError), sets
    the widget's ``error`` and ``error_field`` (when it has them) and leaves the trait and the
    last estimate as they were.  Works where traits are set (``w.x = v``, ``set_trait``,
    the frontend's ``set_state``), whatever class the traits live in."""
    for name in names:
        trait = cls.class_traits().get(name)
        if trait is None:
            continue
        original = trait.validate

        def validate(obj: Any, value: Any, _name: str = name, _trait: Any = trait, _orig: Any = original) -> Any:
            try:
                value = check_trait_value(_name, _trait, value)
            except VramError as e:
                if obj.has_trait("error") and obj.has_trait("error_field"):
                    obj.error, obj.error_field = str(e), _name
                raise
            return _orig(obj, value)

        trait.validate = validate
    return cls
