"""Which backend a process group uses for which device, and where its small tensors live.

A group is not one backend: ``init_process_group()`` without a backend (torch >= 2.6) gives
``cpu:gloo,cuda:nccl`` and ``dist.get_backend`` answers ``"undefined"``, so comparing that string
with ``"nccl"`` takes an NCCL job for a gloo one. Everything here reads the group's per-device
backends instead (:func:`device_backends`):

- agreement rows and gathered lengths are host tensors whenever the group has a CPU backend
  (:func:`host_collectives`; a pure NCCL group gets a gloo twin for them, :mod:`.settings`);
- data tensors choose their own device, and a group's device comes from the tensors or the
  group's bound device (``init_process_group(device_id=...)``), never from a guess;
- NCCL cannot run two ranks on one GPU: :func:`device_problem` finds ranks that share one,
  from the devices of their data, before any exchange.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["control_device", "data_device", "device_backends", "device_problem", "host_collectives", "uses_nccl"]


def device_backends(group=None) -> dict[str, str]:
    """Device type -> backend name of ``group`` (``{"cpu": "gloo", "cuda": "nccl"}``)."""
    text = str(dist.get_backend_config(group))
    out: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        if ":" in part:
            device, backend = part.split(":", 1)
            out[device.strip()] = backend.strip()
        elif part == "nccl":
            out["cuda"] = "nccl"
        elif part == "gloo":
            out.setdefault("cpu", "gloo")
            out.setdefault("cuda", "gloo")
        else:  # another backend (mpi, a plugin) named without devices: assume it serves the host
            out.setdefault("cpu", part)
    return out


def uses_nccl(group=None) -> bool:
    """CUDA tensors on ``group`` go through NCCL."""
    return device_backends(group).get("cuda") == "nccl"


def host_collectives(group=None) -> bool:
    """``group`` runs collectives of host (CPU) tensors: no device synchronisation for them."""
    return "cpu" in device_backends(group)


def control_device(group=None) -> torch.device:
    """Where ``group``'s small control tensors live: the host when it has a CPU backend, else
    its bound device (``init_process_group(device_id=...)``), else the current CUDA device."""
    if host_collectives(group):
        return torch.device("cpu")
    return _cuda_device(group)


def data_device(group=None) -> torch.device:
    """Where ``group``'s data is expected before any tensor is seen (the link probe at
    construction): the CUDA device when CUDA tensors go through NCCL, else the host."""
    if uses_nccl(group) and torch.cuda.is_available():
        return _cuda_device(group)
    return torch.device("cpu")


def _cuda_device(group) -> torch.device:
    """The group's bound device (``init_process_group(device_id=...)``), else the current one."""
    bound = getattr(group if group is not None else dist.group.WORLD, "bound_device_id", None)
    if bound is not None:
        return torch.device(bound)
    return torch.device("cuda", torch.cuda.current_device())  # what NCCL itself uses unbound


def device_problem(devices: Sequence[str], nccl: bool) -> str:
    """Why ranks whose data live on ``devices`` (``"host/cuda:0"`` per rank) cannot run ("" if
    they can): mixed device types, or — with NCCL — two ranks on one GPU."""
    kinds = {d.split("/", 1)[1].split(":")[0] for d in devices}
    if len(kinds) > 1:
        by = ", ".join(f"rank {r}: {d}" for r, d in enumerate(devices))
        return f"the ranks' tensors are on different kinds of device ({by}); put every rank's data on one kind"
    if not nccl:
        return ""
    seen: dict[str, int] = {}
    for r, d in enumerate(devices):
        if d.split("/", 1)[1].startswith("cuda") and d in seen:
            host, dev = d.split("/", 1)
            return (
                f"ranks {seen[d]} and {r} both run on {dev} of host {host}: NCCL needs one GPU per rank "
                "(call torch.cuda.set_device(local_rank) before init_process_group, or pass it device_id=)"
            )
        seen[d] = r
    return ""
