"""``SequenceBalancer``: the per-step handle a model calls (plan, route, attention, reverse).

    bal = SequenceBalancer("g1n2+g2n1", WorkloadModel(d_model=64))   # after init_process_group
    plan = bal.plan(local_seq_lens)         # collective over the balancing group
    y = bal.route(x)                        # (sum(local_seq_lens), *F) -> routed tokens
    o = bal.attention(q, k, v)              # (R, h, D) -> (R, h, D), Ulysses inside bags
    x2 = bal.reverse_route(y)               # back to the caller's order

Planning is done independently on every rank from the same gathered lengths (no rank-0
broadcast); ``debug=True`` checks that all ranks hold the identical plan. Problems that only
one rank can see (a malformed length list, a tensor of the wrong length) are exchanged as an
error flag in a small collective before any data moves, so every rank raises together.

Devices come from tensors (index tensors are copied to the tensor's device once per step);
collectives use the group's backend: gloo for CPU tensors, NCCL for CUDA tensors.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from knapformer.attention import varlen_attention
from knapformer.distributed import ops
from knapformer.distributed.spec import RouteSpec, build_route_spec
from knapformer.layout import BagLayout, parse_layout
from knapformer.plan import DEFAULT_SOLVER, Plan, plan_sequences
from knapformer.plan.problem import validate_seq_lens
from knapformer.workload import WorkloadModel

__all__ = ["SequenceBalancer", "BalancerInputError"]


class BalancerInputError(ValueError):
    """Bad input on some rank, raised on every rank of the group."""


def _group_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class SequenceBalancer:
    """Plans and executes sequence balancing for one balancing group per replica."""

    def __init__(
        self,
        layout: str | BagLayout,
        model: WorkloadModel | str | os.PathLike,
        group: dist.ProcessGroup | None = None,
        *,
        solver: str = DEFAULT_SOLVER,
        max_tokens_per_rank: int | None = None,
        rank_speed: Sequence[float] | None = None,
        attn_backend: str = "auto",
        debug: bool | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("SequenceBalancer needs torch.distributed: call init_process_group first")
        self.layout = parse_layout(layout)
        # a path is a calibrated profile (knapformer calibrate)
        self.model = model if isinstance(model, WorkloadModel) else WorkloadModel.from_profile(model)
        self.solver = solver
        self.max_tokens_per_rank = max_tokens_per_rank
        self.rank_speed = None if rank_speed is None else tuple(rank_speed)
        self.attn_backend = attn_backend
        self.debug = bool(int(os.environ.get("KNAPFORMER_DEBUG", "0"))) if debug is None else debug
        S = self.layout.group_size
        if group is None:
            world = dist.get_world_size()
            replicas = self.layout.replica_ranks(world)  # raises (on every rank) if W % S != 0
            if len(replicas) == 1:
                group = dist.group.WORLD
            else:
                # every rank creates every replica's group, in the same order (collective)
                mine = None
                for ranks in replicas:
                    g = dist.new_group(ranks)
                    if dist.get_rank() in ranks:
                        mine = g
                group = mine
        elif dist.get_world_size(group) != S:
            raise ValueError(
                f"process group has {dist.get_world_size(group)} ranks but layout {self.layout.spec()!r} needs {S}"
            )
        self.group = group
        self.group_rank = dist.get_rank(group)
        self._plan: Plan | None = None
        self._spec: RouteSpec | None = None

    # -- planning ------------------------------------------------------------------------------
    def plan(self, local_seq_lens: Sequence[int]) -> Plan:
        """Gather every rank's lengths (two all-gathers), plan, and build this rank's route spec.
        Collective over the balancing group; returns the same :class:`Plan` on every rank."""
        device = _group_device(self.group)
        S = self.layout.group_size
        error = ""
        try:
            lens = list(validate_seq_lens([local_seq_lens])[0])
        except ValueError as exc:
            error, lens = str(exc).replace("seq_lens[0]", "local_seq_lens"), []
        head = torch.tensor([len(lens), 1 if error else 0], dtype=torch.int64, device=device)
        heads = [torch.empty_like(head) for _ in range(S)]
        dist.all_gather(heads, head, group=self.group)
        heads_t = torch.stack(heads).cpu()
        bad = heads_t[:, 1].nonzero().flatten().tolist()
        if bad:
            msg = error or "invalid local_seq_lens"
            raise BalancerInputError(f"SequenceBalancer.plan: bad local_seq_lens on rank(s) {bad}: {msg}")
        counts = heads_t[:, 0].tolist()
        width = max(max(counts), 1)
        padded = torch.zeros(width, dtype=torch.int64, device=device)
        if lens:
            padded[: len(lens)] = torch.tensor(lens, dtype=torch.int64)
        gathered = [torch.empty_like(padded) for _ in range(S)]
        dist.all_gather(gathered, padded, group=self.group)
        all_lens = [g[:c].tolist() for g, c in zip(torch.stack(gathered).cpu(), counts)]
        plan = plan_sequences(
            all_lens,
            self.layout,
            self.model,
            solver=self.solver,
            max_tokens_per_rank=self.max_tokens_per_rank,
            rank_speed=self.rank_speed,
        )
        if self.debug:
            self._check_same_plan(plan, device)
        self._plan = plan
        self._spec = build_route_spec(plan, self.group_rank)
        return plan

    def use_plan(self, plan: Plan) -> Plan:
        """Execute a plan made elsewhere (any grouping of ranks: non-contiguous, per step).
        Not a collective: every rank must pass the identical plan (``debug=True`` checks).
        The local tensors must follow ``plan.seq_lens[group_rank]``."""
        if plan.num_ranks != self.layout.group_size:
            raise ValueError(f"plan has {plan.num_ranks} ranks, the balancing group {self.layout.group_size}")
        if self.debug:
            self._check_same_plan(plan, _group_device(self.group))
        self._plan = plan
        self._spec = build_route_spec(plan, self.group_rank)
        return plan

    def _check_same_plan(self, plan: Plan, device: torch.device) -> None:
        h = int(plan.digest()[:15], 16)
        lo = torch.tensor([h], dtype=torch.int64, device=device)
        hi = lo.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group)
        if int(lo) != int(hi):
            raise RuntimeError("ranks computed different plans from the same lengths (nondeterministic planner?)")

    @property
    def current_plan(self) -> Plan:
        return self._require_spec()[0]

    @property
    def spec(self) -> RouteSpec:
        return self._require_spec()[1]

    def _require_spec(self) -> tuple[Plan, RouteSpec]:
        if self._plan is None or self._spec is None:
            raise RuntimeError("SequenceBalancer: call plan(local_seq_lens) before route/attention/reverse_route")
        return self._plan, self._spec

    def _agree(self, error: str, device: torch.device, where: str) -> None:
        """One small all-reduce of an error flag so that a local problem raises everywhere."""
        flag = torch.tensor([1 if error else 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if int(flag):
            raise BalancerInputError(f"SequenceBalancer.{where}: {error or 'bad input on another rank'}")

    def _check_rows(self, tensors: Sequence[torch.Tensor], rows: int, where: str) -> None:
        error = ""
        if not tensors:
            error = "no tensors given"
        else:
            for i, t in enumerate(tensors):
                if not isinstance(t, torch.Tensor) or t.dim() == 0:
                    error = f"argument {i} is not a tensor with a token dimension"
                elif t.shape[0] != rows:
                    error = f"argument {i} has {t.shape[0]} tokens on rank {self.group_rank}, expected {rows}"
                elif t.device != tensors[0].device:
                    error = f"argument {i} is on {t.device}, argument 0 on {tensors[0].device}"
                if error:
                    break
        device = tensors[0].device if tensors and isinstance(tensors[0], torch.Tensor) else _group_device(self.group)
        self._agree(error, device, where)

    # -- execution -------------------------------------------------------------------------------
    def route(self, x: torch.Tensor, *features: torch.Tensor):
        """Move tokens (T, *F) to their planned ranks -> (R, *F); several tensors -> a tuple.
        One all_to_all_single per dtype; differentiable (backward = reverse exchange)."""
        _, spec = self._require_spec()
        tensors = (x, *features)
        self._check_rows(tensors, spec.num_local, "route")
        out = ops.route(tensors, spec, self.group)
        return out[0] if not features else tuple(out)

    def reverse_route(self, y: torch.Tensor, *features: torch.Tensor):
        """Inverse of :meth:`route`: (R, *F) -> (T, *F) in the caller's original order."""
        _, spec = self._require_spec()
        tensors = (y, *features)
        self._check_rows(tensors, spec.num_routed, "reverse_route")
        out = ops.reverse_route(tensors, spec, self.group)
        return out[0] if not features else tuple(out)

    def pre_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """(R, h, D) each -> (A, h/k, D) each, plus ``cu_seqlens`` (int32) and ``max_len``
        for a custom varlen kernel. Shapes are validated identically on every rank."""
        _, spec = self._require_spec()
        self._check_qkv(q, k, v, spec)
        q2, k2, v2 = ops.pre_attn((q, k, v), spec, self.group)
        idx = spec.indices_on(q.device)
        return q2, k2, v2, idx["cu_seqlens"], max(spec.attn_seq_lens, default=0)

    def post_attn(self, o: torch.Tensor) -> torch.Tensor:
        """(A, h/k, D) -> (R, h, D); inverse of :meth:`pre_attn`."""
        _, spec = self._require_spec()
        return ops.post_attn((o,), spec, self.group)[0]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """Attention of routed tokens within their own sequences: (R, h, D) -> (R, h, D)."""
        q2, k2, v2, cu, max_len = self.pre_attn(q, k, v)
        o2 = varlen_attention(q2, k2, v2, cu, max_len, causal=causal, backend=self.attn_backend)
        return self.post_attn(o2)

    def gather_sequences(self, *per_seq: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-sequence rows of every rank of the group, in group sequence-id order: (n_local,
        *F) each -> (n_group, *F), indexable by ``routed_positions()[0]``. Differentiable; one
        collective per dtype. Use it for conditioning (timestep/AdaLN vectors, text lengths)."""
        plan, spec = self._require_spec()
        counts = [len(r) for r in plan.seq_lens]
        self._check_rows(per_seq, counts[self.group_rank], "gather_sequences")
        return tuple(ops.gather_sequences(per_seq, counts, self.group_rank, self.group))

    def routed_positions(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per routed token: global sequence id in the group (rank-major) and position (int64)."""
        _, spec = self._require_spec()
        if device is None:
            return spec.routed_seq_id, spec.routed_pos
        idx = spec.indices_on(device)
        return idx["routed_seq_id"], idx["routed_pos"]

    def _check_qkv(self, q, k, v, spec: RouteSpec) -> None:
        # every rank sees the same head count and the same plan: no collective needed
        if q.dim() != 3 or k.shape != q.shape or v.shape[:2] != q.shape[:2]:
            raise ValueError(f"q, k, v must be (tokens, heads, head_dim) of one shape; got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        ops.check_heads(q.shape[1], spec)
        error = ""
        if q.shape[0] != spec.num_routed:
            error = f"q has {q.shape[0]} tokens on rank {self.group_rank}; routed tokens: {spec.num_routed}"
        if self.debug:  # per-layer flag exchange only in debug mode (it syncs the host)
            self._agree(error, q.device, "pre_attn")
        elif error:
            raise ValueError(f"SequenceBalancer.pre_attn: {error}")
