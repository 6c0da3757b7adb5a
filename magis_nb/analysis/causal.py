"""Causal attention split along the queries: each part gets its own mask.

The fused attention kernels put the causal diagonal at row 0 of whatever
queries they are given (top-left alignment), so query part k of n, rows
[k*c, (k+1)*c), run with ``is_causal=True`` would let its first row see only
key 0. Each part instead runs with ``is_causal=False`` and an additive mask of
its own, ``causal_mask(q_part, k*c, S)``: [c, S], 0 where key j <= k*c + i and
-inf above, i.e. exactly the rows of the whole causal mask the part covers.
The mask lives only while its part runs (c*S elements in the queries' dtype):
the [L, S] mask of the whole never exists. Every query row sees key 0, so no
row is fully masked. Forward and backward take the same mask (the CPU kernels
accept ``attn_mask`` in both).

A rule asks for this by putting a `CausalPart` in the part's arguments;
`apply_fission` replaces it by a ``magis_nb::causal_mask`` op in each part
(its offset is the part's, like a ``narrow``'s: `runtime.codegen` writes it as
``_k * c`` inside a fission loop).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_lib = torch.library.Library("magis_nb", "FRAGMENT")
_lib.define("causal_mask(Tensor q, int offset, int keys) -> Tensor")


def causal_mask(q: torch.Tensor, offset: int, keys: int) -> torch.Tensor:
    """[rows, keys] of q's dtype: -inf where key j > offset + row i, else 0."""
    m = torch.full((q.shape[-2], keys), float("-inf"), dtype=q.dtype, device=q.device)
    return m.triu_(offset + 1)


def _causal_mask_meta(q, offset, keys):
    return q.new_empty((q.shape[-2], keys))


_lib.impl("causal_mask", causal_mask, "CompositeExplicitAutograd")
_lib.impl("causal_mask", _causal_mask_meta, "Meta")
CAUSAL_MASK = torch.ops.magis_nb.causal_mask.default
CAUSAL_MASK_TARGET = "magis_nb.causal_mask.default"


@dataclass(frozen=True)
class CausalPart:
    """A part's causal mask, as a placeholder argument of a split op: ``rows``
    queries per part, ``keys`` keys, the queries are tensor input ``q``."""
    rows: int
    keys: int
    q: int

    def make(self, q_part: torch.Tensor, k: int) -> torch.Tensor:
        return causal_mask(q_part, k * self.rows, self.keys)
