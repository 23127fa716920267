"""``apply_fsdp`` on a sub-group: the mesh it builds lives where the model does."""

from __future__ import annotations

import torch
import torch.nn as nn

import knapformer.distributed.backends as backends
import knapformer.parallelize as parallelize


def _recorded_mesh_types(monkeypatch, model: nn.Module, nccl: bool) -> list[str]:
    """The device types ``apply_fsdp`` gives ``DeviceMesh.from_group`` for a sub-group
    (FSDP2 itself and the group are stand-ins: only the mesh's device type is under test)."""
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp as fsdp

    seen: list[str] = []
    record = staticmethod(lambda group, device_type: seen.append(device_type))
    monkeypatch.setattr(device_mesh.DeviceMesh, "from_group", record)
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, mesh=None: module)
    monkeypatch.setattr(backends, "uses_nccl", lambda group=None: nccl)
    parallelize.apply_fsdp(model, group=object())
    return seen


def test_a_sub_group_mesh_is_on_the_models_device(monkeypatch):
    """It was always ``cpu``: wrong for GPU ranks given a sub-group (issue 59, item 6)."""
    assert _recorded_mesh_types(monkeypatch, nn.Linear(2, 2), nccl=True) == ["cpu"]  # a CPU model
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    assert _recorded_mesh_types(monkeypatch, meta, nccl=True) == ["cuda"]  # not materialised: the backend
    assert _recorded_mesh_types(monkeypatch, meta, nccl=False) == ["cpu"]
