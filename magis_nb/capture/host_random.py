"""Random draws a forward makes outside torch (numpy, Python's ``random``).

Note [a draw the trace cannot see]
Wav2Vec2's SpecAugment (``mask_time_prob`` > 0, on by default in training)
draws its masks with ``np.random`` in ``_compute_mask_indices`` and makes them a
tensor. The trace runs that Python, so the captured step holds the mask it drew
as a constant and applies it at every step, where eager draws a new one: with
the feature mask on (``mask_feature_prob`` > 0) the plan captured without a
word and its loss differed from eager's at every step (1013.6 against 1020.9);
with the time mask, the trace failed in the backward with no line to name
("aten.nonzero"). Torch's own random ops are ops of the step and are drawn anew
at every run; a numpy or ``random`` draw is Python that no program can repeat.
So while a capture runs, the module-level functions of ``numpy.random`` and
``random`` (those of their global generators) record each call made from code
outside torch and magis_nb on the capturing thread, and the capture is refused
naming the line and the config switch that turns the draw off
(`switches.config_switches`). Both generators are put back as they were: the
trace (and the eager pass of Note [specialized scalars]) must not move the
user's random streams. A draw through a generator object of the user's own
(``np.random.default_rng()``) is not seen.
"""
from __future__ import annotations

import contextlib
import functools
import linecache
import os
import random
import sys
import threading
from dataclasses import dataclass, field

import torch

from .switches import config_switches, outside, user_frames

# a global generator's functions that do not draw
_NOT_DRAWS = {"seed", "get_state", "set_state", "getstate", "setstate",
              "get_bit_generator", "set_bit_generator"}


@dataclass
class Draws:
    """The draws made while `watched` was active: 'file:line (code)' and the
    function of each, and `user_frames` of the first."""
    where: list[tuple[str, str]] = field(default_factory=list)
    path: str | None = None            # the first draw's full 'path:line: code'
    frames: list[tuple] = field(default_factory=list)


def _drawing(module, instance) -> dict[str, object]:
    """name -> function of ``module``'s attributes that are methods of its global
    generator ``instance`` and draw."""
    return {k: v for k, v in vars(module).items()
            if getattr(v, "__self__", None) is instance and k not in _NOT_DRAWS
            and not k.startswith("_")}


def _recording(fn, name: str, draws: Draws, thread: int):
    @functools.wraps(fn)
    def draw(*args, **kwargs):
        caller = sys._getframe(1)
        if threading.get_ident() == thread and outside(caller.f_code.co_filename):
            file, line = caller.f_code.co_filename, caller.f_lineno
            code = linecache.getline(file, line).strip()
            draws.where.append((f"{os.path.basename(file)}:{line} ({code})", name))
            if draws.path is None:
                draws.path = f"{file}:{line}: {code}"
                draws.frames = user_frames(caller)
        return fn(*args, **kwargs)
    return draw


@contextlib.contextmanager
def watched():
    """While active, numpy's and Python's global random functions record the
    draws the traced code makes (Note [a draw the trace cannot see])."""
    draws = Draws()
    thread = threading.get_ident()
    targets = [(random, random._inst, "random")]
    try:
        import numpy as np
        targets.append((np.random, np.random.mtrand._rand, "numpy.random"))
    except (ImportError, AttributeError):
        np = None
    states = [random.getstate()] + ([np.random.get_state()] if np is not None else [])
    patched = []
    try:
        for module, inst, label in targets:
            for k, fn in _drawing(module, inst).items():
                setattr(module, k, _recording(fn, f"{label}.{k}", draws, thread))
                patched.append((module, k, fn))
        yield draws
    finally:
        for module, k, fn in patched:
            setattr(module, k, fn)
        random.setstate(states[0])
        if np is not None:
            np.random.set_state(states[1])


def refusal(model: torch.nn.Module, draws: Draws) -> str | None:
    """The message refusing a capture that drew outside torch, None if it did not."""
    if not draws.where:
        return None
    where, fn = draws.where[0]
    others = list(dict.fromkeys(w for w, _ in draws.where[1:] if w != where))
    more = f" (and {len(others)} more: {', '.join(others[:3])})" if others else ""
    switch = config_switches(model, draws.frames)
    how = (f"set {' or '.join(switch)} before optimizing" if switch else
           "turn that draw off for training, or draw with torch in fixed shapes "
           "(torch.rand(...) < p: the plan draws those anew at every step)")
    return (f"forward() draws a random number outside torch: {where} calls {fn}{more}. "
            "The trace runs that Python once, so a captured step would hold this draw "
            "as a constant and repeat it at every step, where eager draws anew; "
            f"{how} (Note [a draw the trace cannot see])")
