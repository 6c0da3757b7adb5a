"""Dimension rules for the fused scaled_dot_product_attention kernels.

``F.scaled_dot_product_attention`` reaches the ATen graph as one fused op (which
one depends on the device) and its backward. Shapes: query [B,H,L,E], key/value
[B,Hkv,S,E], an optional float mask broadcastable to [B,H,L,S] (2-D or 4-D,
aligned from the right), output [B,H,L,E] and logsumexp [B,H,L].

- batch: every tensor is independent per batch element.
- heads: likewise per head. With grouped-query attention (Hkv divides H) query
  head h reads key/value head h*Hkv/H; an equal split of both head dims keeps
  that pairing when n divides Hkv, so the axis has size Hkv and cuts the query
  dims (length H) and the key/value dims (length Hkv) into n chunks each (Note
  [axis sizes] in dims.py).
- query: each query row is its own softmax, so splitting L is exact. With
  is_causal the kernel puts the causal diagonal at row 0 of whatever it is
  given, so each part runs without is_causal and with its own rows of the
  causal mask instead (analysis/causal.py). In the backward grad_key/grad_value
  are sums over query rows ("sum"). A mask row follows its query (sliced with
  it); a mask broadcast over L is passed whole.
- the key sequence S is a softmax reduction: partial results would need a
  logsumexp rescale, not a plain combine. Not an axis.

Dropout (dropout_p > 0) draws a mask from the RNG per element: no rule (the CPU
kernel refuses it anyway). The CPU kernel reads every operand through its
strides: narrowed, non-contiguous parts and the logsumexp's [B,L,H] memory
order are fine (tests/test_dims_attention.py runs them). Note: the forwards
carry the ``nondeterministic_seeded`` tag (for their dropout), and a node the
capture marks ``rng`` gets no rule from ``op_dims`` whatever its dropout_p.

The CUDA kernels (flash, memory-efficient) cannot be run here; their rules are
written from the schema and meta shapes only, so they are kept to what does not
change any size argument: batch and heads, equal head counts, no dropout, no
debug mask, the dense (not varlen) path. Their forwards also return RNG state
(philox seed/offset) that no axis indexes; it gets no combine, so a forward whose
state is read outside the region (by its backward) stays out of a split region.
"""
from __future__ import annotations

from .causal import CausalPart
from .dims_base import Bound, OpDims, ax, axes_of, rule


def _mask_dim(ins, m, d, size):
    """The dim of mask ``m`` under query dim ``d`` (right-aligned to 4-D), when
    it has the full size there (else broadcast: the mask is passed whole)."""
    if m is None:
        return None
    md = d - (4 - len(ins[m]))
    return md if md >= 0 and ins[m][md] == size else None


def _axes(ins, q_side, kv_side, mask, q_outs, kv_outs, mask_out=None, *,
          query, gqa, query_combine):
    """q_side/kv_side: tensor inputs laid out [B,H,L,..] / [B,Hkv,S,..];
    q_outs/kv_outs: outputs laid out likewise; mask_out: an output shaped like
    the mask (the bias gradient). query: offer the L axis."""
    q_side = [t for t in q_side if t is not None]
    B, H, L = ins[q_side[0]][:3]
    Hkv = ins[kv_side[0]][1]
    heads = Hkv if Hkv == H or (gqa and H % Hkv == 0) else None
    res = []
    for d, size, name in ((0, B, "batch"), (1, heads, "heads")):
        if size is None:
            continue
        md = _mask_dim(ins, mask, d, ins[q_side[0]][d])
        if mask_out is not None and md is None:
            continue            # a bias gradient summed over the axis: not verified
        tens = [(t, d) for t in q_side + kv_side] + ([(mask, md)] if md is not None else [])
        out = [(o, d) for o in q_outs + kv_outs]
        if mask_out is not None:
            out.append((mask_out, md))
        # every output carries batch and heads; the CUDA forwards' RNG state, which
        # none indexes, must not be merged (None)
        res.append(ax(size, tens, out, None, name))
    if query:
        md = _mask_dim(ins, mask, 2, L)
        tens = [(t, 2) for t in q_side] + ([(mask, md)] if md is not None else [])
        res.append(ax(L, tens, [(o, 2) for o in q_outs], query_combine, "query"))
    return axes_of(*res)


# -- CPU ------------------------------------------------------------------------

def _causal_parts(b, ins, axes, kv_outs=()):
    """On the query axis of a causal op, each part takes its rows of the causal
    mask (analysis/causal.py), and with as many queries as keys only the keys
    its rows see (Note [the keys a causal part sees]; ``kv_outs``: the
    outputs shaped like key and value, their gradients). A causal op with a
    mask of its own gets no query axis (the kernels refuse both together)."""
    causal = bool(b["is_causal"])
    if causal and b.t("attn_mask") is not None:
        return OpDims([a for a in axes if a.name != "query"])
    if not causal:
        return OpDims(axes)
    q = b.t("query")
    L, S = ins[q][2], ins[b.t("key")][2]
    kv = (b.t("key"), b.t("value")) if L == S else ()

    def rw(node, axis, out_shapes):
        if axes[axis].name != "query":
            return tuple(node.args), dict(node.kwargs)
        n = L // (out_shapes[0][2] if out_shapes[0] else L)
        part = CausalPart(L // n, S, q, kv, tuple(kv_outs) if kv else ())
        return Bound(node).replace(is_causal=False, attn_mask=part)
    return OpDims(axes, rw)


@rule("aten._scaled_dot_product_flash_attention_for_cpu")
def _sdpa_cpu(node, b, ins, outs):
    """(output [B,H,L,E], logsumexp [B,H,L]): both on the query side; nothing to
    merge on any axis."""
    if b["dropout_p"]:
        return None
    return _causal_parts(b, ins, _axes(ins, [b.t("query")], [b.t("key"), b.t("value")],
                                       b.t("attn_mask"), [0, 1], [], query=True, gqa=True,
                                       query_combine=None))


@rule("aten._scaled_dot_product_flash_attention_for_cpu_backward")
def _sdpa_cpu_backward(node, b, ins, outs):
    """(grad_query, grad_key, grad_value); on the query axis the key/value
    gradients are sums over the parts."""
    if b["dropout_p"]:
        return None
    q_side = [b.t(n) for n in ("query", "grad_out", "out", "logsumexp")]
    return _causal_parts(b, ins, _axes(ins, q_side, [b.t("key"), b.t("value")], b.t("attn_mask"),
                                       [0], [1, 2], query=True, gqa=True, query_combine="sum"),
                         kv_outs=(1, 2))


# -- CUDA: batch and heads only (see the module docstring) -------------------------

@rule("aten._scaled_dot_product_flash_attention")
def _sdpa_flash(node, b, ins, outs):
    """(output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused,
    debug_attn_mask): the sizes max_q/max_k do not change on batch or heads."""
    if b["dropout_p"] or b["return_debug_mask"]:
        return None
    return OpDims(_axes(ins, [b.t("query")], [b.t("key"), b.t("value")], None,
                        [0, 1], [], query=False, gqa=False, query_combine=None))


@rule("aten._scaled_dot_product_flash_attention_backward")
def _sdpa_flash_backward(node, b, ins, outs):
    """philox_seed/offset are passed whole (unused without dropout); a real
    cum_seq_q/k tensor means the varlen path: no rule."""
    if b["dropout_p"] or b.t("cum_seq_q") is not None or b.t("cum_seq_k") is not None:
        return None
    q_side = [b.t(n) for n in ("query", "grad_out", "out", "logsumexp")]
    return OpDims(_axes(ins, q_side, [b.t("key"), b.t("value")], None, [0], [1, 2],
                        query=False, gqa=False, query_combine=None))


@rule("aten._scaled_dot_product_efficient_attention")
def _sdpa_efficient(node, b, ins, outs):
    """(output, logsumexp [B,H,L padded to 32 or 0], philox_seed, philox_offset)."""
    if b["dropout_p"]:
        return None
    return OpDims(_axes(ins, [b.t("query")], [b.t("key"), b.t("value")], b.t("attn_bias"),
                        [0, 1], [], query=False, gqa=False, query_combine=None))


@rule("aten._scaled_dot_product_efficient_attention_backward")
def _sdpa_efficient_backward(node, b, ins, outs):
    """(grad_q, grad_k, grad_v, grad_bias): grad_bias, when asked for, has the
    bias's shape; an axis the bias is broadcast along is left out then."""
    if b["dropout_p"]:
        return None
    q_side = [b.t(n) for n in ("query", "grad_out_", "out", "logsumexp")]
    bias_out = 3 if len(outs) > 3 and outs[3] is not None else None
    return OpDims(_axes(ins, q_side, [b.t("key"), b.t("value")], b.t("attn_bias"),
                        [0], [1, 2], bias_out, query=False, gqa=False, query_combine=None))
