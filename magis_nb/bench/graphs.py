"""Zoo training graphs as plain memory models, for the scheduling benchmarks."""
from __future__ import annotations

from typing import Iterator

from .. import zoo
from ..program import trace


def zoo_memgraphs(sizes=("tiny", "paper")) -> Iterator[tuple]:
    """Yield ``(name, MemGraph, program_order)`` for every zoo training graph."""
    for size in sizes:
        for name in zoo.names(size):
            device = "meta" if size == "paper" else "cpu"
            case = zoo.build(name, size, device=device)
            prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
            yield f"{name}-{size}", prog.memgraph, prog.program_order()
