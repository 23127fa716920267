"""The seam's small pieces: the diffusers import check and builder, the packed output, block
calls, empty-safe concatenation, grid ids, and a synthetic batch as samples and targets (the
families reach them through :mod:`knapformer.integrations.seam`)."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from knapformer.data.batches import Batch
from knapformer.integrations.configs import FluxSizes

__all__ = [
    "BatchSample",
    "PackedOutput",
    "batch_samples",
    "build_diffusers",
    "call_block",
    "cat_or_empty",
    "diffusers_workload",
    "embed_latents",
    "grid_ids",
    "model_and_samples",
    "patchify",
    "require_diffusers",
    "square_image",
    "stack_scalars",
    "through_root",
    "unpatchify",
    "visual_targets",
]

_MIN, _MAX = (0, 35), (0, 43)


def require_diffusers():
    """Import diffusers or raise one clear error naming the extra."""
    try:
        import diffusers
    except ImportError as exc:
        raise ImportError(
            "knapformer's diffusers integrations need diffusers>=0.35,<0.43: pip install 'knapformer[diffusers]'"
        ) from exc
    version = tuple(int(p) for p in diffusers.__version__.split(".")[:2] if p.isdigit())
    if not (_MIN <= version < _MAX):
        raise ImportError(
            f"diffusers {diffusers.__version__} is not supported (need >=0.35,<0.43): "
            "pip install 'knapformer[diffusers]'"
        )
    return diffusers


def build_diffusers(name: str, cfg, *same: str, **args):
    """A randomly initialised diffusers model class ``name`` (no download) of ``cfg``'s sizes:
    its heads (``num_attention_heads``, ``attention_head_dim`` from ``num_heads``,
    ``head_dim``), the config fields ``same`` under their own names, and ``args``."""
    diffusers = require_diffusers()
    heads = {"num_attention_heads": cfg.num_heads, "attention_head_dim": cfg.head_dim}
    return getattr(diffusers, name)(**heads, **{f: getattr(cfg, f) for f in same}, **args)


def diffusers_workload(model, num_layers: int, gamma: float = 1.0):
    """The planner's cost model of a diffusers DiT whose blocks cost the paper's ``24·d²`` FLOPs
    per token in every stream (q/k/v/o and a 4× MLP): d_model the inner width (heads × head dim
    of ``model.config``), ``num_layers`` blocks, its heads bounding the Ulysses degrees."""
    from knapformer.workload import WorkloadModel

    c = model.config
    d = c.num_attention_heads * c.attention_head_dim
    return WorkloadModel(d_model=d, gamma=gamma, num_layers=num_layers, num_heads=c.num_attention_heads)


def flux_sizes(cfg: FluxSizes) -> dict:
    """The constructor arguments a Flux-style preset's sizes give a diffusers Flux or Flux.2."""
    return {
        "patch_size": 1,
        "in_channels": cfg.in_dim,
        "num_layers": cfg.num_double,
        "num_single_layers": cfg.num_single,
        "joint_attention_dim": cfg.text_dim,
    }


class PackedOutput(list):
    """Per-sample outputs (a list, original order) plus ``flat``: all of this rank's output rows
    as one tensor. Build the loss from ``flat`` (or add ``0 * flat.sum()`` to a loss built from
    the list): on a rank with no samples ``flat`` is empty but still connected to the step's
    collectives, so ``loss.backward()`` there joins the backward exchanges instead of leaving
    the other ranks waiting."""

    flat: torch.Tensor

    @classmethod
    def of(cls, parts: Sequence[torch.Tensor], flat: torch.Tensor):
        out = cls(parts)
        out.flat = flat
        return out


def grid_ids(n: int, axes: int = 3, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(n, axes) position ids of n image tokens on a near-square grid (the last two axes are
    row and column; the others 0)."""
    w = max(1, int(n**0.5))
    pos = torch.arange(n, dtype=dtype)
    ids = torch.zeros(n, axes, dtype=dtype)
    ids[:, -2], ids[:, -1] = pos // w, pos % w
    return ids


_CALLERS: dict[int, torch.nn.Module] = {}
"""id(module) -> the wrapper whose call runs it (:func:`called_through`)."""


@contextlib.contextmanager
def called_through(wrapper: torch.nn.Module, module: torch.nn.Module) -> Iterator[None]:
    """Within the block, :func:`through_root` of ``module`` calls ``wrapper()`` — a
    ``DistributedDataParallel`` around it — so that the wrapper's own forward logic runs (DDP
    prepares its gradient reduction there) while the families read ``module``'s config and
    submodules. Private to the integrations (Automodel's DDP mode uses it)."""
    _CALLERS[id(module)] = wrapper
    try:
        yield
    finally:
        _CALLERS.pop(id(module), None)


def through_root(model: torch.nn.Module, run: Callable[[], PackedOutput]) -> PackedOutput:
    """``run()`` — a family's packed forward — as the model's own call, in place of its stock
    ``forward``: ``model()`` runs the hooks a stock call runs on the root. Why: a trainer that
    shards the root with FSDP2 (``fully_shard(model)`` after the blocks) all-gathers the root's
    parameters in its pre-forward hook and hooks the root's backward all-gather on the outputs it
    sees; calling the root's modules directly skips both (a sharded root then fails with "mixed
    torch.Tensor and DTensor"). The outputs leave the call as ``(per-sample list, flat)``, so the
    hooks see ``flat`` too: on a rank with no sample it is the only output, and a rank whose
    outputs carry no hook skips the root's backward all-gather that its peers make first (a
    deadlock). Hooks of your own on the root run too, and see a call without arguments.
    Returns ``run()``'s output, holding the tensors the call returned."""
    box: dict[str, PackedOutput] = {}
    caller = _CALLERS.get(id(model), model)

    def forward(*args, **kwargs):
        box["out"] = out = run()
        return list(out), out.flat

    saved = model.__dict__.get("forward")  # an instance forward (a hook's or an adapter's) comes back
    model.forward = forward
    try:
        with warnings.catch_warnings():
            # the per-sample outputs are views of ``flat``, which FSDP2 warns of (an in-place op
            # on one would drop its hook): ``flat``'s own hook still runs the root's backward
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            parts, flat = caller()
    finally:
        if saved is None:
            del model.forward
        else:
            model.forward = saved
    out = box["out"]
    res = type(out)(parts)
    res.__dict__.update(out.__dict__)
    res.flat = flat
    return res


def model_and_samples(name: str, first, second) -> tuple[torch.nn.Module | None, object]:
    """``(model, samples)`` of a ``<family>_seq_lens(model, samples)`` call. Every family's
    lengths function takes the model first (a family whose lengths depend on its config, such
    as SD3's patch size, then cannot be planned with the wrong one); the old one-argument form
    ``(samples)`` of Flux, Flux.2, Qwen-Image, SD3 and torchtitan's Flux still works until 0.4,
    with a ``DeprecationWarning`` (returns ``(None, samples)``)."""
    if isinstance(first, torch.nn.Module):
        return first, second
    warnings.warn(
        f"{name}(samples) is deprecated and goes in 0.4: pass the model first, {name}(model, samples), "
        "as every family's lengths function takes it",
        DeprecationWarning,
        stacklevel=3,
    )
    return None, first


def call_block(model, block, *args):
    """``block(*args)``, through the model's activation checkpointing when it is on (the
    recompute sees the packed metadata: it travels in the arguments)."""
    if torch.is_grad_enabled() and getattr(model, "gradient_checkpointing", False):
        return model._gradient_checkpointing_func(block, *args)
    return block(*args)


def cat_or_empty(parts, empty_shape, device, dtype) -> torch.Tensor:
    """``torch.cat(parts)`` on ``device``/``dtype``, or zeros of ``empty_shape`` for no parts."""
    t = (
        torch.cat([p.to(device, non_blocking=True) for p in parts])
        if parts
        else torch.zeros(empty_shape, device=device)
    )
    return t if dtype is None else t.to(dtype)


def embed_latents(embed, proj, latents: Sequence[torch.Tensor], device, dtype) -> torch.Tensor:
    """(T, D): each latent patch-embedded on its own (``embed(x[None])[0]``, a batch of one, so a
    module with a positional crop per size gets each sample's own), concatenated; with none,
    ``proj`` (its convolution) runs on no input, so a rank without samples gets its gradients."""
    if latents:
        return torch.cat([embed(x[None].to(device, dtype, non_blocking=True))[0] for x in latents])
    return proj(torch.zeros(0, proj.in_channels, *proj.kernel_size, device=device, dtype=dtype)).flatten(1)


def stack_scalars(values, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(n,) from per-sample scalars (tensors or numbers), in ``dtype``; None keeps the values'
    precision: float64 if any is, else float32. Timesteps keep theirs: the stock models
    embed an fp32 timestep in fp32, and rounding 998.7 to bf16 first gives 1000 — a different
    sinusoidal embedding. A family casts where its stock forward casts (Flux, Flux.2 and
    Qwen-Image cast timesteps to the hidden states' dtype)."""
    if dtype is None:  # float64 if any value is (fp64 runs), else float32 (holds bf16/fp16 exactly)
        wide = any(torch.as_tensor(v).dtype == torch.float64 for v in values)
        dtype = torch.float64 if wide else torch.float32
    if not values:
        return torch.zeros(0, device=device, dtype=dtype)
    return torch.stack([torch.as_tensor(v).reshape(()) for v in values]).to(
        device=device, dtype=dtype, non_blocking=True
    )


@dataclass(frozen=True)
class BatchSample:
    """One sequence of a synthetic batch, split into its text rows and its visual rows."""

    text: torch.Tensor
    visual: torch.Tensor
    target: torch.Tensor
    timestep: torch.Tensor
    vec: torch.Tensor


def batch_samples(batch: Batch) -> list[BatchSample]:
    """The sequences of a synthetic batch (text rows first in each, as the data codes make them)."""
    out, start = [], 0
    for n, t, ts, vec in zip(batch.seq_lens, batch.txt_lens.tolist(), batch.t, batch.vec):
        rows = slice(start + t, start + n)
        out.append(BatchSample(batch.x[start : start + t], batch.x[rows], batch.target[rows], ts, vec))
        start += n
    return out


def square_image(s: BatchSample, width: int) -> tuple[torch.Tensor, int, int]:
    """A synthetic sequence's visual rows (``width`` features each; a text-only sequence gets one
    zero stand-in row) and the most square exact (rows, columns) grid they fill."""
    rows = s.visual[:, :width] if s.visual.shape[0] else s.visual.new_zeros(1, width)
    n = rows.shape[0]
    h = next(d for d in range(math.isqrt(n), 0, -1) if n % d == 0)
    return rows, h, n // h


def patchify(
    latents: Sequence[torch.Tensor], patch, *, channels_first: bool = False
) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """Latents ``(C, g0·p0, g1·p1, ...)`` -> (token rows of every sample, one after another;
    each sample's grid ``(g0, g1, ...)``): the inverse of :func:`unpatchify`, in its row layout
    (row-major grid; a patch's values in ``(p0, p1, ..., C)`` order, or ``(C, p0, p1, ...)``
    with ``channels_first``). For a family whose stock model patchifies inside ``forward``
    (a ``Conv3d`` patch embedding runs on the latents as they are; this is for targets, and for
    models that take packed patches). A side that the patch does not divide is an error."""
    n, rows, grids = len(patch), [], []
    g_axes = [1 + 2 * i for i in range(n)]
    p_axes = [2 + 2 * i for i in range(n)]
    order = g_axes + ([0, *p_axes] if channels_first else [*p_axes, 0])
    for i, x in enumerate(latents):
        c, *sides = x.shape
        if len(sides) != n or any(s % p for s, p in zip(sides, patch)):
            raise ValueError(
                f"latents {i}: shape {tuple(x.shape)} is not (C, ...) with sides divisible by {tuple(patch)}"
            )
        grid = tuple(s // p for s, p in zip(sides, patch))
        split = x.reshape(c, *(v for g, p in zip(grid, patch) for v in (g, p)))
        rows.append(split.permute(order).reshape(math.prod(grid), -1))
        grids.append(grid)
    return (torch.cat(rows) if rows else torch.zeros(0, 0)), grids


def unpatchify(rows: torch.Tensor, grids, patch, *, channels_first: bool = False) -> list[torch.Tensor]:
    """Each sample's token rows back to its latent ``(C, g0·p0, g1·p1, ...)``, as the stock
    models unpatchify: ``rows`` holds the samples' tokens one after another (sample i on grid
    ``grids[i]``, row-major), each row a patch's values in ``(p0, p1, ..., C)`` order, or
    ``(C, p0, p1, ...)`` with ``channels_first`` (HunyuanVideo's). Why in the seam: every family
    with patched latents ends its forward with this inverse (and makes synthetic latents with it)."""
    n, outs = len(patch), []
    channel, first = (n, n + 1) if channels_first else (2 * n, n)
    order = [channel] + [a for i in range(n) for a in (i, first + i)]
    for r, grid in zip(torch.split(rows, [math.prod(g) for g in grids]) if grids else (), grids):
        o = r.reshape(*grid, -1, *patch) if channels_first else r.reshape(*grid, *patch, -1)
        o = o.permute(order)
        outs.append(o.reshape(o.shape[0], *(g * p for g, p in zip(grid, patch))))
    return outs


def visual_targets(batch: Batch, rows: Sequence[int]) -> torch.Tensor:
    """The targets of the first ``rows[i]`` visual rows of each sequence, concatenated (what a
    model that outputs only visual tokens is compared with); rows a sequence lacks (a text-only
    sequence's stand-in visual token) get zero targets."""
    parts = []
    for s, r in zip(batch_samples(batch), rows):
        t = s.target[:r]
        parts.append(torch.cat([t, t.new_zeros(r - t.shape[0], t.shape[1])]) if t.shape[0] < r else t)
    return torch.cat(parts) if parts else batch.target[:0]
