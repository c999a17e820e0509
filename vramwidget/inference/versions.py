"""The transformers release an inference setup models (``versions={"transformers": ...}``)."""

from __future__ import annotations

from typing import Any, Tuple

#: the transformers release assumed when ``versions`` does not name one (the installed 5.23,
#: whose source every rule here was read from)
DEFAULT_TRANSFORMERS = (5, 23, 0)


def transformers_version(s: Any) -> Tuple[int, ...]:
    """The transformers release ``s`` models, as a tuple of ints (``versions={"transformers": ...}``)."""
    v = (s.versions or {}).get("transformers")
    if not v:
        return DEFAULT_TRANSFORMERS
    from .engines import parse_version

    return tuple(parse_version(v))
