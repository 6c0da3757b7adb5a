"""M-Rules: graph rewrites the search applies (paper §5). So far: re-materialization,
swapping and their inverses; the F-Tree mutation rules live in magis_nb.analysis.ftree."""
from .remat import can_rematerialize, merge_recompute, rematerialize
from .swap import swap, unswap

__all__ = ["rematerialize", "merge_recompute", "can_rematerialize", "swap", "unswap"]
