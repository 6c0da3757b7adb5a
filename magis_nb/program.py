"""A captured program: the graph, its memory model, and runnable modules for orders."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch.nn as nn

from .capture import Captured, capture, uncompiled
from .ir import Graph, Ref, build_graph
from .ir.phased_norm import decompose_batch_norms
from .ir.passes import (decompose_dropout, drop_identity_clones, drop_metadata_asserts,
                        read_through_detaches, split_mean_loss)
from .ir.shifted_loss import unshift_loss
from .runtime import OptimizedModule
from .simulate import MemGraph, MemoryTimeline, simulate_memory


@dataclass
class Program:
    model: nn.Module
    captured: Captured
    graph: Graph
    memgraph: MemGraph
    op_ids: list[int]              # memgraph op index -> graph node id
    storage_refs: list[Ref]        # memgraph storage index -> base tensor

    def with_graph(self, graph: Graph) -> "Program":
        """The same captured step with a rewritten graph (e.g. after fission)."""
        mg, op_ids, refs = graph.memgraph()
        return Program(self.model, self.captured, graph, mg, op_ids, refs)

    def hotspots(self, mg_order: Sequence[int] | None = None) -> dict[Ref, int]:
        """Storages live at the peak -> bytes (the paper's H)."""
        tl = self.simulate(mg_order)
        return {self.storage_refs[i]: self.memgraph.storages[i].size for i in tl.hotspots}

    def to_node_order(self, mg_order: Sequence[int]) -> list[int]:
        return [self.op_ids[i] for i in mg_order]

    def program_order(self) -> list[int]:
        """Memgraph op indices in the order PyTorch emitted them."""
        return list(range(self.memgraph.n))

    def simulate(self, mg_order: Sequence[int] | None = None) -> MemoryTimeline:
        order = self.program_order() if mg_order is None else mg_order
        return simulate_memory(self.memgraph, order)

    def module(self, mg_order: Sequence[int] | None = None) -> OptimizedModule:
        order = self.program_order() if mg_order is None else mg_order
        return OptimizedModule(self.model, self.captured, self.graph, self.to_node_order(order))


def trace(model: nn.Module, inputs, *, loss_fn: Callable | None = None,
          mode: str = "train") -> Program:
    """Capture ``model`` and build its IR and memory model."""
    model = uncompiled(model)
    return program_of(model, capture(model, inputs, loss_fn=loss_fn, mode=mode))


def program_of(model: nn.Module, cap: Captured) -> Program:
    """The IR and memory model of a captured step (`trace` after its capture):
    the unoptimized program every plan of ``cap`` rewrites."""
    g = split_mean_loss(decompose_dropout(unshift_loss(drop_metadata_asserts(build_graph(cap)))))
    g = decompose_batch_norms(read_through_detaches(drop_identity_clones(g)))
    mg, op_ids, refs = g.memgraph()
    return Program(model, cap, g, mg, op_ids, refs)
