"""Planners: pure, torch-free functions from a chain description to segments."""

from autockpt.planners import basic as _basic  # noqa: F401  (registers the built-ins)
from autockpt.planners import budget as _budget  # noqa: F401
from autockpt.planners.registry import (
    OpCost,
    Planner,
    PlanRequest,
    StageCost,
    available_planners,
    get_planner,
    register_planner,
    run_planner,
    segments_from_sizes,
)

__all__ = [
    "OpCost",
    "PlanRequest",
    "Planner",
    "StageCost",
    "available_planners",
    "get_planner",
    "register_planner",
    "run_planner",
    "segments_from_sizes",
]
