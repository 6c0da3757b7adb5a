"""A line search along one region's n (the number of fission parts).

One step per divisor costs a state each, and at n = 16 a paper-size
transformer's split graph has 56k ops (about 20 s a state): the queue would
rarely get there in a 60 s search. So when an F-Tree rule changed one region's
n and that lowered the peak, `jump` predicts from the two points the n that
meets the budget.
"""
from __future__ import annotations

from ..analysis.ftrans import divisors
from .objective import Objective
from .space import Space, State

JUMPS = 3                  # states a line search along n may add
TRUST = 4                  # a jump from n whose latency fell goes to at most TRUST * n


def jump(space: Space, parent: State, child: State, objective: Objective, *,
         skip_next: bool = True) -> tuple | None:
    """The plan at the n that ``parent`` and ``child`` predict meets the budget,
    or None. Latency grows about linearly with n (every part launches its ops
    again), the peak about as a + b/n (the split bytes shrink by n); when the
    latency fell from n0 to n1, no further than TRUST * n1. From an F-Tree child
    the next n is `mutate`'s, so only jumps past it are proposed
    (``skip_next``)."""
    old, new = dict(parent.plan), dict(child.plan)
    changed = [c for c in new if new[c] != old.get(c)]
    if len(changed) != 1 or child.peak >= parent.peak:
        return None
    cid = changed[0]
    n0, n1 = old.get(cid, 1), new[cid]
    if n1 <= n0:
        return None
    ahead = [d for d in divisors(space.cands[cid].max_n) if d > n1]
    if len(ahead) < (2 if skip_next else 1):
        return None
    if objective.kind == "lat":
        pick = _lat_pick(child, parent, objective, ahead, n0, n1)
    else:
        if child.peak <= objective.limit:
            return None                     # met: more parts only cost latency
        b = (parent.peak - child.peak) / (1 / n0 - 1 / n1)
        a = child.peak - b / n1
        fits = [d for d in ahead if a + b / d <= objective.limit]
        pick = fits[0] if fits else ahead[-1]
    if pick is None or (skip_next and pick == ahead[0]):
        return None
    return tuple(sorted({**new, cid: pick}.items()))


def _lat_pick(child: State, parent: State, objective: Objective, ahead: list[int],
              n0: int, n1: int) -> int | None:
    """Under a latency budget: the largest n ahead whose latency, extrapolated
    linearly in n, stays within the budget."""
    if child.latency > objective.limit:
        return None
    rise = child.latency - parent.latency
    if rise <= 0:
        # More parts ran faster: the two points contradict "linear in n" and
        # predict nothing. (Ops timed alone on a CPU do this: a small part's op
        # runs from cache.) Extrapolating a zero slope sent BERT and GPT at n=2
        # straight to n=48, measured x1.43-1.76.
        near = [d for d in ahead if d <= TRUST * n1]
        return near[-1] if near else None
    slope = rise / (n1 - n0)
    fits = [d for d in ahead if child.latency + slope * (d - n1) <= objective.limit]
    return fits[-1] if fits else None


def step_back(space: Space, cur: State, jumped: tuple) -> tuple | None:
    """After a jump that overshot the latency budget: the plan one divisor back
    from the jump's n, towards ``cur``'s, or None."""
    now = dict(cur.plan)
    cid, n = next((c, n) for c, n in jumped if now.get(c) != n)
    back = [d for d in divisors(space.cands[cid].max_n) if now[cid] < d < n]
    return tuple(sorted({**dict(jumped), cid: back[-1]}.items())) if back else None
