"""Bag layouts: parse ``g{G}n{N}+...`` specs into bags of ranks.

``g2n4`` means four bags of two ranks each. Bags occupy contiguous ranks of the balancing
group, smaller bags first, so ``g1n2+g2n1`` is ``[[0], [1], [2, 3]]``. A group of size
``S = Σ G·N`` tiles a world of ``W`` ranks into ``W / S`` identical replicas.

Decision: a bag size listed twice (``g1n2+g1n3``) is rejected, not merged — it is almost
always a typo, and merging would hide it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["BagLayout", "parse_layout"]

_TERM = re.compile(r"^g(\d+)n(\d+)$")


@dataclass(frozen=True)
class BagLayout:
    """Bag sizes and counts of one balancing group, sorted by bag size."""

    terms: tuple[tuple[int, int], ...]
    """(bag size G, number of bags N) pairs, ascending G, G unique."""

    def __post_init__(self) -> None:
        if not self.terms:
            raise ValueError("bag layout has no terms")
        seen: set[int] = set()
        for g, n in self.terms:
            if g <= 0 or n <= 0:
                raise ValueError(f"bag term g{g}n{n}: G and N must be >= 1")
            if g in seen:
                raise ValueError(f"bag size {g} appears twice; write it once as g{g}n<total>")
            seen.add(g)
        if list(self.terms) != sorted(self.terms):
            object.__setattr__(self, "terms", tuple(sorted(self.terms)))

    @property
    def group_size(self) -> int:
        """Ranks in one balancing group (S)."""
        return sum(g * n for g, n in self.terms)

    @property
    def num_bags(self) -> int:
        return sum(n for _, n in self.terms)

    @property
    def bag_sizes(self) -> tuple[int, ...]:
        """Size of each bag, in bag order (ascending)."""
        return tuple(g for g, n in self.terms for _ in range(n))

    @property
    def bags(self) -> tuple[tuple[int, ...], ...]:
        """Group ranks of each bag: contiguous, smaller bags first."""
        out, start = [], 0
        for size in self.bag_sizes:
            out.append(tuple(range(start, start + size)))
            start += size
        return tuple(out)

    @property
    def max_bag_size(self) -> int:
        return self.terms[-1][0]

    def spec(self) -> str:
        """Canonical spec string (round-trips through :func:`parse_layout`)."""
        return "+".join(f"g{g}n{n}" for g, n in self.terms)

    def num_replicas(self, world_size: int) -> int:
        """How many identical groups tile ``world_size`` ranks."""
        if world_size <= 0:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        if world_size % self.group_size:
            raise ValueError(
                f"world size {world_size} is not divisible by the group size "
                f"{self.group_size} of layout {self.spec()!r}"
            )
        return world_size // self.group_size

    def replica_ranks(self, world_size: int) -> list[list[int]]:
        """Global ranks of each replica group (contiguous blocks)."""
        s = self.group_size
        return [list(range(r * s, (r + 1) * s)) for r in range(self.num_replicas(world_size))]

    @classmethod
    def single_rank(cls, num_ranks: int) -> BagLayout:
        """``g1n{num_ranks}``: every rank its own bag (pure data parallel when nothing moves)."""
        return cls(((1, num_ranks),))

    def __str__(self) -> str:
        return self.spec()


def parse_layout(spec: str | BagLayout) -> BagLayout:
    """Parse ``"g1n4 + g2n2"``; errors name the malformed term."""
    if isinstance(spec, BagLayout):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"bag spec must be a string, got {type(spec).__name__}")
    text = spec.replace(" ", "")
    if not text:
        raise ValueError("bag spec is empty; expected terms like 'g1n4+g2n2'")
    terms = []
    for raw in text.split("+"):
        m = _TERM.match(raw)
        if m is None:
            raise ValueError(f"malformed bag term {raw!r} in {spec!r}; expected g<size>n<count>, e.g. g2n4")
        g, n = int(m.group(1)), int(m.group(2))
        if g == 0 or n == 0:
            raise ValueError(f"bag term {raw!r} in {spec!r}: size G and count N must be >= 1")
        terms.append((g, n))
    return BagLayout(tuple(terms))
