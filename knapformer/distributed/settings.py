"""Building a balancer: the settings every rank agrees on, and the groups it runs on.

Construction is a collective over the whole world (every rank builds its balancer at the same
point, each with its own balancing group), so that a problem on one rank — an invalid setting,
settings that differ, a ``group`` that its own members do not share — raises the same error on
every rank instead of leaving some in a collective the others never join:

1. one all-gather over the world of every setting's digest, an error flag, and a digest of the
   ranks of the group this rank asked for;
2. when ranks asked for groups (``group=`` or ``device_mesh=``): every member of every rank's
   group must have asked for the same one (checked from an all-gather of the ranks lists);
3. without a group the layout's replicas tile the world (every rank creates every replica's
   group, in the same order), and with NCCL a gloo twin of each balancing group carries the
   agreement collectives on CPU (no device synchronisation per call).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import knapformer.distributed.lifetime as lifetime
from knapformer.config import BalancerConfig
from knapformer.distributed.agree import digest62, gather_text, group_device
from knapformer.distributed.backends import host_collectives
from knapformer.errors import BalancerConfigError

__all__ = ["Groups", "agree_settings", "asked_group", "resolve_groups"]


class Groups:
    """The balancing group of this rank and the group its agreements run on."""

    def __init__(self, group, control) -> None:
        self.group = group
        self.control = control


def asked_group(group, device_mesh) -> tuple[tuple[int, ...] | None, dist.ProcessGroup | None]:
    """(global ranks, the group) this rank asked for (None: the layout's replicas decide)."""
    if group is not None and device_mesh is not None:
        raise TypeError("pass group= or device_mesh=, not both")
    if device_mesh is not None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh, dim = (device_mesh, None) if isinstance(device_mesh, DeviceMesh) else device_mesh
        if not isinstance(mesh, DeviceMesh):
            raise TypeError("device_mesh must be a DeviceMesh or a (DeviceMesh, dimension name) pair")
        if dim is None and mesh.ndim != 1:
            raise ValueError(f"a {mesh.ndim}-D device_mesh needs a dimension: pass (mesh, 'dim name')")
        group = mesh.get_group(dim) if dim is not None else mesh.get_group()
    if group is None:
        return None, None
    me = dist.get_rank()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"rank {me} passed a group it is not a member of (torch hands ranks outside new_group(ranks) a "
            "placeholder): pass each rank the balancing group it belongs to (every rank calls new_group for "
            "every group, in the same order, and keeps the one that contains it), or no group to let the "
            "layout's replicas tile the world"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    if group is not dist.group.WORLD and me not in dist.get_process_group_ranks(group):
        ranks = dist.get_process_group_ranks(group)
        raise ValueError(
            f"rank {me} is not a member of the group it passed (ranks {ranks}): pass each rank "
            "the balancing group it belongs to (e.g. the one new_group returned for its own ranks), or no "
            "group to let the layout's replicas tile the world"
        )
    if group is dist.group.WORLD:
        return tuple(range(dist.get_world_size())), group
    return tuple(dist.get_process_group_ranks(group)), group


def agree_settings(config: BalancerConfig | None, local_error: str, asked) -> None:
    """Step 1 (module docstring): raise :class:`BalancerConfigError` on every rank of the world
    when a rank's settings are invalid or differ from rank 0's."""
    world = dist.group.WORLD
    names = list(BalancerConfig.__dataclass_fields__)
    digests = config.setting_digests() if config is not None else [0] * len(names)
    mine = [1 if local_error else 0, *digests, digest62(repr(asked))]
    t = torch.tensor(mine, dtype=torch.int64).to(group_device(world))
    rows = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    lifetime.collective(lambda: dist.all_gather(rows, t), (t, *rows), "construction")
    table = torch.stack(rows).cpu().tolist()  # once, at construction
    me = dist.get_rank()
    bad = [r for r, row in enumerate(table) if row[0]]
    if bad:
        texts = gather_text(world, local_error)  # every rank carries the culprits' reasons
        reasons = "; ".join(f"rank {r}: {texts[r]}" for r in bad) if len(bad) > 1 else texts[bad[0]]
        raise BalancerConfigError(f"SequenceBalancer: invalid settings on rank(s) {bad} (this is rank {me}): {reasons}")
    differs = []
    for i, name in enumerate(names):
        ranks = [r for r, row in enumerate(table) if row[1 + i] != table[0][1 + i]]
        if ranks:
            value = config.settings()[name] if config is not None else "?"
            differs.append(f"{name!r} differs on rank(s) {ranks} from rank 0 (this rank {me} has {value})")
    if differs:
        raise BalancerConfigError("SequenceBalancer: ranks were built with different settings: " + "; ".join(differs))
    if len({row[-1] for row in table}) > 1 and any(row[-1] == digest62(repr(None)) for row in table):
        without = [r for r, row in enumerate(table) if row[-1] == digest62(repr(None))]
        raise BalancerConfigError(
            f"SequenceBalancer: rank(s) {without} passed no group while others did (this is rank {me}): "
            "pass a group on every rank or on none"
        )


def _check_asked(asked_by_rank: list, size: int) -> None:
    """Step 2: every member of each rank's group asked for the same group."""
    me = dist.get_rank()
    for r, ranks in enumerate(asked_by_rank):
        for m in ranks:
            if tuple(asked_by_rank[m]) != tuple(ranks):
                raise BalancerConfigError(
                    f"SequenceBalancer: rank {r} passed the group {list(ranks)}, but its member rank {m} passed "
                    f"{list(asked_by_rank[m])} (this is rank {me}): every member of a balancing group must pass "
                    "the same group"
                )
        if len(ranks) != size:
            raise BalancerConfigError(
                f"SequenceBalancer: rank {r} passed a group of {len(ranks)} ranks, but the layout's balancing "
                f"group has {size} (this is rank {me})"
            )


def resolve_groups(config: BalancerConfig, group, asked) -> Groups:
    """Steps 2 and 3 (module docstring); ``config`` is already resolved to its group size. The
    balancer runs on process groups of its own, over the same ranks as the group it serves,
    created with ``collective_timeout_s`` (and cached: balancers with the same ranks, backend
    and timeout share them), so that no knapformer exchange waits longer for a lost peer."""
    size = config.layout.group_size
    if asked is None:
        groups = [tuple(r) for r in config.layout.replica_ranks(dist.get_world_size())]
        backend = dist.get_backend_config()  # per device ("cpu:gloo,cuda:nccl"): not get_backend's "undefined"
    else:
        asked_by_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(asked_by_rank, list(asked))
        _check_asked(asked_by_rank, size)
        groups = sorted({tuple(r) for r in asked_by_rank})
        backend = dist.get_backend_config(group)
    me = dist.get_rank()
    timeout = config.collective_timeout_s
    mine = None
    for ranks in groups:  # every rank creates every group, in the same order
        g = _timed_group(ranks, backend, timeout)
        if me in ranks:
            mine = g
    if host_collectives(mine):  # gloo, or gloo beside NCCL: agreements run on host tensors as they are
        out = Groups(mine, mine)
    else:  # NCCL alone
        control = None
        for ranks in groups:  # gloo twins of every balancing group, created in the same order everywhere
            g = _timed_group(ranks, "gloo", timeout)
            if me in ranks:
                control = g
        out = Groups(mine, control)
    _register(out, next(r for r in groups if me in r), timeout)
    return out


_GROUPS: dict = {}
"""The balancer's process groups: (ranks, backend, timeout) -> group, for the current world."""


def _timed_group(ranks: tuple[int, ...], backend: str, timeout: float):
    import datetime

    if _GROUPS.get("world") is not dist.group.WORLD:  # a new world (after destroy_process_group)
        _GROUPS.clear()
        _GROUPS["world"] = dist.group.WORLD
    key = (tuple(ranks), backend, float(timeout))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout), backend=backend)
    return _GROUPS[key]


def _register(groups: Groups, ranks: tuple[int, ...], timeout: float) -> None:
    """Tell :mod:`.lifetime` who the members are (host, process id), to name a dead one."""
    import json
    import os
    import socket

    mine = json.dumps([socket.gethostname(), os.getpid()])
    table = [json.loads(t) for t in gather_text(groups.control, mine)]
    hosts, pids = [h for h, _ in table], [p for _, p in table]
    for g in {id(groups.group): groups.group, id(groups.control): groups.control}.values():
        lifetime.register_peers(g, ranks, hosts, pids, timeout)
