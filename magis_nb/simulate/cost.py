"""Op cost models: a roofline over a device profile, and costs measured on the device.

A `CostModel` answers two questions for the latency simulator: how long one op
node takes on the compute stream (`op_cost`), and how long moving ``nbytes``
between device and host takes on the copy stream (`transfer_cost`).

Every formula reads the node's own shapes, so the part copies of a fission region
(ordinary ops on part-sized tensors) cost one part each and a region costs the sum
of its parts.
"""
from __future__ import annotations

import math
from typing import Protocol, Sequence, runtime_checkable

from ..ir.graph import Graph, Node, Ref, iter_refs
from .profiles import DeviceProfile, get_profile

__all__ = ["CostModel", "RooflineCost", "make_cost", "op_flops", "op_bytes",
           "op_costs", "is_free"]


@runtime_checkable
class CostModel(Protocol):
    def op_cost(self, graph: Graph, node: Node | int) -> float: ...

    def transfer_cost(self, nbytes: int) -> float: ...


def op_costs(graph: Graph, cost: CostModel, nodes: Sequence[int] | None = None) -> dict[int, float]:
    """Seconds per op node (all ops by default): a table the search can reuse."""
    ids = graph.program_order() if nodes is None else nodes
    return {nid: float(cost.op_cost(graph, nid)) for nid in ids}


def make_cost(spec: "str | CostModel" = "roofline:rtx3090", **kwargs) -> CostModel:
    """A cost model from a short spec: "measured" (this machine's CPU), "measured:cuda",
    "roofline:<profile>" or just a profile name ("rtx3090", "a100", "h100", "h200", "cpu")."""
    if not isinstance(spec, str):
        return spec
    kind, _, arg = spec.partition(":")
    if kind == "measured":
        from .measured import MeasuredCost  # times ops with torch: imported on demand
        return MeasuredCost(arg or "cpu", **kwargs)
    if kind == "roofline":
        return RooflineCost(arg or "rtx3090", **kwargs)
    return RooflineCost(spec, **kwargs)


# -- shapes and bytes ----------------------------------------------------------

def node_of(graph: Graph, node: Node | int) -> Node:
    """``node`` itself, or the node of that id."""
    return graph.nodes[node] if isinstance(node, int) else node


def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)


def _itemsize(dtype) -> int:
    size = getattr(dtype, "itemsize", None)
    return int(size) if size is not None else 4


def dtype_name(dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).replace("torch.", "")


def _shape(graph: Graph, r) -> tuple[int, ...]:
    return tuple(graph.tensor(r).shape)


def _touched_bytes(graph: Graph, r: Ref) -> int:
    """Bytes an op touches reading/writing ``r``: its elements, but no more than its
    storage (an expand view reads its small base; a slice reads only its part)."""
    t = graph.tensor(r)
    n = _numel(t.shape) * _itemsize(t.dtype)
    base = graph.tensor(graph.storage_of(r)).nbytes
    return min(n, base) if base > 0 else n


_NO_DATA = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
            "aten.empty.default", "aten._assert_tensor_metadata.default"}


def _mutates(node: Node) -> bool:
    """Does the op write into (an alias of) an input: in-place and out= variants."""
    schema = getattr(node.op, "_schema", None)
    if schema is not None:
        return any(a.alias_info is not None and a.alias_info.is_write
                   for a in list(schema.arguments) + list(schema.returns))
    name, _, overload = node.target.rpartition(".")
    return overload == "out" or name.endswith("_")     # add_.Tensor, maximum.out


def is_free(node: Node) -> bool:
    """Views (every output aliases an input, nothing written), allocations without
    data (empty*), and ops with no outputs cost nothing."""
    if node.kind != "op" or node.target in _NO_DATA:
        return True
    outs = [t for t in node.outputs if t is not None]
    if not outs:
        return True
    return all(t.alias is not None for t in outs) and not _mutates(node)


# training BatchNorm targets -> the index of their ``training`` argument
_BN_TRAINING = {"aten._native_batch_norm_legit_functional.default": 5,
                "aten._native_batch_norm_legit.no_stats": 3}


def is_training_batch_norm(node: Node) -> bool:
    """A BatchNorm forward that takes its statistics from the batch."""
    i = _BN_TRAINING.get(node.target)
    return i is not None and len(node.args) == i + 3 and node.args[i] is True


def op_bytes(graph: Graph, node: Node | int) -> int:
    """Bytes the op moves: distinct inputs read + outputs written (0 when free).
    A training BatchNorm reads its input twice: once for the batch statistics
    and once to normalize (CUDA's batch_norm_stats, then batch_norm_elemt; the
    eval-mode kernel makes the one pass)."""
    n = node_of(graph, node)
    if is_free(n):
        return 0
    ins = sorted(set(n.refs()))
    total = 0
    out_bytes = sum(_touched_bytes(graph, Ref(n.id, i)) for i, t in enumerate(n.outputs)
                    if t is not None)
    for r in ins:
        b = _touched_bytes(graph, r)
        if n.target == "aten.embedding.default" and r == _first_ref(n.args):
            b = min(b, out_bytes)      # a gather reads only the rows it returns
        total += b
    if is_training_batch_norm(n):
        total += _touched_bytes(graph, n.args[0])
    return total + out_bytes


def _first_ref(args):
    for r in iter_refs(args):
        return r
    return None


# -- FLOPs ---------------------------------------------------------------------

def _mm_flops(a, b) -> int:
    """2*M*N*K for (..., M, K) @ (..., K, N), batch dims broadcast."""
    if len(a) == 1:
        a = (1,) + tuple(a)
    if len(b) == 1:
        b = tuple(b) + (1,)
    batch = _numel(a[:-2]) if len(a) > len(b) else _numel(b[:-2])
    return 2 * batch * a[-2] * a[-1] * b[-1]


def _conv_flops(x, w, out, transposed: bool) -> int:
    """2 * N * (output positions, or input positions when transposed) * prod(w).

    ``w`` is (Cout, Cin/groups, *k) or, transposed, (Cin, Cout/groups, *k): prod(w)
    already divides by the groups."""
    spatial = x[2:] if transposed else out[2:]
    return 2 * x[0] * _numel(spatial) * _numel(w)


def _sdpa_flops(q, k, v) -> int:
    """Q K^T and P V: 2*B*L*S*E + 2*B*L*S*Ev (batch = all leading dims)."""
    b, L, e = _numel(q[:-2]), q[-2], q[-1]
    s, ev = k[-2], v[-1]
    return 2 * b * L * s * e + 2 * b * L * s * ev


_MM = {"aten.mm.default": (0, 1), "aten.bmm.default": (0, 1), "aten.matmul.default": (0, 1),
       "aten.addmm.default": (1, 2), "aten.addmm_.default": (1, 2),
       "aten.baddbmm.default": (1, 2), "aten.mv.default": (0, 1),
       "aten.addmv.default": (1, 2), "aten.dot.default": (0, 1)}
_SDPA_FWD = {"aten._scaled_dot_product_flash_attention.default",
             "aten._scaled_dot_product_efficient_attention.default",
             "aten._scaled_dot_product_cudnn_attention.default",
             "aten._scaled_dot_product_flash_attention_for_cpu.default",
             "aten._scaled_dot_product_attention_math.default",
             "aten.scaled_dot_product_attention.default"}
_SDPA_BWD = {"aten._scaled_dot_product_flash_attention_backward.default",
             "aten._scaled_dot_product_efficient_attention_backward.default",
             "aten._scaled_dot_product_cudnn_attention_backward.default",
             "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"}


def _is_matmul_like(target: str) -> bool:
    return (target in _MM or target in _SDPA_FWD or target in _SDPA_BWD
            or target.startswith(("aten.convolution", "aten.linear")))


def op_flops(graph: Graph, node: Node | int) -> int:
    """Floating-point operations of one op node, from its own shapes.

    matmuls 2*M*N*K; convolution per `_conv_flops`; convolution_backward one forward
    conv per requested grad_input / grad_weight (+ grad_output numel for grad_bias);
    SDPA forward two matmuls, backward four; everything else ~1 FLOP per element
    processed (the larger of output elements and the largest input).
    """
    n = node_of(graph, node)
    if is_free(n):
        return 0
    a, t = n.args, n.target
    shp = lambda r: _shape(graph, r)  # noqa: E731
    if t in _MM:
        i, j = _MM[t]
        return _mm_flops(shp(a[i]), shp(a[j]))
    if t == "aten.linear.default":
        x, w = shp(a[0]), shp(a[1])
        return 2 * _numel(x) * w[0]
    if t == "aten.convolution.default" or t == "aten._convolution.default":
        return _conv_flops(shp(a[0]), shp(a[1]), shp(Ref(n.id, 0)), bool(a[6]))
    if t == "aten.convolution_backward.default":
        gout, x, w = shp(a[0]), shp(a[1]), shp(a[2])
        mask = a[10]
        fwd = _conv_flops(x, w, gout, bool(a[7]))
        return fwd * (int(bool(mask[0])) + int(bool(mask[1]))) + (_numel(gout) if mask[2] else 0)
    if t in _SDPA_FWD:
        return _sdpa_flops(shp(a[0]), shp(a[1]), shp(a[2]))
    if t in _SDPA_BWD:
        return 2 * _sdpa_flops(shp(a[1]), shp(a[2]), shp(a[3]))
    outs = sum(_numel(o.shape) for o in n.outputs if o is not None)
    ins = max((_numel(shp(r)) for r in iter_refs((a, n.kwargs))), default=0)
    return max(outs, ins)


def _main_dtype(graph: Graph, n: Node):
    for o in n.outputs:
        if o is not None:
            return o.dtype
    return None


# -- roofline ------------------------------------------------------------------

class RooflineCost:
    """time = max(flops / peak[dtype], bytes / mem_bw) + launch overhead; free ops 0.

    ``tf32``: fp32 matmuls and convolutions run at the profile's "tfloat32" peak
    (the paper trains its fp32 models with TF32).
    """

    def __init__(self, profile: str | DeviceProfile = "rtx3090", *, tf32: bool = True):
        self.profile = get_profile(profile)
        self.tf32 = tf32

    def __repr__(self) -> str:
        return f"RooflineCost({self.profile.name!r})"

    @property
    def label(self) -> str:
        return self.profile.name

    @property
    def async_copies(self) -> bool:
        """A GPU's copy engines move swaps while it computes; a CPU copies itself."""
        return self.profile.name != "cpu"

    def op_cost(self, graph: Graph, node: Node | int) -> float:
        n = node_of(graph, node)
        if is_free(n):
            return 0.0
        dt = dtype_name(_main_dtype(graph, n))
        if self.tf32 and dt == "float32" and _is_matmul_like(n.target):
            dt = "tfloat32"
        p = self.profile
        return max(op_flops(graph, n) / p.peak(dt), op_bytes(graph, n) / p.mem_bw) \
            + p.launch_overhead_s

    def transfer_cost(self, nbytes: int) -> float:
        return nbytes / self.profile.host_link_bw if nbytes > 0 else 0.0


# -- measured ------------------------------------------------------------------
