"""PyTorch model -> ATen graph (see export.capture)."""
from .batch import CallSpec, split_call
from .export import CaptureError, Captured, LossModule, call_step, capture, eager_step, uncompiled
from .outputs import find_loss, flatten, unflatten

__all__ = ["capture", "eager_step", "call_step", "LossModule", "CallSpec", "split_call", "Captured", "CaptureError", "flatten", "unflatten", "find_loss", "uncompiled"]
