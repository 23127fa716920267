"""Layouts: parse ``g{G}n{N}+...`` bag specs into bags of ranks, or ``auto`` (per-sequence groups).

``g2n4`` means four bags of two ranks each. Bags occupy contiguous ranks of the balancing
group, smaller bags first, so ``g1n2+g2n1`` is ``[[0], [1], [2, 3]]``. A group of size
``S = Σ G·N`` tiles a world of ``W`` ranks into ``W / S`` identical replicas.

Decision: a bag size listed twice (``g1n2+g1n3``) is rejected, not merged — it is almost
always a typo, and merging would hide it.

``auto`` lets the planner choose every sequence's group each step (:class:`AutoLayout`):
``auto`` spans the whole world (or the given process group), ``auto:n16`` tiles the world
into 16-rank groups, ``auto:max8`` caps the parallel degree; both combine (``auto:n16:max8``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["AutoLayout", "BagLayout", "Layout", "parse_layout"]

_TERM = re.compile(r"^g(\d+)n(\d+)$")
_AUTO = re.compile(r"^auto((?::(?:(?:n|max)\d+|noring))*)$")


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

    def __str__(self) -> str:
        return self.spec()


@dataclass(frozen=True)
class AutoLayout:
    """Per-sequence groups chosen by the planner every step (the moldable solver)."""

    num_ranks: int | None = None
    """Ranks of one balancing group; None = the whole world (resolved when the balancer is
    built, or from the number of per-rank length lists when planning)."""
    max_degree: int | None = None
    """Largest group a sequence may run on; None = as many ranks as the group (and the node
    rules of a link model) allow."""
    ring: bool = True
    """Groups the heads cannot split run as rings of Ulysses sub-groups (any size k). False:
    only sizes the heads split (at most the head count): no ring exchanges at all (also none
    of ``pre_attn``'s K/V all-gathers, which hold about a sequence's keys per member)."""

    def __post_init__(self) -> None:
        for name in ("num_ranks", "max_degree"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"auto layout: {name} must be an int >= 1, got {v!r}")
        if not isinstance(self.ring, bool):
            raise ValueError(f"auto layout: ring must be a bool, got {self.ring!r}")

    @property
    def group_size(self) -> int:
        if self.num_ranks is None:
            raise ValueError("layout 'auto' has no group size yet: resolve it for a world first")
        return self.num_ranks

    def resolved(self, num_ranks: int) -> AutoLayout:
        """This layout for a group of ``num_ranks`` ranks (unchanged if it names its size)."""
        if self.num_ranks is not None:
            return self
        return AutoLayout(num_ranks=num_ranks, max_degree=self.max_degree, ring=self.ring)

    def num_replicas(self, world_size: int) -> int:
        size = self.num_ranks or world_size
        if world_size <= 0 or world_size % size:
            raise ValueError(
                f"world size {world_size} is not divisible by the group size {size} of layout {self.spec()!r}"
            )
        return world_size // size

    def replica_ranks(self, world_size: int) -> list[list[int]]:
        s = self.num_ranks or world_size
        return [list(range(r * s, (r + 1) * s)) for r in range(self.num_replicas(world_size))]

    def spec(self) -> str:
        parts = ["auto"]
        if self.num_ranks is not None:
            parts.append(f"n{self.num_ranks}")
        if self.max_degree is not None:
            parts.append(f"max{self.max_degree}")
        if not self.ring:
            parts.append("noring")
        return ":".join(parts)

    def __str__(self) -> str:
        return self.spec()


Layout = BagLayout | AutoLayout


def parse_layout(spec: str | BagLayout | AutoLayout) -> BagLayout | AutoLayout:
    """Parse ``"g1n4 + g2n2"`` or ``"auto"``/``"auto:max8"``/``"auto:n16"``/``"auto:noring"``
    (options joined by ``:``); errors name the term."""
    if isinstance(spec, (BagLayout, AutoLayout)):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"bag spec must be a string, got {type(spec).__name__}")
    text = spec.replace(" ", "")
    m = _AUTO.match(text)
    if m:
        opts = {"n": None, "max": None}
        ring = True
        for part in filter(None, m.group(1).split(":")):
            if part == "noring":
                ring = False
                continue
            key = "max" if part.startswith("max") else "n"
            if opts[key] is not None:
                raise ValueError(f"layout {spec!r} gives {key} twice")
            opts[key] = int(part[len(key) :])
        return AutoLayout(num_ranks=opts["n"], max_degree=opts["max"], ring=ring)
    if text.startswith("auto"):
        raise ValueError(
            f"malformed auto layout {spec!r}; expected auto, auto:max<K>, auto:n<S>, auto:noring or those "
            "joined by ':' (auto:n<S>:max<K>:noring)"
        )
    return _parse_bags(spec, text)


def _parse_bags(spec: str, text: str) -> BagLayout:
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
