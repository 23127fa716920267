"""The balancer's checks: what each call validates locally, and the agreement it then joins.

Every exchange of a step (``route``, each layer's ``pre_attn``/``post_attn``,
``gather_sequences``, ``route_context``, ``reverse_route``) first joins one agreement
(:func:`~knapformer.distributed.agree.agree`) carrying the operation, its index in the step,
the step, this rank's local problem (if any) and the values that must match, so that:

- bad input on one rank raises the same clear error on every rank before data moves;
- ranks that make different calls (a layer skipped on one rank) raise, naming each rank's call,
  instead of pairing mismatched collectives (a hang or a gloo abort);
- the first exchange after a new plan also agrees on the plan's digest.

A problem found where no exchange follows (``cross_attention`` is local; ``report_error``) is
*deferred*: it is raised at the next agreement, on every rank. Legend: R routed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from knapformer.distributed.agree import Call, agree, signature

__all__ = ["StepChecks", "as_lengths", "attention_problem", "rows_problem"]


def rows_problem(tensors: Sequence, rows: int, rank: int) -> str:
    """Why ``tensors`` cannot be exchanged as ``rows`` token rows each ("" if they can)."""
    if not tensors:
        return "no tensors given"
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return f"argument {i} is not a tensor with a token dimension"
        if t.shape[0] != rows:
            return f"argument {i} has {t.shape[0]} tokens on rank {rank}, expected {rows}"
        if t.device != tensors[0].device:
            return f"argument {i} is on {t.device}, argument 0 on {tensors[0].device}"
    return ""


def as_lengths(local_seq_lens) -> Sequence[int]:
    """Lengths as a list (a 1-D integer tensor is accepted, as numpy arrays are)."""
    if isinstance(local_seq_lens, torch.Tensor):
        if local_seq_lens.dim() != 1 or local_seq_lens.is_floating_point() or local_seq_lens.is_complex():
            raise ValueError(
                f"local_seq_lens must be a 1-D integer tensor or a list, got a {local_seq_lens.dtype} tensor "
                f"of shape {tuple(local_seq_lens.shape)}"
            )
        return local_seq_lens.tolist()
    return local_seq_lens


def attention_problem(q, k, v, routed: int, rank: int) -> str:
    """Why q, k, v cannot be this rank's routed attention inputs ("" if they can)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "q, k, v must be tensors"
    shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return f"q, k, v must be (tokens, heads, head_dim); got {shapes}"
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1] or k.shape[2] != q.shape[2]:
        return f"q (R, h, D), k (R, h_kv, D) and v (R, h_kv, Dv) must share R, h_kv and D; got {shapes}"
    if q.dtype != k.dtype or q.dtype != v.dtype:
        return f"q, k, v must share a dtype (or run under torch.autocast); got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[0] != routed:
        return f"q has {q.shape[0]} tokens on rank {rank}; routed tokens: {routed}"
    return ""


class StepChecks:
    """Agreement state of one balancer: the step, the calls agreed in it, the plan digest
    until it is agreed, and a deferred error."""

    def __init__(self, group, control, rank: int) -> None:
        self.group, self.control, self.rank = group, control, rank
        self.step = 0
        """Plans made or adopted so far."""
        self.index = 0
        """Calls agreed since the step's plan."""
        self.pending = ""
        self._plan_digest = 0
        self._plan_agreed = False

    def new_step(self, plan_digest: int, *, agreed: bool) -> None:
        self.step += 1
        self.index = 0
        self._plan_digest, self._plan_agreed = plan_digest, agreed

    def defer(self, message: str) -> None:
        """Raise ``message`` at the next agreement (the first deferred message wins)."""
        self.pending = self.pending or str(message)

    def take_pending(self) -> str:
        message, self.pending = self.pending, ""
        return message

    def agree(self, op: str, error: str = "", values: tuple[tuple[str, str], ...] = (), what: str = "input") -> None:
        """Join the agreement of call ``op`` (a deferred error takes precedence over ``error``,
        which is about ``what``)."""
        pending = self.take_pending()
        error, what = (pending, "input") if pending else (error, what)
        call = Call(op=op, index=self.index, step=self.step, values=values)
        plan = self._plan_digest if not self._plan_agreed else 0
        self.index += 1
        self._plan_agreed = True  # checked now, whatever the outcome (a mismatch raises here, once)
        agree(self.group, call, error, plan=plan, control=self.control, what=what)

    def tensors(self, op: str, tensors: Sequence, rows: int, *, error: str = "", names=None) -> None:
        """Agree on tensors exchanged together: ``rows`` token rows each on this rank, the same
        dtypes and trailing shapes on every rank."""
        error = error or rows_problem(tensors, rows, self.rank)
        self.agree(op, error, signature(tensors, names) if not error else ())
