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
    """The model's own loss (`locate_loss`)."""
    return locate_loss(out)[0]


def _scalars(o: Any, path: str, found: list) -> None:
    """(path, tensor) of every 0-dim floating tensor in an output, in order."""
    if isinstance(o, torch.Tensor):
        if o.dim() == 0 and o.is_floating_point():
            found.append((path, o))
    elif isinstance(o, (tuple, list)):
        for i, x in enumerate(o):
            _scalars(x, f"{path}[{i}]", found)
    elif isinstance(o, dict):
        for k, v in o.items():
            _scalars(v, f"{path}[{k!r}]", found)
    elif dataclasses.is_dataclass(o) and not isinstance(o, type):
        for f in dataclasses.fields(o):
            _scalars(getattr(o, f.name), f"{path}.{f.name}", found)


def _tensors(o: Any, path: str = "out") -> list[str]:
    """'path (shape)' of the tensors in an output, for a message."""
    if isinstance(o, torch.Tensor):
        return [f"{path} {tuple(o.shape)}"]
    if isinstance(o, (tuple, list)):
        return [t for i, x in enumerate(o) for t in _tensors(x, f"{path}[{i}]")]
    if isinstance(o, dict):
        return [t for k, v in o.items() for t in _tensors(v, f"{path}[{k!r}]")]
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return [t for f in dataclasses.fields(o) for t in _tensors(getattr(o, f.name), f"{path}.{f.name}")]
    return []


def locate_loss(out: Any) -> tuple[torch.Tensor, str | None]:
    """The model's own loss and where it was in the output (None: the output is it).

    A tensor; ``out["loss"]`` or ``out.loss`` (HF's outputs); a tuple or list whose
    first element is a scalar (HF's ``return_dict=False`` puts the loss first);
    else the one scalar (0-dim floating) tensor anywhere in the output, the one
    that requires grad where several are scalars: nanoGPT's ``(logits, loss)``.
    Several candidates or none: a TypeError naming what the output holds."""
    if isinstance(out, torch.Tensor):
        return out, None
    if isinstance(out, dict) and out.get("loss") is not None:
        return out["loss"], "out['loss']"
    if not isinstance(out, dict) and getattr(out, "loss", None) is not None:
        return out.loss, "out.loss"
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) \
            and out[0].dim() == 0 and out[0].is_floating_point():
        return out[0], "out[0]"
    found: list = []
    _scalars(out, "out", found)
    trained = [(p, t) for p, t in found if t.requires_grad]
    if len(trained) == 1 or (len(found) == 1 and not trained):
        path, t = (trained or found)[0]
        return t, path
    kind = type(out).__name__
    if len(found) > 1:
        names = ", ".join(p for p, _ in (trained or found))
        raise TypeError(
            f"the model returned a {kind} with several scalar tensors ({names}): which "
            "one is the loss is ambiguous; return the loss alone, or as out['loss'] "
            "or out.loss, or pass loss_fn=... (called as loss_fn(output, target) with "
            "the last input as target)")
    held = ", ".join(_tensors(out)[:4]) or "no tensors"
    raise TypeError(
        f"the model returned a {kind} with no scalar loss in it ({held}); return the "
        "loss as a scalar tensor (reduce it, e.g. .mean()), out['loss'] or out.loss, "
        "or pass loss_fn=... (called as loss_fn(output, target) with the last input "
        "as target)")
