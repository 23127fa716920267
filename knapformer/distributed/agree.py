"""Cross-rank agreement: one small all-gather that every rank joins before data moves.

A problem only one rank can see (its lengths, the rows of its tensor, a plan it was handed, a
layer it skipped) must not make that rank leave the collective the others are entering: every
rank would hang, or gloo would abort on mismatched buffers. So every exchange of the balancer
first joins :func:`agree` with a description of the call (:class:`Call`: which operation, its
index in the step, the step, and the values that must match, e.g. dtypes and trailing shapes).
The row is fixed-size whatever the call — an error flag, digests of the call, a few flags, and
``capacity`` slots of *payload* — so ranks that are at *different* calls still meet in the same
collective (one ``all_gather`` of the rows) and find out at once whether any rank failed or any
value differs. The payload is what a call needs from every rank besides the check: ``plan``
sends its lengths there, so that planning costs one collective, not an agreement and a gather.
Only then (the error path) do two more collectives gather every rank's description and error
text, so that every rank raises the same message naming each rank's call and values — the
ranks that did nothing wrong carry the culprit's reason.

``capacity`` must be the same on every rank: it is the group's, changed only where every rank
sees the same table (a payload longer than it is gathered in a second collective, and the
capacity then grows for the next agreements: :class:`~knapformer.distributed.checks.StepChecks`).
Values are 62-bit digests (:func:`digest62`). With NCCL the agreement runs on a gloo twin of the
group (CPU tensors: no device synchronisation).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import knapformer.distributed.lifetime as lifetime
from knapformer.attention.bounds import to_device
from knapformer.distributed.backends import control_device
from knapformer.errors import BalancerInputError, DivergentCallError, InvalidPlanError, PlanMismatchError

__all__ = [
    "DEFAULT_CAPACITY",
    "Agreement",
    "Call",
    "agree",
    "agree_rows",
    "describe",
    "describe_parts",
    "digest62",
    "digest_of",
    "gather_int_rows",
    "gather_ints",
    "gather_text",
    "group_device",
    "signature",
]


NUM_FLAGS = 3
"""Flag slots every agreement row carries (the row's size must not depend on the call)."""

DEFAULT_CAPACITY = 16
"""Payload slots of a new group's agreement rows (``plan``: the measured seconds and up to 15
lengths in one collective; more grow it)."""

_HEAD = 1 + 5 + NUM_FLAGS + 1
"""A row before its payload: the error flag, 5 digests of the call, the flags, the payload's length."""


def digest62(text: str | bytes) -> int:
    """A non-negative 62-bit digest (negatable within int64)."""
    data = text.encode() if isinstance(text, str) else text
    return int(hashlib.sha256(data).hexdigest()[:15], 16) >> 2


def group_device(group) -> torch.device:
    """Where small tensors of ``group``'s collectives live: the host when the group has a CPU
    backend (gloo, also beside NCCL), else the group's device (:mod:`.backends`)."""
    return control_device(group)


def _host_table(t: torch.Tensor) -> np.ndarray:
    """A gathered control tensor's values on the host (a read of host memory for host tensors,
    which the control group uses whenever it can: no device synchronisation)."""
    return (t if t.device.type == "cpu" else t.cpu()).numpy()


def gather_int_rows(control, values: list[int], counts: list[int], phase: str) -> list[list[int]]:
    """Every rank's ``values`` (rank r has ``counts[r]`` of them, known to all), one list per
    rank: one even all-gather of int64 rows padded to the longest."""
    width = max(max(counts, default=0), 1)
    row = np.zeros(width, dtype=np.int64)
    row[: len(values)] = values
    t = to_device(torch.from_numpy(row), group_device(control))
    parts = [torch.empty_like(t) for _ in range(len(counts))]
    lifetime.collective(lambda: dist.all_gather(parts, t, group=control), (t, *parts), phase, control)
    table = _host_table(torch.stack(parts)) if counts else np.zeros((0, width), dtype=np.int64)
    return [table[r, : counts[r]].tolist() for r in range(len(counts))]


def gather_ints(control, values: list[int], counts: list[int], phase: str) -> np.ndarray:
    """:func:`gather_int_rows`, concatenated in rank order."""
    rows = gather_int_rows(control, values, counts, phase)
    return np.asarray([v for r in rows for v in r], dtype=np.int64)


def signature(tensors, names=None) -> tuple[tuple[str, str], ...]:
    """(name, "dtype (·, *trailing shape)") of each tensor: what must match across ranks for
    tensors exchanged together (the token count may differ)."""
    out = []
    for i, t in enumerate(tensors):
        name = f"argument {i}" + (f" ({names[i]})" if names and i < len(names) and names[i] else "")
        text = describe(t) if isinstance(t, torch.Tensor) else f"not a tensor ({type(t).__name__})"
        out.append((name, text))
    return tuple(out)


def describe(t: torch.Tensor) -> str:
    """``float32 (·, 4, 16)``: dtype and shape with the token dimension left open."""
    return describe_parts(t.dtype, tuple(t.shape[1:]))


@functools.lru_cache(maxsize=1024)
def describe_parts(dtype: torch.dtype, trailing: tuple[int, ...]) -> str:
    """:func:`describe` of a tensor of ``dtype`` whose trailing shape is ``trailing``."""
    ndim = len(trailing) + 1
    dims = ", ".join(["·", *map(str, trailing)]) + ("," if ndim == 1 else "")
    return f"{str(dtype).removeprefix('torch.')} ({dims})"


@dataclass(frozen=True)
class Call:
    """What one rank is doing at an agreement point."""

    op: str
    """The operation (``route``, ``pre_attn``, ...)."""
    index: int
    """Its index among this step's agreed calls (0 = the first after ``plan``)."""
    step: int
    """Plans made so far (the step)."""
    values: tuple[tuple[str, str], ...] = ()
    """(name, text) of what must be equal on every rank."""

    def describe(self) -> str:
        return f"{self.op} (call {self.index} of step {self.step})"


@functools.lru_cache(maxsize=4096)
def digest_of(values: tuple) -> int:
    """The digest of an operation name or of a call's values (cached: the same few recur every
    layer of every step)."""
    return digest62(json.dumps(values))


def _row(call: Call, error: str, plan: int, flags, payload, capacity: int) -> np.ndarray:
    row = np.zeros(_HEAD + capacity, dtype=np.int64)
    row[:6] = [1 if error else 0, digest_of(call.op), call.index, call.step, digest_of(call.values), plan]
    row[6 : 6 + len(flags)] = [int(f) for f in flags]
    row[_HEAD - 1] = len(payload)
    n = min(len(payload), capacity)
    row[_HEAD : _HEAD + n] = payload[:n]
    return row


@dataclass(frozen=True)
class Agreement:
    """What an agreement learned besides "no problem": the maximum of each flag over the group,
    and every rank's payload (``counts[r]`` values; only the first ``capacity`` are in
    ``table[r]`` — :attr:`overflow` says some rank sent more)."""

    flags: list[int]
    counts: list[int]
    table: np.ndarray
    """(group size, capacity) payload slots."""
    gathered: list[list[int]] | None = None
    """Every rank's whole payload, where some overflowed and a second gather fetched them."""

    @property
    def overflow(self) -> bool:
        return bool(self.counts) and max(self.counts) > self.table.shape[1]

    def payloads(self) -> list[list[int]]:
        """Every rank's payload (after an :attr:`overflow`, from :attr:`gathered`)."""
        if self.gathered is not None:
            return self.gathered
        assert not self.overflow, "a payload beyond the capacity is gathered separately"
        return [self.table[r, :c].tolist() for r, c in enumerate(self.counts)]


def agree(
    group, call: Call, error: str = "", *, plan: int = 0, control=None, what: str = "input", flags=()
) -> list[int]:
    """Raise the same error on every rank of ``group`` if any rank reports ``error``, is at a
    different call, holds a different plan (``plan``: its digest, 0 once agreed) or differs in
    ``call.values``. ``control``: the group to run on (a gloo twin of an NCCL group); ``what``:
    what this rank's ``error`` is about (the message says "bad <what>"; ``divergent``: a call the
    other ranks did not make, raised as :class:`DivergentCallError`). ``flags``: small
    non-negative ints this rank contributes; returns their maximum over the group (what any
    rank has, learned in the same collective). Rows of :data:`DEFAULT_CAPACITY` (see
    :func:`agree_rows` for a group whose capacity grew)."""
    got = agree_rows(group, call, error, plan=plan, control=control, what=what, flags=flags)
    return got.flags


def agree_rows(
    group,
    call: Call,
    error: str = "",
    *,
    plan: int = 0,
    control=None,
    what: str = "input",
    flags=(),
    payload: Sequence[int] = (),
    capacity: int = DEFAULT_CAPACITY,
) -> Agreement:
    """:func:`agree`, also gathering every rank's ``payload`` (ints) in the same collective:
    one ``all_gather`` of fixed-size rows (``capacity`` payload slots, the same on every rank)."""
    control = group if control is None else control
    if len(flags) > NUM_FLAGS:
        raise ValueError(f"agree takes at most {NUM_FLAGS} flags, got {len(flags)}")
    # a fixed-size row whatever the call: ranks at different calls still meet
    t = to_device(torch.from_numpy(_row(call, error, plan, flags, list(payload), capacity)), group_device(control))
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(control))]
    phase = call.op if call.op in ("plan", "use_plan") else f"{call.op} (its agreement)"
    lifetime.collective(lambda: dist.all_gather(parts, t, group=control), (t, *parts), phase, control)
    table = _host_table(torch.stack(parts))
    if not table[:, 0].any() and (table[:, 1:6] == table[0, 1:6]).all():
        most = table[:, 6 : 6 + len(flags)].max(axis=0).tolist() if len(flags) else []
        return Agreement(most, table[:, _HEAD - 1].tolist(), table[:, _HEAD:])
    _raise(control, call, error, plan, what)
    raise AssertionError("unreachable: _raise raises")  # pragma: no cover


def gather_text(control, text: str) -> list[str]:
    """Every rank's ``text`` (two even-sized all-gathers: lengths, then padded bytes)."""
    device = group_device(control)
    size = dist.get_world_size(control)
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    n = to_device(torch.from_numpy(np.asarray([data.size], dtype=np.int64)), device)
    lens = [torch.empty_like(n) for _ in range(size)]
    lifetime.collective(lambda: dist.all_gather(lens, n, group=control), (n, *lens), "error report", control)
    sizes = _host_table(torch.cat(lens)).tolist()
    buf = np.zeros(max(max(sizes), 1), dtype=np.uint8)
    buf[: data.size] = data
    t = to_device(torch.from_numpy(buf), device)
    parts = [torch.empty_like(t) for _ in range(size)]
    lifetime.collective(lambda: dist.all_gather(parts, t, group=control), (t, *parts), "error report", control)
    table = _host_table(torch.stack(parts))
    return [bytes(table[r, :k]).decode() for r, k in enumerate(sizes)]


def _by_value(values: list[str], form: str) -> str:
    """``form`` for each distinct value with the ranks that have it (in order of first rank)."""
    ranks: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        ranks.setdefault(v, []).append(r)
    return ", ".join(
        form.format(value=v, ranks=f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}") for v, rs in ranks.items()
    )


def _raise(control, call: Call, error: str, plan: int, what: str) -> None:
    mine = {"op": call.op, "index": call.index, "step": call.step, "values": call.values, "error": error, "plan": plan}
    mine["what"] = what
    table = [json.loads(t) for t in gather_text(control, json.dumps(mine))]
    me = dist.get_rank(control)
    where = f"SequenceBalancer.{call.op}"
    bad = [r for r, d in enumerate(table) if d["error"]]
    # a rank that only saw a peer's call differ ("peer") is named only when no rank reported
    # the problem itself
    bad = [r for r in bad if table[r]["what"] != "peer"] or bad
    if bad:
        reasons = "; ".join(f"rank {r}: {table[r]['error']}" for r in bad) if len(bad) > 1 else table[bad[0]]["error"]
        what = table[bad[0]]["what"]
        if what == "plan":  # a plan the executor cannot run, found in a layer of a scheduled step
            raise InvalidPlanError(f"{where}: on rank(s) {bad} (this is rank {me}): {reasons}")
        if what == "divergent":  # a call only some ranks made, found against the step's schedule
            raise DivergentCallError(
                f"{where}: ranks made different calls on rank(s) {bad} (this is rank {me}): {reasons}. Every rank "
                "of the group must make the same exchanges in the same order each step"
            )
        raise BalancerInputError(f"{where}: bad {what} on rank(s) {bad} (this is rank {me}): {reasons}")
    calls = [Call(d["op"], d["index"], d["step"]).describe() for d in table]
    if len(set(calls)) > 1:
        detail = _by_value(calls, "{ranks} at {value}")
        raise DivergentCallError(
            f"{where}: ranks made different calls before data moved: {detail} (this is rank {me}). Every rank "
            "of the group must make the same exchanges in the same order each step (a layer skipped on some "
            "ranks, a data-dependent branch, or a different number of plan() calls breaks that)"
        )
    if len({d["plan"] for d in table}) > 1:
        ranks = [r for r, d in enumerate(table) if d["plan"] != table[0]["plan"]]
        raise PlanMismatchError(
            f"{where}: ranks disagree before data moves: the plan differs on rank(s) {ranks} from rank 0 "
            f"(this is rank {me})"
        )
    names = list(dict.fromkeys(n for d in table for n, _ in d["values"]))
    parts = []
    for n in names:
        texts = [dict(map(tuple, d["values"])).get(n, "absent") for d in table]
        if len(set(texts)) > 1:
            parts.append(f"{n}: " + _by_value(texts, "{value} on {ranks}"))
    raise BalancerInputError(f"{where}: ranks disagree before data moves: {'; '.join(parts)} (this is rank {me})")
