"""Memory-aware scheduling (no torch here): full DP, narrow-waist partition and
incremental rescheduling (paper §6.1).

- ``schedule(g, method="dp"|"program")``: an order of every op of a MemGraph.
- ``reschedule(new_g, old_order_names, touched_names)``: after a mutation, redo
  only the intervals around the touched ops (Algorithm 2).
- ``Scheduler``: keeps the current graph and schedule so a search can call
  ``mutate`` with either strategy.

Every result is a ``Schedule`` whose ``peak`` is ``simulate_memory``'s peak of its
``order``. Graphs relate through ``MemGraph.names``: op indices change under a
rewrite, names do not.
"""
from __future__ import annotations

from magis_nb.simulate.memory import MemGraph

from .dp import STATE_BUDGET, BlockCache, solve_block
from .full import Schedule, default_order, schedule
from .incremental import extend_bound, get_reschedule_interval, reschedule
from .narrow_waist import graph_partition, nw_values


class Scheduler:
    """Current (graph, schedule) of a search; ``mutate`` moves to a new graph.

    ``incremental=False`` reschedules the whole new graph (a kill switch and the
    reference for the incremental path).
    """

    def __init__(self, g: MemGraph, *, hint=None, incremental: bool = True,
                 budget: int = STATE_BUDGET):
        self.incremental = incremental
        self.budget = budget
        self.current: Schedule = schedule(g, hint=hint, budget=budget)

    @property
    def graph(self) -> MemGraph:
        return self.current.graph

    def mutate(self, new_g: MemGraph, touched) -> Schedule:
        """Schedule ``new_g``, a rewrite of the current graph touching ``touched``
        (old op names); returns the new schedule and makes it current."""
        if self.incremental:
            s = reschedule(new_g, self.current.names, touched, budget=self.budget)
        else:
            s = schedule(new_g, budget=self.budget)
        self.current = s
        return s


__all__ = ["BlockCache", "Schedule", "Scheduler", "schedule", "reschedule", "default_order",
           "graph_partition", "nw_values", "extend_bound",
           "get_reschedule_interval", "solve_block"]
