"""Workload model: what one sequence costs, and how that cost splits inside a bag.

The planner never measures anything; it trusts this model. The paper's form is
``24·L·d² + γ·4·L²·d`` per layer: the first term is the token-wise matmuls (QKV, output
projection, a 4× MLP), the second is attention (QKᵀ and AV). We keep the two parts as
separate *coefficients* (``linear_coef``, ``quad_coef``) so that a calibrated profile can
replace them without touching the planner.

Cost of a chunk: a chunk of ℓ tokens of a sequence of length L in a bag of k ranks costs
``lin(ℓ) + quad(L)/k`` on its rank, because Ulysses gives each bag rank all L tokens of the
sequence for h/k heads. Summed over the bag this is exactly ``cost(L)``: moving work never
creates or destroys it, which is what makes ``total / ranks`` a valid lower bound.

Cross-attention (Wan's text attention): with ``context_len`` = C context tokens per sequence,
each query token also attends to C keys (``cross·C`` per token, ``cross`` = γ·4·d in the
paper form) and every rank that runs the sequence projects the C context tokens to keys and
values once (``4·d²·C`` per sequence and rank). Both are linear in the sequence's share, so a
sequence split over k ranks still sums to its whole cost (plus the duplicated projection). C
is one number for every sequence: Wan pads its text to 512 tokens (+257 image tokens for
I2V); unpadded texts of varying length are priced at this typical length.

FLOP counts (for HFU) are the true forward FLOPs ``24·L·d² + 4·L²·d`` per layer (γ is a
*time* fudge, not FLOPs), backward = 2× forward, activation recompute = 1× forward.

No torch, no devices: the planner runs everywhere.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["WorkloadModel", "layer_flops", "linear_flops_per_token", "transformer_flops"]


def linear_flops_per_token(d_model: int, kv_ratio: float = 1.0) -> float:
    """Forward FLOPs per token of a layer's matmuls: q and output projections (d² each), k and
    v projections (d²·kv_ratio each: GQA/MQA have fewer kv heads), a 4× MLP (8d²); 2 FLOPs per
    multiply-add. 24·d² for full multi-head attention (the paper's form)."""
    return 2.0 * (10.0 + 2.0 * kv_ratio) * d_model * d_model


def layer_flops(tokens: Any, attn: Any, d_model: int, *, causal: bool = False, kv_ratio: float = 1.0) -> Any:
    """True forward FLOPs of one Transformer layer for ``tokens`` tokens of token-wise work and
    ``attn`` = Σ L² of attention work (a rank's share: Σ L²/k over its groups' sequences)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    attn = np.asarray(attn, dtype=np.float64)
    return linear_flops_per_token(d_model, kv_ratio) * tokens + 4.0 * attn * d_model * (0.5 if causal else 1.0)


def transformer_flops(length: int | np.ndarray, d_model: int, *, causal: bool = False, kv_ratio: float = 1.0) -> Any:
    """True forward FLOPs of one Transformer layer on a sequence of ``length`` tokens."""
    length = np.asarray(length, dtype=np.float64)
    return layer_flops(length, length * length, d_model, causal=causal, kv_ratio=kv_ratio)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True)
class WorkloadModel:
    """Per-layer cost of a sequence: ``linear_coef·L + quad_coef·L²``.

    Units are arbitrary but shared by every sequence (paper form: FLOP-like units). Build it
    from the paper's form with ``WorkloadModel(d_model=..., gamma=...)`` or from a measured
    profile with :meth:`from_profile`.
    """

    d_model: int
    """Model width d; sets the paper-form coefficients."""
    gamma: float = 1.0
    """Attention cost multiplier γ in ``24·L·d² + γ·4·L²·d`` (hardware dependent)."""
    causal: bool = False
    """Causal attention does half the quadratic work."""
    num_layers: int = 1
    """Layers in the model; scales FLOP counts (the planner is indifferent to it)."""
    linear: float | None = None
    """Override of the linear coefficient (calibrated profiles); None = ``24·d²``."""
    quadratic: float | None = None
    """Override of the quadratic coefficient (calibrated, already causal-adjusted);
    None = ``γ·4·d`` (halved when causal)."""
    num_heads: int | None = None
    """Attention heads; with ``num_kv_heads`` it sets the GQA share of the k/v projections in the
    linear cost and FLOPs. None = full multi-head attention."""
    num_kv_heads: int | None = None
    """Key/value heads (GQA: fewer than ``num_heads``; MQA: 1). None = ``num_heads``."""
    per_seq: float = 0.0
    """Fixed cost per sequence on every rank that runs it (kernel launches, one attention call
    per sequence); calibrated profiles fit it, the paper's form has none."""
    context_len: int = 0
    """Context tokens (text) each sequence cross-attends to per layer; 0 = no cross-attention.
    A calibrated or online-fitted profile absorbs the cross term into its coefficients and
    has 0 here."""
    cross: float | None = None
    """Override of the cross-attention coefficient (per query token and context token);
    None = ``γ·4·d``."""
    meta: dict = field(default_factory=dict, compare=False)
    """Free-form provenance (device, date, fit quality) carried through JSON."""

    def __post_init__(self) -> None:
        if not isinstance(self.d_model, int) or isinstance(self.d_model, bool) or self.d_model <= 0:
            raise ValueError(f"d_model must be a positive int, got {self.d_model!r}")
        if not (_is_number(self.gamma) and math.isfinite(self.gamma) and self.gamma >= 0):
            raise ValueError(f"gamma must be a finite number >= 0, got {self.gamma!r}")
        if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool) or self.num_layers <= 0:
            raise ValueError(f"num_layers must be a positive int, got {self.num_layers!r}")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be a bool, got {self.causal!r}")
        if not isinstance(self.context_len, int) or isinstance(self.context_len, bool) or self.context_len < 0:
            raise ValueError(f"context_len must be an int >= 0, got {self.context_len!r}")
        for name in ("linear", "quadratic", "per_seq", "cross"):
            v = getattr(self, name)
            if v is not None and not (_is_number(v) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} coefficient must be finite and >= 0, got {v!r}")
        for name in ("num_heads", "num_kv_heads"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if self.num_kv_heads is not None and (self.num_heads is None or self.num_heads % self.num_kv_heads):
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} needs num_heads divisible by it (num_heads={self.num_heads})"
            )
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a dict, got {type(self.meta).__name__}")
        if self.linear_coef == 0 and self.quad_coef == 0:
            raise ValueError("workload model has zero cost for every sequence")

    # -- coefficients -------------------------------------------------------------------
    @property
    def linear_coef(self) -> float:
        """Cost per token of the token-wise part (with the cross-attention of its context)."""
        base = float(self.linear) if self.linear is not None else linear_flops_per_token(self.d_model, self.kv_ratio)
        return base + self.cross_coef * self.context_len

    @property
    def cross_coef(self) -> float:
        """Cost per (query token, context token) pair of cross-attention."""
        return float(self.cross) if self.cross is not None else self.gamma * 4.0 * self.d_model

    @property
    def per_seq_coef(self) -> float:
        """Fixed cost per sequence and rank: ``per_seq`` plus projecting the context to keys
        and values (every rank that runs part of the sequence does it)."""
        return self.per_seq + 4.0 * self.d_model * self.d_model * self.context_len

    @property
    def kv_ratio(self) -> float:
        """kv heads / query heads (1.0 without GQA)."""
        if self.num_heads is None or self.num_kv_heads is None:
            return 1.0
        return self.num_kv_heads / self.num_heads

    @property
    def quad_coef(self) -> float:
        """Cost per token² of attention."""
        if self.quadratic is not None:
            return float(self.quadratic)
        return self.gamma * 4.0 * self.d_model * (0.5 if self.causal else 1.0)

    # -- costs (vectorised: ints or numpy arrays) ---------------------------------------
    def lin(self, length: Any) -> Any:
        """Linear (token-wise) part of the cost of ``length`` tokens."""
        return self.linear_coef * np.asarray(length, dtype=np.float64)

    def quad(self, length: Any) -> Any:
        """Quadratic (attention) part of the cost of a sequence of ``length`` tokens."""
        length = np.asarray(length, dtype=np.float64)
        return self.quad_coef * length * length

    def cost(self, length: Any) -> Any:
        """Cost of a whole sequence on one rank."""
        return self.lin(length) + self.quad(length) + self.per_seq_coef

    def chunk_cost(self, chunk_len: Any, seq_len: Any, bag_size: Any) -> Any:
        """Cost on one bag rank of a chunk of ``chunk_len`` tokens of a ``seq_len`` sequence
        (every bag rank runs h/k heads of the whole sequence, and pays the per-sequence cost)."""
        return self.lin(chunk_len) + self.quad(seq_len) / np.asarray(bag_size, dtype=np.float64) + self.per_seq_coef

    @property
    def gamma_equivalent(self) -> float:
        """γ that gives the paper form the same quadratic/linear ratio: ``6·d·quad/lin``."""
        return 6.0 * self.d_model * self.quad_coef / self.linear_coef if self.linear_coef > 0 else math.inf

    # -- FLOPs ---------------------------------------------------------------------------
    def flops(self, length: Any, *, backward: bool = True, recompute: bool = False) -> Any:
        """True FLOPs of all layers: forward (+ backward = 2× forward, + recompute = 1×)."""
        mult = 1.0 + (2.0 if backward else 0.0) + (1.0 if recompute else 0.0)
        per_layer = transformer_flops(length, self.d_model, causal=self.causal, kv_ratio=self.kv_ratio)
        if self.context_len:  # cross-attention scores/values and the context's k/v projections
            C, d = self.context_len, self.d_model
            per_layer = per_layer + 4.0 * np.asarray(length, dtype=np.float64) * C * d + 4.0 * d * d * C
        return mult * self.num_layers * per_layer

    # -- profiles ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-ready dict; includes the effective coefficients for readers."""
        d = asdict(self)
        d["linear_coef"] = self.linear_coef
        d["quad_coef"] = self.quad_coef
        d["gamma_equivalent"] = self.gamma_equivalent if math.isfinite(self.gamma_equivalent) else None
        return d

    @classmethod
    def from_dict(cls, data: dict) -> WorkloadModel:
        """Inverse of :meth:`to_dict`; unknown keys are an error (typos should not pass)."""
        if not isinstance(data, dict):
            raise ValueError(f"workload profile must be a JSON object, got {type(data).__name__}")
        data = {k: v for k, v in data.items() if k not in ("linear_coef", "quad_coef", "gamma_equivalent")}
        known = {
            "d_model",
            "gamma",
            "causal",
            "num_layers",
            "linear",
            "quadratic",
            "per_seq",
            "meta",
            "num_heads",
            "num_kv_heads",
            "context_len",
            "cross",
        }
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown workload profile keys: {unknown}")
        if "d_model" not in data:
            raise ValueError("workload profile lacks 'd_model'")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON (creating parent folders)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_profile(cls, path: str | Path) -> WorkloadModel:
        """Load a profile written by :meth:`save` (or the calibrator)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"cannot read workload profile {str(path)!r}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError:
            raise ValueError(f"workload profile {str(path)!r} is not UTF-8 text (is it a JSON profile?)") from None
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"workload profile {str(path)!r} is not valid JSON: {exc.msg} (line {exc.lineno})"
            ) from None
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"workload profile {str(path)!r}: {exc}") from None
