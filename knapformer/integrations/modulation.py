"""The family seam's per-sample modulation: AdaLN ``linear(silu(temb))`` once per *sample*, its
result expanded to the stream's tokens by index ("batch = tokens": activations are one token
per batch row, so a per-token modulation row is the stock per-sample broadcast).

Stock blocks take their conditioning as an argument and feed it to an AdaLN module. Two hooks,
set on the model instance only, make that module run once per sample:

- a forward pre-hook on the AdaLN module (:func:`hook_norm`) finds a :class:`PerSample` among
  its arguments, hands the module the per-sample rows instead, and notes the stream's
  token -> row index on the module that computes the modulation (its ``linear``);
- a forward hook on that module (:func:`expand_rows`) expands its (samples, k·D) output to one
  row per token with one ``index_select``: the stock FLOPs, no (tokens, D) matmul.

A plain tensor passes through untouched, so the stock API keeps working. Families whose block
uses the conditioning tensor itself (Qwen-Image chunks it) note the rows from a block pre-hook
with :func:`note_rows` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["PerSample", "expand_rows", "hook_norm", "note_rows", "per_token_rows", "timestep_table"]

_ROWS = "_knapformer_rows"
_HOOKED = "_knapformer_hooked"


@dataclass(eq=False)
class PerSample:
    """Per-sample conditioning rows (S, D) and, per stream name, the row of each of its tokens."""

    per_sample: torch.Tensor
    rows: dict[str, torch.Tensor]


def note_rows(module, rows: torch.Tensor | None) -> None:
    """The next call of ``module`` (hooked with :func:`expand_rows`) expands its output to
    ``rows`` (None: the call is stock)."""
    setattr(module, _ROWS, rows)


def expand_rows(module, inputs, output):
    """Forward hook: (samples, k·D) modulation -> one row per token (when rows were noted)."""
    rows = getattr(module, _ROWS, None)
    if rows is None:
        return None
    setattr(module, _ROWS, None)
    return output.index_select(0, rows)


def _pick(stream: str, linear: str):
    """Pre-hook of an AdaLN module: a :class:`PerSample` argument (keyword ``emb`` or any
    positional one) becomes its per-sample rows; the stream's token rows are noted on the
    module's ``linear``."""

    def hook(module, args, kwargs):
        if isinstance(kwargs.get("emb"), PerSample):
            emb = kwargs["emb"]
            kwargs = {**kwargs, "emb": emb.per_sample}
        else:
            at = next((i for i, a in enumerate(args) if isinstance(a, PerSample)), None)
            if at is None:
                return None
            emb = args[at]
            args = (*args[:at], emb.per_sample, *args[at + 1 :])
        note_rows(getattr(module, linear), emb.rows[stream])
        return args, kwargs

    return hook


def hook_norm(norm, stream: str, linear: str = "linear") -> None:
    """Make the AdaLN module ``norm`` modulate per sample for ``stream``'s tokens (once per
    module: calling it again does nothing)."""
    if getattr(norm, _HOOKED, False):
        return
    norm.register_forward_pre_hook(_pick(stream, linear), with_kwargs=True)
    getattr(norm, linear).register_forward_hook(expand_rows)
    setattr(norm, _HOOKED, True)


def timestep_table(timesteps: Sequence, seq_lens: Sequence[int], device) -> tuple[torch.Tensor, ...]:
    """Model-level AdaLN with per-token timesteps (Wan 2.2 TI2V, LTX-Video), at home: from each
    sample's timestep — a scalar, or one per token — ``(first, per_token, tokens)``: each
    sample's first timestep (S,) for its per-sample embedding, whether it has one per token
    (S,) bool *on the host* (gather it with ``executor.gather_sequences``, which exchanges host
    rows on the host), and every token's timestep (T,) in float64, a side feature of the route
    that arrives exact. The timesteps keep their precision (see ``stack_scalars``)."""
    steps = [torch.as_tensor(t).reshape(-1) for t in timesteps]
    tokens = torch.cat([t.expand(n) for t, n in zip(steps, seq_lens)]) if steps else torch.zeros(0)
    first = torch.stack([t[0] for t in steps]) if steps else torch.zeros(0)
    per_token = torch.tensor([t.numel() > 1 for t in steps], dtype=torch.bool)  # on the host
    return first.to(device, non_blocking=True), per_token, tokens.to(device, torch.float64, non_blocking=True)


def per_token_rows(
    seq_id: torch.Tensor,
    per_sample: Sequence[torch.Tensor],
    per_token: torch.Tensor,
    timesteps: torch.Tensor,
    embed: Callable[[torch.Tensor], Sequence[torch.Tensor]],
) -> tuple[torch.Tensor, ...]:
    """After routing: each routed token's conditioning rows — its sample's rows of each
    ``per_sample`` tensor (``seq_id``: each token's sample, ``Routed.seq_id``), except for the
    tokens of samples with per-token timesteps (``per_token``, gathered per sample), whose rows
    ``embed(their routed timesteps)`` computes, as the stock models embed per-token timesteps.
    Only routed tokens are embedded: no rank embeds a token it does not hold. With ``per_token``
    on the host and no sample of per-token timesteps, this costs no device synchronisation
    (with some, finding their tokens does: one)."""
    rows = tuple(t.index_select(0, seq_id) for t in per_sample)
    if per_token.device.type == "cpu" and not per_token.numpy().any():  # (host flags: no sync)
        return rows
    own = per_token.to(seq_id.device, non_blocking=True).index_select(0, seq_id)
    if bool(own.any()):
        idx = torch.nonzero(own).flatten()
        fresh = embed(timesteps.index_select(0, idx))
        rows = tuple(t.index_copy(0, idx, f) for t, f in zip(rows, fresh))
    return rows
