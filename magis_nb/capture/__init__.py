"""PyTorch model -> ATen graph (see export.capture)."""
from .export import CaptureError, Captured, capture, eager_step
from .outputs import find_loss, flatten, unflatten

__all__ = ["capture", "eager_step", "Captured", "CaptureError", "flatten", "unflatten", "find_loss"]
