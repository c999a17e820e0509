"""Sizes as polynomials in the batch, the sequence and the target length.

A step plan is built once per setup and read at any (batch, sequence): every size the
plan records is a :class:`Size`, a sum of ``coefficient x b^i s^j t^k`` terms (T = b s
tokens, the b s^2 of attention scores, an encoder-decoder's b t, b t^2 and b s t).  The
builder runs the same arithmetic on a Size as it would on numbers; an operation a
polynomial cannot express (a branch on a size, a rounding) raises :class:`NotPolynomial` and
the plan is then built for one size alone.  A rounding the plan needs at every size (Liger's
rows per chunk, a power of two) is a :class:`Step` term instead: a named integer function of
a polynomial, read like a monomial (``monomial_values``), kept as the coefficient's basis
element through sums and products with numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple, Union

Monomial = Tuple[int, int, int]      # exponents of (b, s, t)
ONE: Monomial = (0, 0, 0)


@dataclass(frozen=True)
class Step:
    """A basis element that is no monomial: ``fn`` of the polynomial ``arg`` (its terms,
    sorted), an integer-valued function of an array (numpy) that a plan needs at every size.
    Hashable and equal by value (``fn`` by identity: a module-level function or a frozen
    callable), so equal terms share one column of a plan's coefficients."""

    name: str
    fn: Callable[[Any], Any]
    arg: Tuple[Tuple[Monomial, float], ...]

    def values(self, b: Any, s: Any, t: Any) -> Any:
        """``fn`` at batch ``b``, sequence ``s``, target ``t`` (numpy arrays of one shape)."""
        x = 0.0
        for (i, j, k), c in self.arg:
            x = x + c * (b ** i * s ** j * t ** k)
        return self.fn(x)


Term = Union[Monomial, Step]


class NotPolynomial(TypeError):
    """An operation on a :class:`Size` that no polynomial in (b, s, t) expresses."""


class Size:
    """``sum(coef x b^i s^j t^k)``: immutable, with +, -, * and / by numbers and * by Sizes."""

    __slots__ = ("terms",)

    def __init__(self, terms: Dict[Monomial, float]):
        self.terms = {m: c for m, c in terms.items() if c != 0}

    @staticmethod
    def var(which: str) -> "Size":
        """The variable ``b``, ``s`` or ``t``."""
        return Size({{"b": (1, 0, 0), "s": (0, 1, 0), "t": (0, 0, 1)}[which]: 1.0})

    @staticmethod
    def of(x: Any) -> "Size":
        return x if isinstance(x, Size) else Size({ONE: float(x)})

    @staticmethod
    def step(name: str, fn: Callable[[Any], Any], x: "Size") -> "Size":
        """``fn(x)`` as a term of its own (:class:`Step`); ``x`` a polynomial of monomials."""
        if any(m.__class__ is Step for m in x.terms):
            raise NotPolynomial("a step function of a step function")
        return Size({Step(name, fn, tuple(sorted(x.terms.items()))): 1.0})

    # -- arithmetic ----------------------------------------------------------------------
    def __add__(self, other: Any) -> "Size":
        o = Size.of(other).terms
        out = dict(self.terms)
        for m, c in o.items():
            out[m] = out.get(m, 0.0) + c
        return Size(out)

    __radd__ = __add__

    def __neg__(self) -> "Size":
        return Size({m: -c for m, c in self.terms.items()})

    def __sub__(self, other: Any) -> "Size":
        return self + (-Size.of(other))

    def __rsub__(self, other: Any) -> "Size":
        return Size.of(other) + (-self)

    def __mul__(self, other: Any) -> "Size":
        if not isinstance(other, Size):
            f = float(other)
            return Size({m: c * f for m, c in self.terms.items()})
        out: Dict[Term, float] = {}
        for m1, c1 in self.terms.items():
            for m2, c2 in other.terms.items():
                if m1.__class__ is Step or m2.__class__ is Step:
                    if m1 != ONE and m2 != ONE:
                        raise NotPolynomial("a step function times a size")
                    m: Term = m2 if m1 == ONE else m1
                else:
                    m = (m1[0] + m2[0], m1[1] + m2[1], m1[2] + m2[2])
                out[m] = out.get(m, 0.0) + c1 * c2
        return Size(out)

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> "Size":
        if isinstance(other, Size):
            if other.is_constant():
                return self * (1.0 / other.constant())
            raise NotPolynomial("a size divided by a size")
        return self * (1.0 / float(other))

    # -- what a polynomial cannot answer ----------------------------------------------------
    def is_constant(self) -> bool:
        return all(m == ONE for m in self.terms)

    def constant(self) -> float:
        return self.terms.get(ONE, 0.0)

    def is_zero(self) -> bool:
        return not self.terms

    def _concrete(self, what: str) -> float:
        if self.is_constant():
            return self.constant()
        raise NotPolynomial(f"{what} of a size that depends on the batch or sequence")

    def __float__(self) -> float:
        return self._concrete("a float")

    def __int__(self) -> int:
        return int(self._concrete("an int"))

    def __index__(self) -> int:
        return int(self._concrete("an index"))

    def __bool__(self) -> bool:
        return not self.is_zero()

    def __lt__(self, other: Any) -> bool:
        return self._concrete("a comparison") < float(other)

    def __le__(self, other: Any) -> bool:
        return self._concrete("a comparison") <= float(other)

    def __gt__(self, other: Any) -> bool:
        return self._concrete("a comparison") > float(other)

    def __ge__(self, other: Any) -> bool:
        return self._concrete("a comparison") >= float(other)

    def __floordiv__(self, other: Any) -> Any:
        return self._concrete("a floor division") // other

    def __rfloordiv__(self, other: Any) -> Any:
        return other // self._concrete("a floor division")

    def __mod__(self, other: Any) -> Any:
        return self._concrete("a remainder") % other

    def __pow__(self, k: int) -> "Size":
        out = Size.of(1.0)
        for _ in range(int(k)):
            out = out * self
        return out

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: Any) -> bool:  # type: ignore[override]
        return isinstance(other, (Size, int, float)) and Size.of(other).terms == self.terms

    def __repr__(self) -> str:
        if not self.terms:
            return "Size(0)"
        parts = []
        for m, c in sorted(self.terms.items(), key=lambda mc: (mc[0].__class__ is Step, repr(mc[0]))):
            if m.__class__ is Step:
                parts.append(f"{c:g} {m.name}")
                continue
            i, j, k = m
            mono = "".join(v + (f"^{e}" if e > 1 else "") for v, e in (("b", i), ("s", j), ("t", k)) if e)
            parts.append(f"{c:g}{(' ' + mono) if mono else ''}")
        return "Size(" + " + ".join(parts) + ")"


def monomials(sizes: Iterable[Any]) -> List[Term]:
    """The monomials (and :class:`Step` terms) the sizes use, the constant first."""
    seen = {ONE: None}
    for x in sizes:
        if isinstance(x, Size):
            for m in x.terms:
                seen.setdefault(m, None)
    return list(seen)


def coefficient_matrix(sizes: Sequence[Any], basis: Sequence[Term]) -> Any:
    """``len(sizes) x len(basis)`` coefficients (numpy), numbers as constants."""
    import numpy as np

    index = {m: i for i, m in enumerate(basis)}
    C = np.zeros((len(sizes), len(basis)), dtype=float)
    for r, x in enumerate(sizes):
        if isinstance(x, Size):
            for m, c in x.terms.items():
                C[r, index[m]] = c
        else:
            C[r, 0] = float(x)
    return C


def monomial_values(basis: Sequence[Term], b: Any, s: Any, t: Any) -> Any:
    """The basis's monomials (and :class:`Step` terms) at batch ``b``, sequence ``s`` and
    target ``t`` (numbers or numpy arrays of one shape): ``len(basis) x ...``."""
    import numpy as np

    b, s, t = (np.asarray(v, dtype=float) for v in (b, s, t))
    shape = np.broadcast(b, s, t).shape
    return np.stack([np.broadcast_to(np.asarray(m.values(b, s, t), dtype=float) if m.__class__ is Step
                                     else b ** m[0] * s ** m[1] * t ** m[2], shape) for m in basis])
