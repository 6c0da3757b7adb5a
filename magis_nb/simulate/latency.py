"""Latency of a schedule: one compute stream plus one copy stream joined by events.

Ops run back to back on the compute stream in schedule order. Swaps (Store: device
-> host, Load: host -> device) run one after another on the copy stream, in the
order given. A transfer waits for an event recorded after ``after`` finished on the
compute stream (None: it may start at time 0); the compute stream waits for the
transfer before it starts ``before`` (None: nobody waits). For a Load, ``before`` is
the first user of the loaded tensor; for a Store it is the op that must not run
until the tensor is safely on the host (typically the one whose allocation reuses
its memory), or None. The step is done when both streams are done.

Data parallel adds a third stream (``comms``): each gradient bucket's all_reduce
starts once its bucket op is done on the compute stream and the previous
all_reduce is done; nothing waits for it but the end of the step
(`distributed.buckets`).

This is the model of DESIGN.md §4. A fission region needs nothing special: its part
copies are ordinary ops with part-sized shapes, so it costs the sum of its parts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple, Sequence

from ..ir.graph import Graph
from .cost import CostModel

__all__ = ["Transfer", "LatencyResult", "simulate_latency", "program_latency"]


class Transfer(NamedTuple):
    kind: str                 # "store" | "load"
    nbytes: int
    after: int | None         # node id whose end the copy waits for
    before: int | None        # node id whose start waits for the copy


@dataclass
class LatencyResult:
    total_s: float                           # both streams done
    compute_s: float                         # sum of op costs (busy compute stream)
    copy_s: float                            # sum of transfer costs (busy copy stream)
    order: list[int]
    op_times: dict[int, tuple[float, float]]  # node id -> (start, end)
    transfer_times: list[tuple[float, float]] = field(default_factory=list)
    comm_s: float = 0.0                      # sum of all_reduce costs (busy comm stream)
    comm_times: list[tuple[float, float]] = field(default_factory=list)

    @property
    def stall_s(self) -> float:
        """Time the compute stream spends waiting for copies (the exposed transfers)."""
        return self.total_s - self.compute_s

    def __repr__(self) -> str:
        return (f"LatencyResult(total={self.total_s * 1e3:.3f} ms, compute={self.compute_s * 1e3:.3f} ms, "
                f"copy={self.copy_s * 1e3:.3f} ms, {len(self.order)} ops, "
                f"{len(self.transfer_times)} transfers)")


def _as_transfer(t) -> Transfer:
    t = Transfer(*t) if not isinstance(t, Transfer) else t
    if t.kind not in ("store", "load"):
        raise ValueError(f"transfer kind must be 'store' or 'load', not {t.kind!r}")
    if t.nbytes < 0:
        raise ValueError(f"transfer of negative size {t.nbytes}")
    return t


def simulate_latency(graph: Graph, order: Sequence[int], cost: CostModel | Mapping[int, float], *,
                     transfers: Iterable | None = None, check: bool = True,
                     comms: Sequence[tuple[int, int]] = (), comm_cost=None) -> LatencyResult:
    """Simulate ``order`` (op node ids) on a compute stream and ``transfers`` on a copy stream.

    ``cost`` is a CostModel, or a precomputed node id -> seconds table (see
    `cost.op_costs`) so a search can re-simulate many orders cheaply. Transfers are
    `Transfer`s or (kind, nbytes, after, before) tuples. With ``check``, ``order`` must
    list each op at most once and respect the graph's dependencies among the listed
    ops. Raises ValueError on a transfer that names a node not in ``order`` or when
    the events deadlock (a Load needed before the op it waits for has run).
    ``comms``: (nbytes, node id of the bucket op) per all_reduce, in issue order,
    priced by ``comm_cost(nbytes)``.
    """
    order = list(order)
    pos = {nid: i for i, nid in enumerate(order)}
    if check:
        if len(pos) != len(order):
            raise ValueError("order lists an op more than once")
        for nid in order:
            if graph.nodes[nid].kind != "op":
                raise ValueError(f"{graph.nodes[nid].name} is not an op")
            for p in graph.preds(nid):
                if p in pos and pos[p] > pos[nid]:
                    raise ValueError(f"order runs {graph.nodes[nid].name} before its "
                                     f"predecessor {graph.nodes[p].name}")
    if isinstance(cost, Mapping):
        dur = [float(cost[nid]) for nid in order]
        link = None
    else:
        dur = [float(cost.op_cost(graph, nid)) for nid in order]
        link = cost
    xs = [_as_transfer(t) for t in (transfers or ())]
    if xs and link is None:
        raise ValueError("transfers need a CostModel (its transfer_cost), not a cost table")
    xdur = [float(link.transfer_cost(t.nbytes)) for t in xs] if xs else []
    waits: dict[int, list[int]] = {}     # order position -> transfers it waits for
    for j, t in enumerate(xs):
        for nid in (t.after, t.before):
            if nid is not None and nid not in pos:
                raise ValueError(f"transfer {j} names node {nid}, which is not in the order")
        if t.before is not None:
            waits.setdefault(pos[t.before], []).append(j)

    start = [0.0] * len(order)
    end = [0.0] * len(order)
    xstart = [0.0] * len(xs)
    xend = [0.0] * len(xs)
    i = j = 0                            # next op, next transfer
    compute_free = copy_free = 0.0
    while i < len(order) or j < len(xs):
        progressed = False
        # advance the compute stream while its next op's transfers are done
        while i < len(order) and all(k < j for k in waits.get(i, ())):
            s = max([compute_free] + [xend[k] for k in waits.get(i, ())])
            start[i], end[i] = s, s + dur[i]
            compute_free = end[i]
            i += 1
            progressed = True
        # advance the copy stream while its next transfer's event has fired
        while j < len(xs) and (xs[j].after is None or pos[xs[j].after] < i):
            a = xs[j].after
            s = max(copy_free, end[pos[a]] if a is not None else 0.0)
            xstart[j], xend[j] = s, s + xdur[j]
            copy_free = xend[j]
            j += 1
            progressed = True
        if not progressed:
            raise ValueError(f"deadlock: op {graph.nodes[order[i]].name} waits for transfer "
                             f"{j}, which waits for a later op")
    comm_free, ctimes = 0.0, []
    for nbytes, after in comms:
        s = max(comm_free, end[pos[after]])
        comm_free = s + float(comm_cost(nbytes))
        ctimes.append((s, comm_free))
    total = max([compute_free, copy_free, comm_free])
    return LatencyResult(total, sum(dur), sum(xdur), order,
                         {nid: (start[k], end[k]) for k, nid in enumerate(order)},
                         list(zip(xstart, xend)), sum(e - s for s, e in ctimes), ctimes)


def program_latency(program, cost: CostModel | Mapping[int, float],
                    mg_order: Sequence[int] | None = None, *,
                    transfers: Iterable | None = None) -> LatencyResult:
    """Latency of a `Program` in program order (or memgraph order ``mg_order``)."""
    order = program.program_order() if mg_order is None else mg_order
    return simulate_latency(program.graph, program.to_node_order(order), cost,
                            transfers=transfers)
