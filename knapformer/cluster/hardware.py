"""Hardware presets for the cluster model (per GPU; bandwidths per direction).

Sources (vendor data sheets, as commonly quoted):
- H100 SXM5: 989 TFLOP/s dense BF16 (1,979 with sparsity); NVLink 4 at 900 GB/s bidirectional
  = 450 GB/s per direction; HGX nodes of 8; one 400 Gb/s NDR InfiniBand NIC per GPU (50 GB/s).
- H200 SXM: same Hopper tensor cores (989 TFLOP/s dense BF16) and NVLink 4 (450 GB/s per
  direction); 8 per node; 400 Gb/s per GPU.
- A100 SXM4 80GB: 312 TFLOP/s dense BF16; NVLink 3 at 600 GB/s bidirectional = 300 GB/s per
  direction; 8 per node; one 200 Gb/s HDR NIC per GPU (25 GB/s).
- cpu-gloo: this repository's 2-core CPU development machine with gloo over loopback
  (all-to-all of 1.2 MB took ~1.3 ms, 5 MB ~3.9 ms: ~1.3 GB/s and ~0.5 ms latency, measured);
  use it with a calibrated CPU profile (compute time comes from the profile). A one-thread
  index_select of 5 MB ran at ~7 GB/s (``copy_bw``); GPU presets assume ~2 TB/s of HBM.
  Its ``sync_jitter`` 0.06 is the median of three runs of ``benchmarks/sync_jitter.py``
  (4.3%, 6.1%, 15.1%: two pinned ranks doing identical attention + MLP segments lose that
  share waiting at each synchronisation; the spread is this shared machine's noise).

``efficiency`` is the fraction of peak the model's kernels sustain (matmuls and attention
together). It is an assumption, not a measurement: 0.5 is typical of well-tuned large bf16
transformer kernels on Hopper; override it (``--efficiency``) or give a calibrated profile.
Latencies are per collective call, order-of-magnitude figures for NCCL all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from knapformer.plan.cost import LinkModel

__all__ = ["Hardware", "HARDWARE", "hardware"]


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    peak_flops: float
    """Dense bf16 FLOP/s per GPU."""
    efficiency: float
    """Achievable fraction of peak for the model's kernels."""
    gpus_per_node: int
    intra_bw: float
    """Bytes/s per GPU per direction inside a node."""
    inter_bw: float
    """Bytes/s per GPU per direction between nodes."""
    intra_latency: float = 15e-6
    inter_latency: float = 30e-6
    copy_bw: float = 2e12
    """Bytes/s of the local permutation copies around each exchange (device memory)."""
    sync_jitter: float = 0.01
    """Time lost waiting for the slower of two ranks doing identical work, as a fraction of
    each synchronised compute segment (Ulysses synchronises a bag 4× per layer). Measured by
    ``benchmarks/sync_jitter.py``; GPU presets assume 1% (steady kernel times)."""

    def __post_init__(self) -> None:
        for f in ("peak_flops", "efficiency", "intra_bw", "inter_bw"):
            if not getattr(self, f) > 0:
                raise ValueError(f"hardware {self.name!r}: {f} must be > 0, got {getattr(self, f)!r}")
        if self.efficiency > 1:
            raise ValueError(f"hardware {self.name!r}: efficiency must be <= 1, got {self.efficiency}")
        if not 0 <= self.sync_jitter < 1:
            raise ValueError(f"hardware {self.name!r}: sync_jitter must be in [0, 1), got {self.sync_jitter}")
        if self.gpus_per_node < 1:
            raise ValueError(f"hardware {self.name!r}: gpus_per_node must be >= 1")

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.efficiency

    def link(self, shape=None, *, units_per_second: float = 1.0, bytes_per_value: int | None = None) -> LinkModel:
        """These links as the planner's :class:`~knapformer.plan.cost.LinkModel`: exchange
        passes from ``shape`` (forward + backward, + recompute), bytes per value from
        ``bytes_per_value``, else ``shape``, else 2 (bf16; a balancer replaces it by its
        tensors' dtype from its first step on, so fp32 exchanges are priced at 4), and
        ``units_per_second`` of the planner's cost model (1 for a profile in seconds; for the
        paper's FLOP form use :meth:`flop_units_per_second`)."""
        return LinkModel(
            intra_bw=self.intra_bw,
            inter_bw=self.inter_bw,
            intra_latency=self.intra_latency,
            inter_latency=self.inter_latency,
            gpus_per_node=self.gpus_per_node,
            bytes_per_value=bytes_per_value or (shape.bytes_per_value if shape is not None else 2),
            exchange_passes=shape.passes - 1 if shape is not None else 2,
            copy_bw=self.copy_bw,
            units_per_second=units_per_second,
            sync_jitter=self.sync_jitter,
        )

    @property
    def flop_units_per_second(self) -> float:
        """Planner units per second for the paper's cost form (one unit = one forward FLOP of
        a layer; a training layer runs forward + backward = 3 forward FLOPs)."""
        return self.achievable_flops / 3

    def with_overrides(self, **kw) -> Hardware:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        name="H100 SXM", peak_flops=989e12, efficiency=0.5, gpus_per_node=8, intra_bw=450e9, inter_bw=50e9
    ),
    "h200": Hardware(
        name="H200 SXM", peak_flops=989e12, efficiency=0.5, gpus_per_node=8, intra_bw=450e9, inter_bw=50e9
    ),
    "a100": Hardware(
        name="A100 SXM4", peak_flops=312e12, efficiency=0.5, gpus_per_node=8, intra_bw=300e9, inter_bw=25e9
    ),
    "cpu-gloo": Hardware(
        name="2-core CPU, gloo loopback",
        peak_flops=50e9,
        efficiency=0.5,
        gpus_per_node=1024,
        intra_bw=1.3e9,
        inter_bw=1.3e9,
        intra_latency=0.5e-3,
        inter_latency=0.5e-3,
        sync_jitter=0.06,
    ),
}


def hardware(name: str) -> Hardware:
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware preset {name!r}; choose one of {sorted(HARDWARE)}") from None
