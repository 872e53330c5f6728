"""autockpt: automatic, exact activation checkpointing for PyTorch models.

Examples:
    >>> import autockpt, torch
    >>> model = autockpt.auto_checkpoint(autockpt.models.NiN(10))
    >>> print(autockpt.make_plan(model).strategy)
    sqrt
"""

from autockpt import models
from autockpt.api import auto_checkpoint, make_plan, restore
from autockpt.errors import AutockptError, MutationError, PlanInfeasibleError
from autockpt.execution.linear_cross_entropy import linear_cross_entropy
from autockpt.execution.policies import available_policies, register_policy
from autockpt.execution.recompute_check import RecomputeMismatchError
from autockpt.measure.memory import MemoryStats, track_memory
from autockpt.measure.model_profile import profile
from autockpt.measure.profile import Profile
from autockpt.measure.sandbox import is_recomputing
from autockpt.plan import Plan, Segment
from autockpt.planners import PlanRequest, available_planners, register_planner
from autockpt.report.compile_check import GraphBreak, find_graph_breaks
from autockpt.report.tradeoff import Tradeoff, TradeoffPoint, tradeoff
from autockpt.report.verification import VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "AutockptError",
    "GraphBreak",
    "MemoryStats",
    "MutationError",
    "Plan",
    "PlanInfeasibleError",
    "PlanRequest",
    "Profile",
    "RecomputeMismatchError",
    "Segment",
    "Tradeoff",
    "TradeoffPoint",
    "VerifyReport",
    "auto_checkpoint",
    "available_planners",
    "available_policies",
    "find_graph_breaks",
    "is_recomputing",
    "linear_cross_entropy",
    "make_plan",
    "models",
    "profile",
    "register_planner",
    "register_policy",
    "restore",
    "track_memory",
    "tradeoff",
    "verify",
]
