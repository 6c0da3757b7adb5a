"""M-Rules: graph rewrites the search applies (paper §5): re-materialization,
swapping, a TASO subset (merge matmuls sharing an input; move a constant scale
onto a matmul's smaller input) and their inverses; the F-Tree mutation rules
live in magis_nb.analysis.ftree."""
from .algebra import merge_matmuls, split_matmul
from .remat import can_rematerialize, merge_recompute, rematerialize
from .scale import lift_scale, sink_scale
from .swap import swap, unswap

__all__ = ["rematerialize", "merge_recompute", "can_rematerialize", "swap", "unswap",
           "merge_matmuls", "split_matmul", "sink_scale", "lift_scale"]
