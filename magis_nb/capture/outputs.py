"""Flatten model outputs (tensors in tuples, lists, dicts, dataclasses) and back.

aot_export_module wants a flat tuple of tensors; users return dicts (HF style),
dataclasses (ModelOutput) or tuples. We keep a small spec to rebuild the original
structure around the optimized module's outputs.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch


def flatten(obj: Any) -> tuple[list[torch.Tensor], Any]:
    leaves: list[torch.Tensor] = []

    def go(o):
        if isinstance(o, torch.Tensor):
            leaves.append(o)
            return ("T", len(leaves) - 1)
        if isinstance(o, (tuple, list)):
            return ("seq", type(o), [go(x) for x in o])
        if isinstance(o, dict):
            return ("dict", type(o), [(k, go(v)) for k, v in o.items()])
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            fields = [(f.name, go(getattr(o, f.name))) for f in dataclasses.fields(o)
                      if f.init]
            return ("dc", type(o), fields)
        return ("const", o)

    spec = go(obj)
    return leaves, spec


def unflatten(leaves: list, spec: Any) -> Any:
    kind = spec[0]
    if kind == "T":
        return leaves[spec[1]]
    if kind == "const":
        return spec[1]
    if kind == "seq":
        items = [unflatten(leaves, s) for s in spec[2]]
        typ = spec[1]
        if typ in (tuple, list):
            return typ(items)
        if hasattr(typ, "_fields"):  # namedtuple
            return typ(*items)
        return typ(items)
    if kind == "dict":
        d = {k: unflatten(leaves, s) for k, s in spec[2]}
        return d if spec[1] is dict else spec[1](d)
    if kind == "dc":
        return spec[1](**{k: unflatten(leaves, s) for k, s in spec[2]})
    raise ValueError(f"bad output spec {kind!r}")


def find_loss(out: Any) -> torch.Tensor:
    """The model's own loss: a scalar tensor, out['loss'], out.loss or out[0]."""
    cand = None
    if isinstance(out, torch.Tensor):
        cand = out
    elif isinstance(out, dict) and "loss" in out:
        cand = out["loss"]
    elif getattr(out, "loss", None) is not None:
        cand = out.loss
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        cand = out[0]
    if cand is None:
        raise TypeError(
            f"the model returned {type(out).__name__} with no loss in it; pass "
            "loss_fn=... (called as loss_fn(output, target) with the last input as "
            "target) or return the loss as a scalar tensor, out['loss'] or out.loss")
    return cand
