"""One box of an estimate's tree (component > module group > tensor): bytes, formula, dtype.

A parent's bytes are the sum of its children's (:meth:`Node.finalize`).  Kept apart from
:mod:`vramwidget.result` so the estimate's views (:mod:`vramwidget.result_views`) build trees
without importing the estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple


@dataclass
class Node:
    """One box of the treemap: a component, a module group or a tensor."""

    name: str
    bytes: float = 0.0
    formula: str = ""
    dtype: Optional[str] = None
    count: Optional[int] = None  # elements
    children: List["Node"] = field(default_factory=list)

    def add(self, child: "Node") -> "Node":
        """Append ``child`` and return it."""
        self.children.append(child)
        return child

    def total_bytes(self) -> float:
        """Bytes of this node: its own, or the sum of its children's."""
        if not self.children:
            return self.bytes
        return sum(c.total_bytes() for c in self.children)

    def finalize(self) -> "Node":
        """Drop empty children and set each parent's bytes to the sum of its children."""
        for c in self.children:
            c.finalize()
        self.children = [c for c in self.children if c.bytes > 0]
        if self.children:
            self.bytes = sum(c.bytes for c in self.children)
            if self.count is None and all(c.count is not None for c in self.children):
                self.count = sum(c.count for c in self.children)  # type: ignore[misc]
        return self

    def walk(self, path: Tuple[str, ...] = ()) -> Iterator[Tuple[Tuple[str, ...], "Node"]]:
        """Every node below (this one first), with its path of names."""
        here = path + (self.name,)
        yield here, self
        for c in self.children:
            yield from c.walk(here)

    def leaves(self, path: Tuple[str, ...] = ()) -> Iterator[Tuple[Tuple[str, ...], "Node"]]:
        """The nodes without children, with their paths."""
        for p, n in self.walk(path):
            if not n.children:
                yield p, n

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        d: Dict[str, Any] = {"name": self.name, "bytes": int(round(self.bytes)), "formula": self.formula}
        if self.dtype:
            d["dtype"] = self.dtype
        if self.count is not None:
            d["count"] = int(self.count)
        if self.children:
            d["children"] = [c.to_dict() for c in self.children]
        return d
