"""Model zoo: the paper's Table 2 workloads (paper configs) and small CPU stand-ins.

Every model is defined here from scratch with random init: no downloads. A "tiny"
config keeps its workload's character (activation memory dominates weight memory)
but runs one eager training step in well under a second on a laptop CPU. A "paper"
config has the real architecture and batch size and is meant to be built on the
meta device, where capture sees its shapes without allocating anything.

Calling convention (see `ZooCase`): with a `loss_fn`, the step is
``loss_fn(model(*inputs[:-1]), inputs[-1])``; without one, ``model(*inputs)``
returns its own loss (a dict with "loss" or an object with `.loss`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

__all__ = ["ZooCase", "names", "build"]


@dataclass
class ZooCase:
    name: str
    size: str  # "tiny" | "paper" | "bench" | "gpu"
    model: nn.Module
    inputs: tuple  # model inputs, then the target when loss_fn is not None
    loss_fn: Callable | None  # loss_fn(output, target) -> scalar; None: model returns its loss
    dtype: torch.dtype
    description: str


# name -> (module in this package, sizes it offers). Order is the listing order.
_REGISTRY: dict[str, tuple[str, tuple[str, ...]]] = {
    "mlp": ("mlp", ("tiny",)),
    "resnet": ("resnet", ("tiny", "paper")),
    "bert": ("bert", ("tiny", "paper", "bench")),
    "vit": ("vit", ("tiny", "paper", "bench", "gpu")),
    "gpt": ("gpt", ("tiny", "paper", "bench", "gpu")),
    "btlm": ("gpt", ("tiny", "paper")),  # same code path as gpt, other options
    "llama": ("llama", ("tiny",)),       # RoPE, RMSNorm, GQA, SwiGLU, causal SDPA
    "unet": ("unet", ("tiny", "paper", "bench", "gpu")),
    "unetpp": ("unetpp", ("tiny", "paper")),
    # the same without BatchNorm, as the MAGIS authors' benchmark defines them
    "unet-nobn": ("unet", ("tiny", "paper")),
    "unetpp-nobn": ("unetpp", ("tiny", "paper")),
    # U-Net++ as the authors' benchmark graph builds it (one conv per node, interpolation)
    "unetpp-magis": ("unetpp", ("tiny", "paper")),
    "densenet": ("densenet", ("tiny",)),
    "randwire": ("randwire", ("tiny",)),
}

# "bench": the tiny architecture (twice as wide) at the batch where one eager step
# takes about 0.45 s on an idle 2-core CPU (the side-by-side benchmark,
# `python -m magis_nb.bench peers`).
# "gpu": a few GB of activations, for the one-shot GPU check (`python -m magis_nb.bench gpu`).
SIZES = ("tiny", "paper", "bench", "gpu")


def names(size: str = "tiny") -> list[str]:
    """Zoo model names that offer `size`, in a fixed order."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    return [n for n, (_, sizes) in _REGISTRY.items() if size in sizes]


def build(name: str, size: str = "tiny", *, device="cpu", seed: int = 0) -> ZooCase:
    """Build zoo model `name` at `size` on `device`, deterministically from `seed`.

    Parameters and example inputs are created directly on `device` (on "meta" nothing
    is allocated). The caller's global RNG state is left as it was.
    """
    if name not in _REGISTRY:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(_REGISTRY)}")
    module_name, sizes = _REGISTRY[name]
    if size not in sizes:
        raise ValueError(f"zoo model {name!r} has no {size!r} config (has: {', '.join(sizes)})")
    family = importlib.import_module(f"{__name__}.{module_name}")
    device = torch.device(device)
    # nn.Module init and the example inputs draw from the global generator of the
    # device they are made on; fork it so building never disturbs the caller's RNG.
    cuda = device.type == "cuda"
    fork = [device.index if device.index is not None else torch.cuda.current_device()] if cuda else []
    with torch.random.fork_rng(devices=fork):
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(fork[0]):
                torch.cuda.manual_seed(seed)
        with torch.device(device):
            case = family.case(name, size, seed)
    return case
