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


@contextlib.contextmanager
def fixed_decompositions():
    """While active, the decompositions above trace what eager computes."""
    try:
        import torch._decomp.decompositions as dec
    except ImportError:                 # nothing to fix where the module is absent
        yield
        return
    orig = getattr(dec, "_rnn_helper", None)
    if orig is None:
        yield
        return
    dec._rnn_helper = _layerwise(orig)
    try:
        yield
    finally:
        dec._rnn_helper = orig
