"""Training BatchNorm as phases: statistics, then the elementwise normalize.

Note [BatchNorm in phases]
A training BatchNorm's statistics span the whole batch (and the image), so the
op as ATen writes it (``_native_batch_norm_legit_functional``, and its backward
with ``train=True``) is a barrier to every split along the batch or the image:
a part cannot normalize with statistics of its own (that would be "ghost"
BatchNorm, a different model). SyncBatchNorm faces the same problem across
GPUs and solves it with phases; `decompose_batch_norms` writes every training
BatchNorm of a graph the same way, with ops of this module:

    forward   s = bn_stats(x, shift)                 [3, C] float64: count, sum, sum of squares
              mean, invstd = bn_finalize(s, shift, eps, dtype)
              new_rm, new_rv = bn_running(s, shift, rm, rv, momentum)
              y = bn_elemt(x, w, b, mean, invstd)    elementwise
    backward  r = bn_backward_reduce(dy, x, mean, invstd)   [3, C] float64: count, sum dy, sum dy*xhat
              dx = bn_backward_elemt(dy, x, w, mean, invstd, r)  elementwise
              dw, db = bn_backward_affine(r, dtype)

``bn_stats`` and ``bn_backward_reduce`` have every dim but the channel as a
"sum" axis (dims_ops): their parts' results add up to the whole op's, so a
region split along the batch or the image ends at them with its partial sums
combined, and a region of the elementwise ops after them starts from the
whole statistics. The D-Graph's validity check (ftrans: a tensor flowing inside
a region is split on both ends) keeps a reduction and its readers out of one
region, so splits cut the graph into these phases by themselves; what the
second phase reads of the first's per-part values is kept whole, or recomputed
in parts by the backward regions that read it (Note [recomputed in parts] in
analysis/ftrans.py): the elementwise normalize is a plain op to recompute.

The sums are float64 and shifted by the running mean (the batch mean's best
guess before the batch is seen): the variance is a difference of two sums, and
shifting keeps it from cancelling when the mean is large against the spread.
Each part's sums come from its mean and variance (ATen's Welford
reduction), so a part adds ``n*(mean - shift)`` and
``n*(var + (mean - shift)^2)``. The results equal eager's to float32 rounding
(tests/test_phased_norm.py); the running statistics update as eager's do
(unbiased variance, ``momentum``), and ``num_batches_tracked`` is the graph's
own ``add``, untouched.

Only fp32 and fp64 BatchNorms are written so (`_training_forward`): one fed
bf16 or fp16 (autocast's convolutions, half parameters) stays ATen's op, whose
kernels compute in fp32 and round once; its batch axis is then no axis.

The elementwise ops reuse ATen's kernels where one exists: the normalize is the
eval-mode kernel with the variance ``invstd ** -2`` and eps 0 (as the remat of
a training BatchNorm does, rules/remat.py), the backward's reduction is
``native_batch_norm_backward`` in training mode asked for the weight and bias
gradients only, which it computes from the statistics it is given.
"""
from __future__ import annotations

import torch

from ..kernels import substitute
from .graph import Graph, Node, Ref, TensorInfo
from .passes import Rewriter

_lib = torch.library.Library("magis_nb", "FRAGMENT")
_lib.define("bn_stats(Tensor x, Tensor? shift) -> Tensor")
_lib.define("bn_finalize(Tensor stats, Tensor? shift, float eps, ScalarType dtype) -> (Tensor, Tensor)")
_lib.define("bn_running(Tensor stats, Tensor? shift, Tensor running_mean, Tensor running_var, "
            "float momentum) -> (Tensor, Tensor)")
_lib.define("bn_elemt(Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor invstd) -> Tensor")
_lib.define("bn_backward_reduce(Tensor grad_out, Tensor x, Tensor mean, Tensor invstd) -> Tensor")
_lib.define("bn_backward_elemt(Tensor grad_out, Tensor x, Tensor? weight, Tensor mean, "
            "Tensor invstd, Tensor sums) -> Tensor")
_lib.define("bn_backward_affine(Tensor sums, ScalarType dtype) -> (Tensor, Tensor)")

aten = torch.ops.aten


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A [C] vector shaped to broadcast along x's channel dim."""
    return v.view([1, -1] + [1] * (x.dim() - 2))


def _table(x: torch.Tensor) -> torch.Tensor:
    """A [3, C] float64 table of x's per-channel sums, its count row filled."""
    out = torch.empty((3, x.shape[1]), dtype=torch.float64, device=x.device)
    out[0].fill_(x.numel() // x.shape[1] if x.numel() else 0)
    return out


def bn_stats(x: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
    # ATen's batch statistics (mean and biased variance, Welford): 1.8 ms on
    # [16, 8, 128, 128] here, where var_mean over dims (0, 2, 3) took 5.8
    mean, var = aten.batch_norm_update_stats.default(x, None, None, 0.0)
    out = _table(x)
    d = out[1].copy_(mean)
    if shift is not None:
        d.sub_(shift)
    torch.addcmul(var, d, d, out=out[2])
    out[1:].mul_(out[0, 0])
    return out


def _moments(stats: torch.Tensor, shift: torch.Tensor | None):
    n, s1, s2 = stats.unbind(0)
    d = s1 / n
    var = (s2 / n - d * d).clamp_(min=0.0)
    mean = d if shift is None else d + shift.double()
    return n, mean, var


def bn_finalize(stats, shift, eps: float, dtype):
    _, mean, var = _moments(stats, shift)
    return mean.to(dtype), (var + eps).rsqrt().to(dtype)


def bn_running(stats, shift, running_mean, running_var, momentum: float):
    n, mean, var = _moments(stats, shift)
    unbiased = var * (n / (n - 1).clamp(min=1.0))
    rm = running_mean * (1 - momentum) + mean.to(running_mean.dtype) * momentum
    rv = running_var * (1 - momentum) + unbiased.to(running_var.dtype) * momentum
    return rm, rv


def bn_elemt(x, weight, bias, mean, invstd):
    var = invstd.pow(-2)
    return aten._native_batch_norm_legit_no_training.default(x, weight, bias, mean, var, 0.0, 0.0)[0]


def bn_backward_reduce(grad_out, x, mean, invstd):
    _, gw, gb = aten.native_batch_norm_backward.default(
        grad_out, x, None, None, None, mean, invstd, True, 0.0, [False, True, True])
    out = _table(x)
    out[1].copy_(gb)
    out[2].copy_(gw)
    return out


def bn_backward_elemt(grad_out, x, weight, mean, invstd, sums):
    """dx = a*(dy - sum_dy/n - xhat*sum_dy_xhat/n), a = w*invstd.

    Unsplit on the CPU (the sums count only this tensor's values), ATen's
    training backward computes exactly that, in one kernel, eager's bits.
    A part is written k*(x - mean) + a*dy + c per channel: one allocation
    (the result); x's mean comes off first, as ATen's kernel does (k*x + c
    would cancel where the mean is large against the spread)."""
    if x.device.type == "cpu" and x.numel() and int(sums[0, 0]) == x.numel() // x.shape[1]:
        return aten.native_batch_norm_backward.default(
            grad_out, x, weight, None, None, mean, invstd, True, 0.0, [True, False, False])[0]
    n, sdy, sdxh = sums.unbind(0)
    inv = invstd.double()
    a = inv if weight is None else inv * weight.double()
    dt = grad_out.dtype
    k = (-a * inv * sdxh / n).to(dt)
    c = (-a * sdy / n).to(dt)
    dx = torch.sub(x, _per_channel(mean, x))
    torch.addcmul(_per_channel(c, x), dx, _per_channel(k, x), out=dx)
    return dx.addcmul_(grad_out, _per_channel(a.to(dt), x))


def bn_backward_affine(sums, dtype):
    return sums[2].to(dtype), sums[1].to(dtype)


def _stats_meta(x, *rest):
    return x.new_empty((3, x.shape[1]), dtype=torch.float64)


def _pair_meta(stats, *rest):
    c, dtype = stats.shape[1], rest[-1]
    return stats.new_empty((c,), dtype=dtype), stats.new_empty((c,), dtype=dtype)


def _running_meta(stats, shift, rm, rv, momentum):
    return rm.new_empty(rm.shape), rv.new_empty(rv.shape)


def target(name: str) -> str:
    return f"magis_nb.{name}.default"


OPS = {}
for _fn, _meta in ((bn_stats, _stats_meta), (bn_finalize, _pair_meta),
                   (bn_running, _running_meta), (bn_elemt, lambda x, *r: torch.empty_like(x)),
                   (bn_backward_reduce, lambda dy, x, *r: _stats_meta(x)),
                   (bn_backward_elemt, lambda dy, *r: torch.empty_like(dy)),
                   (bn_backward_affine, _pair_meta)):
    _name = _fn.__name__
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")
    _lib.impl(_name, _meta, "Meta")
    OPS[_name] = getattr(torch.ops.magis_nb, _name).default
    substitute(target(_name), "_" + _name, _fn, OPS[_name])   # kernels.substitute


# -- the rewrite ------------------------------------------------------------------

_FUNCTIONAL = "aten._native_batch_norm_legit_functional.default"
_NO_STATS = "aten._native_batch_norm_legit.no_stats"
_BACKWARD = "aten.native_batch_norm_backward.default"


_WIDE = (torch.float32, torch.float64)


def _training_forward(g: Graph, n: Node) -> bool:
    """A training BatchNorm forward whose activations and statistics are fp32 or
    fp64. Not in bf16/fp16 (autocast's convolutions feed it bf16): ATen's
    kernels compute those in fp32 and round once, where the elementwise phases
    would round each step (a conv bias's gradient, zero but for rounding, came
    out 0.00122 off eager's on a bf16 conv-BN), and computing them in fp32
    would allocate what the memory model does not see. Those stay whole."""
    if n.target == _FUNCTIONAL:
        ok = len(n.args) == 8 and n.args[5] is True and not n.kwargs
    else:
        ok = n.target == _NO_STATS and len(n.args) == 6 and n.args[3] is True and not n.kwargs
    return ok and all(t is not None and t.dtype in _WIDE for t in n.outputs[:3]) \
        and g.tensor(n.args[0]).dtype == n.outputs[0].dtype


def _table_info(x: TensorInfo) -> TensorInfo:
    """The TensorInfo of a [3, C] float64 table of x's sums (`_table`)."""
    c = x.shape[1]
    return TensorInfo((3, c), torch.float64, 3 * c * torch.float64.itemsize, device=x.device)


def _add(rw: Rewriter, n: Node, suffix: str, name: str, args, outputs, *, keep=False) -> int:
    nid = rw.add(n.name if keep else n.name + suffix, target(name), OPS[name], args, {},
                 outputs, n.category, keep_name=keep)
    rw.nodes[nid].multi = len(outputs) > 1
    return nid


def _forward_rule(rw: Rewriter, n: Node, phased: set) -> bool:
    if not _training_forward(rw.g, n):
        return False
    fix = rw.fix
    functional = n.target == _FUNCTIONAL
    x, w, b = (None if a is None else fix(a) for a in n.args[:3])
    rm, rv = (fix(n.args[3]), fix(n.args[4])) if functional else (None, None)
    momentum, eps = float(n.args[-2]), float(n.args[-1])
    xt, vec = n.outputs[0], n.outputs[1]
    s = _add(rw, n, "_stats", "bn_stats", (x, rm), [_table_info(xt)])
    fin = _add(rw, n, "_moments", "bn_finalize", (Ref(s, 0), rm, eps, vec.dtype), [vec, n.outputs[2]])
    y = _add(rw, n, "", "bn_elemt", (x, w, b, Ref(fin, 0), Ref(fin, 1)), [xt], keep=True)
    rw.remap[Ref(n.id, 0)] = Ref(y, 0)
    rw.remap[Ref(n.id, 1)] = Ref(fin, 0)
    rw.remap[Ref(n.id, 2)] = Ref(fin, 1)
    if functional:
        run = _add(rw, n, "_running", "bn_running", (Ref(s, 0), rm, rm, rv, momentum),
                   [n.outputs[3], n.outputs[4]])
        rw.remap[Ref(n.id, 3)] = Ref(run, 0)
        rw.remap[Ref(n.id, 4)] = Ref(run, 1)
    # the backward knows a decomposed forward's statistics by the invstd it reads
    phased.add(Ref(fin, 1))
    return True


def _backward_rule(rw: Rewriter, n: Node, phased: set) -> bool:
    if n.target != _BACKWARD or len(n.args) != 10 or n.args[7] is not True or n.kwargs:
        return False
    fix = rw.fix
    mean, invstd = fix(n.args[5]), fix(n.args[6])
    if invstd not in phased:     # statistics from elsewhere (not a decomposed forward)
        return False
    dy, x = fix(n.args[0]), fix(n.args[1])
    w = None if n.args[2] is None else fix(n.args[2])
    mask = list(n.args[9])
    xt = rw.g.tensor(n.args[1])
    r = _add(rw, n, "_sums", "bn_backward_reduce", (dy, x, mean, invstd), [_table_info(xt)])
    if mask[0]:
        dx = _add(rw, n, "", "bn_backward_elemt", (dy, x, w, mean, invstd, Ref(r, 0)),
                  [n.outputs[0]], keep=True)
        rw.remap[Ref(n.id, 0)] = Ref(dx, 0)
    if mask[1] or mask[2]:
        vec = rw.g.tensor(n.args[6])
        dtype = vec.dtype if w is None else rw.g.tensor(n.args[2]).dtype
        aff = _add(rw, n, "_affine", "bn_backward_affine", (Ref(r, 0), dtype),
                   [n.outputs[1] or vec, n.outputs[2] or vec])
        if mask[1]:
            rw.remap[Ref(n.id, 1)] = Ref(aff, 0)
        if mask[2]:
            rw.remap[Ref(n.id, 2)] = Ref(aff, 1)
    return True


def decompose_batch_norms(g: Graph) -> Graph:
    """Every training BatchNorm (forward and backward) written in phases:
    Note [BatchNorm in phases]."""
    if not any(_training_forward(g, n) for n in g.nodes):
        return g
    phased: set[Ref] = set()
    return Rewriter(g).run(lambda rw, n: _forward_rule(rw, n, phased)
                           or _backward_rule(rw, n, phased))


PHASED_TARGETS = frozenset(target(name) for name in OPS)
# ops whose parts' results combine into what later phases read (`ftree._segments`)
PHASE_BARRIERS = frozenset(target(name) for name in ("bn_stats", "bn_backward_reduce"))
