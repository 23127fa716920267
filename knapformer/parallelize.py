"""Training wrappers as users run them: activation checkpointing per block, FSDP2 per block.

FSDP2 (``fully_shard``) runs on gloo/CPU with torch >= 2.6 in our tests; where it is missing,
:func:`apply_fsdp` raises and callers fall back to DDP or a manual gradient all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["CheckpointedBlock", "apply_checkpointing", "apply_fsdp", "fsdp_available"]


class CheckpointedBlock(nn.Module):
    """Recompute the block in backward (its collectives run again, identically on all ranks)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _block_lists(model: nn.Module) -> list[nn.ModuleList]:
    return [
        m
        for name in ("blocks", "double_blocks", "single_blocks")
        if isinstance(m := getattr(model, name, None), nn.ModuleList)
    ]


def apply_checkpointing(model: nn.Module) -> nn.Module:
    """Wrap every block of a reference model (in place) with activation checkpointing."""
    for blocks in _block_lists(model):
        for i, b in enumerate(blocks):
            if not isinstance(b, CheckpointedBlock):
                blocks[i] = CheckpointedBlock(b)
    return model


def fsdp_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def apply_fsdp(model: nn.Module, group=None) -> nn.Module:
    """``fully_shard`` each block, then the root (gradients are averaged over the group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = None
    if group is not None and group is not dist.group.WORLD:
        mesh = DeviceMesh.from_group(group, device_type=_mesh_device_type(model, group))
    for blocks in _block_lists(model):
        for b in blocks:
            fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _mesh_device_type(model: nn.Module, group) -> str:
    """The device type of ``group``'s mesh: where the model's parameters live (a GPU rank's
    sub-group needs a ``cuda`` mesh, or FSDP2 all-gathers its shards through the wrong
    backend); for a model still on the meta device, the group's accelerator backend decides."""
    from knapformer.distributed.backends import uses_nccl

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "meta":
        return device.type
    return "cuda" if uses_nccl(group) else "cpu"
