"""What a search optimizes: the objective of a budget, and the Pareto front.

Modes. Memory limit M: minimize latency among states with peak <= M (states
above M rank by peak). Latency limit L: minimize peak among states with latency
<= L (states above L rank by latency); ties go to the other measure.
``better(a, b, relax)`` is the seed's
BetterThan: the lexicographic key of ``a`` against ``b``'s key scaled by
``relax``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .space import State


@dataclass
class Objective:
    kind: str                  # "mem" | "lat"
    limit: float               # bytes | seconds

    def key(self, s: State, relax: float = 1.0) -> tuple:
        # the other measure last: of two plans at the same peak under a latency
        # budget, the faster (before packed masks were drawn one at a time, paper
        # BTLM split in 16 and in 32 both peaked at 21247 MiB, at x1.085 and x1.146)
        if self.kind == "mem":
            return (max(relax * s.peak, self.limit), relax * s.latency, relax * s.peak)
        return (max(relax * s.latency, self.limit), relax * s.peak, relax * s.latency)

    def better(self, a: State, b: State, relax: float = 1.0) -> bool:
        return self.key(a) < self.key(b, relax)


@dataclass
class SearchLog:
    """What a search returns: the best state, the (peak, latency) front, counts."""
    best: State
    pareto: list[State] = field(default_factory=list)
    states: int = 0
    seconds: float = 0.0
    interrupted: bool = False
    # children not built: predicted to end past the time budget (Note [a state's
    # cost before it is built] in search.algorithm)
    too_big: int = 0
    # F-Tree children not built under a latency budget: predicted over it
    # (`Search.too_slow`)
    over: int = 0


def pareto_add(front: list[State], s: State) -> list[State]:
    """``front`` with ``s`` added unless dominated (and the states it dominates
    removed), ordered by peak."""
    if any(o.peak <= s.peak and o.latency <= s.latency for o in front):
        return front
    front = [o for o in front if not (s.peak <= o.peak and s.latency <= o.latency)]
    front.append(s)
    front.sort(key=lambda o: (o.peak, o.latency))
    return front
