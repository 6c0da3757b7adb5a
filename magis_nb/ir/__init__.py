"""The IR: ATen ops on a rustworkx DAG, tensors, storages and aliases."""
from .build import build_graph, op_name
from .digest import graph_digest
from .graph import Graph, Node, Ref, TensorInfo, iter_refs, map_refs

__all__ = ["Graph", "Node", "Ref", "TensorInfo", "build_graph", "graph_digest",
           "iter_refs", "map_refs", "op_name"]
