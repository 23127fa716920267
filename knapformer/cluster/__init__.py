"""Cluster what-if model: predicted step time per layout at 32–4,096 GPUs (pure numpy).

Main API: :func:`evaluate`, :func:`search_layouts`, :func:`predict_step`, :data:`HARDWARE`.
"""

from knapformer.cluster.hardware import HARDWARE, Hardware, hardware
from knapformer.cluster.model import ModelShape, StepPrediction, a2a_seconds, predict_step, predict_unbalanced
from knapformer.cluster.search import LayoutResult, candidate_layouts, evaluate, search_layouts

__all__ = [
    "HARDWARE",
    "Hardware",
    "LayoutResult",
    "ModelShape",
    "StepPrediction",
    "a2a_seconds",
    "candidate_layouts",
    "evaluate",
    "hardware",
    "predict_step",
    "predict_unbalanced",
    "search_layouts",
]
