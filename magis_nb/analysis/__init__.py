"""M-Analyzer: dimension rules, the D-Graph, F-Trans and the F-Tree (paper §4)."""
from .apply import apply_fission
from .dgraph import Component, DGraph
from .ftrans import FTrans, check, divisors, max_parts, plan_outputs, region_outputs
from .ftree import Candidate, build_ftree, mutations

__all__ = ["DGraph", "Component", "FTrans", "check", "divisors", "max_parts", "plan_outputs",
           "region_outputs", "apply_fission", "Candidate", "build_ftree", "mutations"]
