"""Fixes for PyTorch decompositions that trace something other than eager runs.

Note [RNN dropout between layers]
``torch._decomp.decompositions._rnn_helper`` (the decomposition of ``aten.lstm``,
``aten.gru`` and ``aten.rnn_*`` that ``aot_export_module`` traces) never applies
the dropout between layers: it sets ``dropout = dropout if (train and
num_layers < i - 1) else 0.0``, a condition that is never true. A captured
``nn.LSTM(num_layers=2, dropout=0.1)`` then trains without it, and its gradients
differed from eager's by 4e-4 (GRU: 2e-3) in the corpus. While a capture runs,
the helper is replaced by one that runs the layers one at a time through the
original (so each layer is PyTorch's own decomposition) and applies
``torch.dropout`` between them on the sequence-first output, where and how
eager's ATen RNN does: the same op on the same tensor, so the same mask.

Note [BatchNorm's output layout]
``native_batch_norm_helper`` (the decomposition behind the fake kernels of
``native_batch_norm`` and ``_native_batch_norm_legit[_functional]``) computes
the output elementwise, so a fake output has the input's strides; ATen's CPU
and CUDA kernels allocate it ``empty_like(input, input.suggest_memory_format())``:
contiguous for a transposed input. A ``BatchNorm1d`` over the channels of a
[B, L, C] sequence (``bn(x.transpose(1, 2)).transpose(1, 2)``, PatchTST) then
traced a ``view`` of the transposed-back output that the real output cannot
take, and ``aot_export_module``'s second pass, on real tensors, failed with
"view size is not compatible with input tensor's size and stride". While a
capture runs, the helper's output is laid out as the kernels lay it out.
The backward of MSE, smooth L1 and Huber losses likewise: ATen allocates the
input gradient ``zeros_like(input, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``, the
decompositions return the input's layout (PatchTST's loss on a transposed
prediction).

Note [the joint replayed under autocast]
``aot_export_module(trace_joint=True)`` traces the step twice: once into a joint
graph (``_aot_export_function``), then ``make_fx`` of a wrapper that calls that
graph, to drop its tangents. The caller's ``torch.autocast`` is still on for
the second trace, so autocast casts the recorded ATen ops again, and those ops
already hold the first trace's casts. Ops that autocast had left in fp32 on
purpose get cast down. On the CPU, SDPA with dropout runs its MATH fallback
(``_fused_sdp_choice`` gives MATH for any ``dropout_p > 0``). That fallback
upcasts q, k and v to fp32 under autocast's exclusion, and the replay runs its
``bmm`` in bf16. With a float mask (every Hugging Face padding mask) the
softmax gradient then arrives in bf16 against an fp32 output:
"expected scalar type Float but found BFloat16" (GPT-2 under CPU bf16
autocast). Without a mask (``is_causal``) nothing failed, but the attention
scores were computed in bf16 where eager computes them in fp32. While a
capture runs, the joint graph is replayed with autocast off: the second trace
records what the first one did.
"""
from __future__ import annotations

import contextlib

import torch


def _layerwise(orig):
    def helper(input, hidden, params, has_biases, num_layers, dropout, train,
               bidirectional, batch_first, layer_fn):
        if not (dropout and train and num_layers > 1):
            return orig(input, hidden, params, has_biases, num_layers, dropout, train,
                        bidirectional, batch_first, layer_fn)
        d = 2 if bidirectional else 1
        x = input.transpose(0, 1) if batch_first else input
        finals = []
        for i in range(num_layers):
            x, f = orig(x, hidden[d * i:d * (i + 1)], params[d * i:d * (i + 1)], has_biases,
                        1, 0.0, train, bidirectional, False, layer_fn)
            finals += f
            if i < num_layers - 1:
                x = torch.dropout(x, dropout, train=True)
        return (x.transpose(0, 1) if batch_first else x), finals
    return helper


def _kernel_layout(orig):
    def helper(input, *args, **kwargs):
        out = orig(input, *args, **kwargs)
        from torch._prims_common import suggest_memory_format
        fmt = suggest_memory_format(input)
        if out[0].is_contiguous(memory_format=fmt):
            return out
        return (out[0].contiguous(memory_format=fmt),) + tuple(out[1:])
    return helper


# loss backward ops whose ATen kernels return a contiguous input gradient
_CONTIGUOUS_GRADS = ("mse_loss_backward", "smooth_l1_loss_backward", "huber_loss_backward")


def _contiguous(orig):
    def kernel(*args, **kwargs):
        out = orig(*args, **kwargs)
        return out if out.is_contiguous() else out.contiguous()
    # fake tensors run a decomposition only if it is torch._decomp's own
    # (`fake_tensor.torch_decomp_decompositions`, which reads these two)
    kernel.__module__, kernel.__name__ = orig.__module__, orig.__name__
    return kernel


@contextlib.contextmanager
def _contiguous_grads():
    """Note [BatchNorm's output layout]: the loss backward ops' decompositions
    return contiguous gradients while a capture runs."""
    try:
        from torch._decomp import decomposition_table
        from torch._subclasses.fake_tensor import torch_decomp_decompositions
    except ImportError:
        yield
        return
    aten = torch.ops.aten
    ops = [getattr(aten, n).default for n in _CONTIGUOUS_GRADS if hasattr(aten, n)]
    origs = {op: decomposition_table[op] for op in ops if op in decomposition_table}
    for op, f in origs.items():
        decomposition_table[op] = _contiguous(f)
    torch_decomp_decompositions.cache_clear()
    try:
        yield
    finally:
        decomposition_table.update(origs)
        torch_decomp_decompositions.cache_clear()


@contextlib.contextmanager
def fixed_decompositions():
    """While active, the decompositions above trace what eager computes."""
    try:
        import torch._decomp.decompositions as dec
    except ImportError:                 # nothing to fix where the module is absent
        yield
        return
    fixes = {"_rnn_helper": _layerwise, "native_batch_norm_helper": _kernel_layout}
    origs = {k: getattr(dec, k) for k in fixes if getattr(dec, k, None) is not None}
    for k, fix in fixes.items():
        if k in origs:
            setattr(dec, k, fix(origs[k]))
    try:
        with _contiguous_grads():
            yield
    finally:
        for k, f in origs.items():
            setattr(dec, k, f)


def _autocast_off(gm):
    forward = gm.forward

    def replay(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for dev in ("cpu", "cuda"):
                if torch.is_autocast_enabled(dev):
                    stack.enter_context(torch.autocast(dev, enabled=False))
            return forward(*args, **kwargs)
    return replay


@contextlib.contextmanager
def replayed_as_recorded():
    """Note [the joint replayed under autocast]: while active, the joint graph
    that ``aot_export_module`` traces a second time runs with autocast off."""
    try:
        import torch._functorch.aot_autograd as aa
        orig = aa._aot_export_function
    except (ImportError, AttributeError):
        yield
        return
    patched = []

    def export(*args, **kwargs):
        out = orig(*args, **kwargs)
        # only the joint is replayed; without it the graph is the result itself
        if kwargs.get("trace_joint") and isinstance(out[0], torch.fx.GraphModule):
            out[0].forward = _autocast_off(out[0])
            patched.append(out[0])
        return out

    aa._aot_export_function = export
    try:
        yield
    finally:
        aa._aot_export_function = orig
        for gm in patched:      # the first graph is kept (checkpoint's Marks.first)
            del gm.forward
