"""M-Rules: graph rewrites the search applies (paper §5). So far: re-materialization
and its inverse; the F-Tree mutation rules live in magis_nb.analysis.ftree."""
from .remat import can_rematerialize, merge_recompute, rematerialize

__all__ = ["rematerialize", "merge_recompute", "can_rematerialize"]
