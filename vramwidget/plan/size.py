"""Sizes as polynomials in the batch, the sequence and the target length.

A step plan is built once per setup and read at any (batch, sequence): every size the
plan records is a :class:`Size`, a sum of ``coefficient x b^i s^j t^k`` terms (T = b s
tokens, the b s^2 of attention scores, an encoder-decoder's b t, b t^2 and b s t).  The
builder runs the same arithmetic on a Size as it would on numbers; an operation a
polynomial cannot express (a branch on a size, a power-of-two rounding) raises
:class:`NotPolynomial` and the plan is then built for one size alone.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Sequence, Tuple

Monomial = Tuple[int, int, int]      # exponents of (b, s, t)
ONE: Monomial = (0, 0, 0)


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
        out: Dict[Monomial, float] = {}
        for m1, c1 in self.terms.items():
            for m2, c2 in other.terms.items():
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
        for (i, j, k), c in sorted(self.terms.items()):
            mono = "".join(v + (f"^{e}" if e > 1 else "") for v, e in (("b", i), ("s", j), ("t", k)) if e)
            parts.append(f"{c:g}{(' ' + mono) if mono else ''}")
        return "Size(" + " + ".join(parts) + ")"


def monomials(sizes: Iterable[Any]) -> List[Monomial]:
    """The monomials the sizes use, the constant first."""
    seen = {ONE: None}
    for x in sizes:
        if isinstance(x, Size):
            for m in x.terms:
                seen.setdefault(m, None)
    return list(seen)


def coefficient_matrix(sizes: Sequence[Any], basis: Sequence[Monomial]) -> Any:
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


def monomial_values(basis: Sequence[Monomial], b: Any, s: Any, t: Any) -> Any:
    """The basis's monomials at batch ``b``, sequence ``s`` and target ``t`` (numbers or
    numpy arrays of one shape): ``len(basis) x ...``."""
    import numpy as np

    b, s, t = (np.asarray(v, dtype=float) for v in (b, s, t))
    shape = np.broadcast(b, s, t).shape
    return np.stack([np.broadcast_to(b ** i * s ** j * t ** k, shape) for i, j, k in basis])
