"""The settings that turn a random draw of a forward off, named as the user sets them.

A refusal of a random step (Note [a branch on a random draw] in specialize.py,
Note [a draw the trace cannot see] in host_random.py) says what to set:
``model.model.encoder.layerdrop = 0.0 (now 0.5)`` for a module attribute,
``model.config.mask_time_prob = 0.0 (now 0.05)`` for an HF config entry. The
config entries are the ones the code around the draw reads: the first function
outward from it (the draw's own, then its callers) whose source reads
``config.NAME`` (or ``getattr(config, "NAME")``) of a config its module holds,
where NAME looks like a switch of randomness and is on: a probability above 0,
or a flag that is True.
"""
from __future__ import annotations

import inspect
import os
import re
import sys

import torch

TORCH_DIR = os.path.dirname(torch.__file__)
PKG_DIR = os.path.dirname(os.path.dirname(__file__))

# names of settings that switch randomness: a probability (layerdrop,
# mask_time_prob), a flag (apply_spec_augment). Others a forward reads near a
# draw (layer_norm_eps, a length) are not switches of it.
_RANDOMISH = re.compile(r"prob|drop|augment|noise|jitter|random", re.I)
_READS = re.compile(r"config\.(\w+)|getattr\(\s*[\w.]*config\s*,\s*[\"'](\w+)[\"']")


def outside(filename: str) -> bool:
    """Whether a frame's file is neither torch's nor magis_nb's: the user's code
    or the library the user's model comes from."""
    f = os.path.abspath(filename)
    return not (f.startswith(TORCH_DIR) or f.startswith(PKG_DIR))


def user_frames(frame=None) -> list[tuple]:
    """(code, self) of each frame outside torch and magis_nb, innermost first,
    from ``frame`` (default: the caller's) outward."""
    frame = frame or sys._getframe(1)
    out = []
    while frame is not None:
        if outside(frame.f_code.co_filename):
            out.append((frame.f_code, frame.f_locals.get("self")))
        frame = frame.f_back
    return out


def module_switches(model: torch.nn.Module) -> list[str]:
    """Module attributes that turn a random branch off (HF's ``layerdrop``, which
    each encoder and decoder copies from its config when it is built), set above 0."""
    out = []
    for name, mod in model.named_modules():
        for k, v in vars(mod).items():
            if "layerdrop" in k.lower() and isinstance(v, (int, float)) \
                    and not isinstance(v, bool) and v > 0:
                out.append(f"model.{name + '.' if name else ''}{k} = 0.0 (now {v})")
    return out


def _on(v) -> str | None:
    """What turns a setting off, or None where it is off or no switch."""
    if isinstance(v, bool):
        return "False" if v else None
    if isinstance(v, float) and 0 < v <= 1:
        return "0.0"
    return None


def config_switches(model: torch.nn.Module, frames: list[tuple]) -> list[str]:
    """'model.config.NAME = OFF (now V)' for the switches the first function of
    ``frames`` (`user_frames`) that reads any reads."""
    where = {id(m): n for n, m in model.named_modules()}
    for code, owner in frames:
        config = getattr(owner, "config", None)
        if config is None or id(owner) not in where:
            continue
        try:
            source = inspect.getsource(code)
        except (OSError, TypeError):
            continue
        names = dict.fromkeys(a or b for a, b in _READS.findall(source))
        path = ("model.config" if config is getattr(model, "config", None) else
                f"model.{where[id(owner)] + '.' if where[id(owner)] else ''}config")
        found = [f"{path}.{n} = {_on(getattr(config, n))} (now {getattr(config, n)!r})"
                 for n in names if _RANDOMISH.search(n) and _on(getattr(config, n, None))]
        if found:
            return found
    return []
