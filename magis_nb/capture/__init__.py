"""PyTorch model -> ATen graph (see export.capture)."""
from .export import CaptureError, Captured, capture
from .outputs import find_loss, flatten, unflatten

__all__ = ["capture", "Captured", "CaptureError", "flatten", "unflatten", "find_loss"]
