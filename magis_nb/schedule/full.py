"""Full scheduling of a MemGraph and the result type shared by every method."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from magis_nb.simulate.memory import MemGraph, peak_memory

from .dp import STATE_BUDGET, BlockCache, solve_blocks
from .narrow_waist import graph_partition, topo_order


@dataclass
class Schedule:
    """An order of all ops of ``graph`` and its peak (exactly simulate_memory's).

    ``exact``: every block was solved by the uncapped DP (the order is optimal
    for the chosen partition). ``kept_reference``: the reference order was at
    least as good as the DP's, so it was returned unchanged.
    """
    graph: MemGraph
    order: list[int]
    peak: int
    method: str
    seconds: float
    exact: bool = True
    blocks: int = 0
    reference_peak: int | None = None
    kept_reference: bool = False

    @property
    def names(self) -> list[str]:
        """The order as stable op names (what ``reschedule`` takes)."""
        return [self.graph.names[v] for v in self.order]

    def __repr__(self):
        ref = "" if self.reference_peak is None else f", reference={self.reference_peak}"
        return (f"Schedule({self.method}, ops={len(self.order)}, peak={self.peak}"
                f"{ref}, blocks={self.blocks}, exact={self.exact}, "
                f"{self.seconds * 1e3:.1f} ms)")


def default_order(g: MemGraph) -> list[int]:
    """Op index order if it is topological (how a tracer emits ops), else Kahn's."""
    ident = list(range(g.n))
    if all(p < v for v in ident for p in g.preds[v]):
        return ident
    return topo_order(g, ident, None, None)


def schedule(g: MemGraph, *, method: str = "dp", hint: Sequence[int] | None = None,
             budget: int = STATE_BUDGET, cache: BlockCache | None = None) -> Schedule:
    """Schedule every op of ``g``.

    ``method="program"`` returns ``hint`` (default: ``default_order(g)``) as is.
    ``method="dp"`` partitions at narrow waists, orders each block by the bounded
    DP in context and concatenates; the result's peak is never above the hint's
    (if it would be, the hint is returned with ``kept_reference=True``).
    ``cache``: blocks solved before (by a search, for other states).
    """
    t0 = time.perf_counter()
    ref = list(hint) if hint is not None else default_order(g)
    if not g.is_topological(ref):
        raise ValueError("hint is not a topological order of the graph")
    ref_peak = peak_memory(g, ref)
    if method == "program":
        return Schedule(g, ref, ref_peak, "program", time.perf_counter() - t0,
                        blocks=1, reference_peak=ref_peak, kept_reference=True)
    if method != "dp":
        raise ValueError(f"unknown scheduling method {method!r}")
    pos = [0] * g.n
    for i, v in enumerate(ref):
        pos[v] = i
    parts = graph_partition(g, hint=ref)
    unit = [0] * g.n
    for b, ops in enumerate(parts):
        for v in ops:
            unit[v] = b
    orders, exact = solve_blocks(g, unit, dict(enumerate(parts)), len(parts), pos,
                                 budget=budget, cache=cache)
    order = [v for b in range(len(parts)) for v in orders[b]]
    peak = peak_memory(g, order)
    kept = peak > ref_peak
    if kept:
        order, peak = ref, ref_peak
    return Schedule(g, order, peak, "dp", time.perf_counter() - t0, exact,
                    len(parts), ref_peak, kept)
