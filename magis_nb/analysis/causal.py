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

Note [the keys a causal part sees]
Query rows [k*c, (k+1)*c) of a causal self-attention (as many queries as keys)
see keys [0, (k+1)*c) only. Run against all S keys under its mask, every part
costs what the whole attention row block costs without is_causal: the split
attention did twice the work of the causal kernel, and in 64 parts at 2048
tokens the Llama-style model's simulated attention went from 38 ms forward
(eager) to 174 ms. Each part instead reads the first (k+1)*c rows of key and
value (``narrow`` views, `Region.prefix`) with a [c, (k+1)*c] mask: half the
work in all. In the backward its grad_key and grad_value cover those rows
only, and are added into the first (k+1)*c rows of the sums. Parts then
differ in shape but not in code: `runtime.codegen` writes the lengths as
``(_k + 1) * c`` in a fission loop.

A rule asks for this by putting a `CausalPart` in the part's arguments;
`apply_fission` replaces it by a ``magis_nb::causal_mask`` op in each part
(its offset is the part's, like a ``narrow``'s: `runtime.codegen` writes it as
``_k * c`` inside a fission loop).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import substitute

_lib = torch.library.Library("magis_nb", "FRAGMENT")
_lib.define("causal_mask(Tensor q, int offset, int keys) -> Tensor")


def causal_mask(q: torch.Tensor, offset: int, keys: int) -> torch.Tensor:
    """[rows, keys] of q's dtype: -inf where key j > offset + row i, else 0."""
    m = torch.zeros((q.shape[-2], keys), dtype=q.dtype, device=q.device)
    # only keys from ``offset`` on can be masked: filling and triangling just
    # those (a [c, c] block for a part that sees its prefix) made the 16 masks
    # of a 2048-token split in 0.31 ms instead of 0.82 here
    start = min(max(offset, 0), keys)
    m.narrow(1, start, keys - start).fill_(float("-inf")).triu_(offset + 1 - start)
    return m


def _causal_mask_meta(q, offset, keys):
    return q.new_empty((q.shape[-2], keys))


_lib.impl("causal_mask", causal_mask, "CompositeExplicitAutograd")
_lib.impl("causal_mask", _causal_mask_meta, "Meta")
CAUSAL_MASK = torch.ops.magis_nb.causal_mask.default
CAUSAL_MASK_TARGET = "magis_nb.causal_mask.default"
substitute(CAUSAL_MASK_TARGET, "_causal_mask", causal_mask, CAUSAL_MASK)   # kernels.substitute


@dataclass(frozen=True)
class CausalPart:
    """A part's causal mask, as a placeholder argument of a split op: ``rows``
    queries per part, ``keys`` keys, the queries are tensor input ``q``.
    ``prefix``: tensor inputs (key, value) part k reads the first (k + 1) *
    rows of along dim 2, and outputs (their gradients) that cover as many;
    the mask then has that many keys (Note [the keys a causal part sees])."""
    rows: int
    keys: int
    q: int
    prefix: tuple[int, ...] = ()
    prefix_outs: tuple[int, ...] = ()

    def keys_of(self, k: int) -> int:
        """The keys part k's mask covers."""
        return (k + 1) * self.rows if self.prefix else self.keys

    def make(self, q_part: torch.Tensor, k: int) -> torch.Tensor:
        return causal_mask(q_part, k * self.rows, self.keys_of(k))
