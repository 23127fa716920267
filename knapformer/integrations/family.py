"""The one seam the tools drive a model through: :class:`ModelFamily`.

A family adapter, bound to one model config, says how to build the model, how to make its
inputs from a synthetic :class:`~knapformer.data.batches.Batch`, how to run it through an
executor planned for the step, how to time one of its blocks (the calibrator) and what it
costs (the planner). The simulator, the calibrator and the tests only ever call these methods;
they find a family by name through :mod:`knapformer.integrations.registry`. Every adapter
follows the integration seam: the caller plans the step once with ``inputs.seq_lens`` and
passes the planned executor to :meth:`ModelFamily.forward`.

:class:`PackedFamily` is that adapter for a family run through a packed forward (the seam of
:mod:`knapformer.integrations.seam`): it needs the family's builder, its synthetic samples,
their lengths and the packed forward, and derives the rest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn as nn

from knapformer.data.batches import Batch
from knapformer.executor import TokenExecutor
from knapformer.workload import WorkloadModel

__all__ = ["BlockRunner", "ModelDims", "ModelFamily", "PackedFamily", "StepInputs", "block_runner"]

BlockRunner = tuple[str, int, Callable[[Sequence[int], bool], Callable[[], None]]]
"""(block type, layers of that type, make(seq_lens, backward) -> a callable running one block)."""


@dataclass(frozen=True)
class StepInputs:
    """What one rank feeds its model in one step (built once per step, used by both runs)."""

    seq_lens: list[int]
    """Lengths to plan the step with (tokens per sample, as the model lays them out)."""
    args: Any
    """The family's own inputs (a batch, or diffusers samples)."""
    target: torch.Tensor
    """Rows the output is compared with, in the output's order."""


@dataclass(frozen=True)
class ModelDims:
    """The sizes the tools need: synthetic batches (in/vec/out), cost model and heads."""

    dim: int
    num_heads: int
    num_kv_heads: int | None
    num_layers: int
    in_dim: int
    vec_dim: int
    out_dim: int


class ModelFamily(ABC):
    """Adapter interface (see the module docstring). ``presets`` maps a size name to a config
    factory: the preset ``<family name>-<size>`` is ``presets[size]()``."""

    name: ClassVar[str]
    presets: ClassVar[dict[str, Callable[[], Any]]] = {}

    def __init__(self, config: Any) -> None:
        self.config = config

    def dims(self) -> ModelDims:
        """The config's sizes (configs name them ``dim``, ``num_heads``, ... as the presets do)."""
        c = self.config
        return ModelDims(
            dim=c.dim,
            num_heads=c.num_heads,
            num_kv_heads=getattr(c, "num_kv_heads", None),
            num_layers=c.num_layers,
            in_dim=c.in_dim,
            vec_dim=getattr(c, "vec_dim", 1),
            out_dim=c.out_dim,
        )

    def workload(self, gamma: float = 1.0) -> WorkloadModel:
        """The planner's cost model in the paper's form (families with other terms override)."""
        d = self.dims()
        return WorkloadModel(
            d_model=d.dim, gamma=gamma, num_layers=d.num_layers, num_heads=d.num_heads, num_kv_heads=d.num_kv_heads
        )

    @abstractmethod
    def build(self) -> nn.Module:
        """A freshly initialised model (on CPU; the caller moves it)."""

    def inputs(self, batch: Batch) -> StepInputs:
        """This step's inputs from a synthetic batch (the reference models take it as is)."""
        return StepInputs(seq_lens=list(batch.seq_lens), args=batch, target=batch.target)

    @abstractmethod
    def forward(self, model: nn.Module, inputs: StepInputs, executor: TokenExecutor) -> torch.Tensor:
        """Output rows aligned with ``inputs.target``, through an executor planned for the step."""

    def enable_checkpointing(self, model: nn.Module) -> nn.Module:
        """Activation checkpointing per block, the way this family's models do it."""
        if hasattr(model, "enable_gradient_checkpointing"):  # diffusers models
            model.enable_gradient_checkpointing()
            return model
        raise ValueError(f"activation checkpointing is not supported for {self.name} models")

    def blocks(self, device: torch.device, dtype: torch.dtype, causal: bool) -> list[BlockRunner]:
        """One runner per block type for the calibrator."""
        raise ValueError(f"timing blocks of {self.name} models is not supported")


class PackedFamily(ModelFamily):
    """A :class:`ModelFamily` whose model runs through a packed forward. A subclass sets (each a
    ``staticmethod``) ``build_model`` (config -> model), ``packed_forward`` (model, samples,
    executor -> a :class:`~knapformer.integrations.seam.PackedOutput`), ``synthetic`` (batch,
    config, *, seed -> the samples of a synthetic batch) and ``lengths`` (samples -> tokens of
    each, as the packed forward lays them out), or overrides :meth:`seq_lens` where the lengths
    need the config; :meth:`target_rows` where the output rows are not the ``latents`` rows.
    Building, inputs, the forward and the cost model follow."""

    build_model: ClassVar[Callable[[Any], nn.Module]]
    packed_forward: ClassVar[Callable[..., Any]]
    synthetic: ClassVar[Callable[..., list]]
    lengths: ClassVar[Callable[[Sequence], list[int]]]

    def samples(self, batch: Batch) -> list:
        """The family's samples of a synthetic batch (one per sequence)."""
        return type(self).synthetic(batch, self.config, seed=0)

    def seq_lens(self, samples: Sequence) -> list[int]:
        """Tokens of each sample as the packed forward lays them out (the lengths to plan with)."""
        return type(self).lengths(samples)

    def target_rows(self, samples: Sequence) -> list[int]:
        """Output rows of each sample: its first visual rows (a text-only sequence's stand-in
        rows get zero targets). Default: the rows of each sample's ``latents``, read as
        ``(rows, channels)``; latents of any other rank (a video's ``(C, F, H, W)``) raise, since
        their first dimension is not a row count: such a family overrides this."""
        rows = []
        for s in samples:
            shape = tuple(s.latents.shape)
            if len(shape) != 2:
                raise TypeError(
                    f"{self.name}: PackedFamily.target_rows reads latents as (rows, channels), got a sample's "
                    f"latents of shape {shape}; override target_rows to return each sample's output rows "
                    "(e.g. its patched grid's size, as the Wan and HunyuanVideo 1.5 families do)"
                )
            rows.append(int(shape[0]))
        return rows

    def build(self) -> nn.Module:
        return type(self).build_model(self.config)

    def workload(self, gamma: float = 1.0) -> WorkloadModel:
        if hasattr(self.config, "workload"):
            return self.config.workload(gamma)
        return super().workload(gamma)

    def inputs(self, batch: Batch) -> StepInputs:
        from knapformer.integrations._diffusers import visual_targets

        samples = self.samples(batch)
        target = visual_targets(batch, self.target_rows(samples))
        return StepInputs(seq_lens=self.seq_lens(samples), args=samples, target=target)

    def forward(self, model: nn.Module, inputs: StepInputs, executor: TokenExecutor) -> torch.Tensor:
        return type(self).packed_forward(getattr(model, "module", model), inputs.args, executor).flat

    def block_model(self, device: torch.device, dtype: torch.dtype, causal: bool, **smaller) -> nn.Module:
        """A model of this config with ``smaller`` sizes (one layer, for the calibrator) on
        ``device`` in ``dtype``; refuses ``causal`` (these families attend bidirectionally)."""
        if causal:
            raise ValueError(
                f"--causal applies to the transformer presets only ({self.name} attention is bidirectional)"
            )
        model = type(self).build_model(replace(self.config, **smaller)).to(device)
        # (a dtype argument, even float32, makes diffusers warn)
        return model.to(dtype) if dtype != torch.float32 else model


def block_runner(forward: Callable[[], torch.Tensor], backward: bool) -> Callable[[], None]:
    """A callable that runs ``forward`` once (and its backward with a ones gradient)."""
    if not backward:

        def run():
            with torch.no_grad():
                forward()

        return run

    def run():
        out = forward()
        out.backward(torch.ones_like(out))

    return run
