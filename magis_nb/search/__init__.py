"""The optimizer (paper §5.2, §6.2): rules, search under a budget, `optimize`."""
from .algorithm import search
from .objective import Objective
from .optimize import optimize
from .result import OptimizeResult, Plan, Progress, Region, Timeline
from .space import Batch, Remat, Space, State, Swap

__all__ = ["optimize", "OptimizeResult", "Plan", "Progress", "Region", "Timeline",
           "Objective", "search", "Space", "State", "Batch", "Swap", "Remat"]
