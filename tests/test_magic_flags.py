"""%%magis flag parsing and model/input/loss discovery (no search runs here)."""
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from IPython.core.error import UsageError

from magis_nb.notebook.discover import assigned_names, discover
from magis_nb.notebook.flags import MagisFlags, check_profile, parse_mem, parse_names


@pytest.mark.parametrize("text,want", [
    ("0.5", 0.5), ("50%", 0.5), ("16", 16.0), ("2GB", 2 * 10**9), ("800MB", 800 * 10**6),
    ("1.5GiB", int(1.5 * 2**30)), ("64 MiB", 64 * 2**20), ("123456789", 123456789),
    ("2gb", 2 * 10**9), ("1e9", 10**9),
])
def test_parse_mem(text, want):
    got = parse_mem(text)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("text", ["abc", "0", "-1", "1.5x", "10 bytes", "20.5", "8B", ""])
def test_parse_mem_rejects(text):
    with pytest.raises(UsageError, match="--mem"):
        parse_mem(text)


def test_names_and_profile():
    assert parse_names("--inputs", "x, y") == ["x", "y"]
    with pytest.raises(UsageError, match="not a Python variable"):
        parse_names("--inputs", "x,1y")
    with pytest.raises(UsageError, match="expected comma-separated"):
        parse_names("--inputs", ",")
    assert check_profile("rtx3090") == "rtx3090"
    assert check_profile("roofline:h100") == "roofline:h100"
    assert check_profile("measured") == "measured"
    with pytest.raises(UsageError, match="unknown device profile.*rtx3090"):
        check_profile("gtx480")


def test_assigned_names_order():
    src = ("import torch as T, os.path\nx = 1\na, (b, *c) = 1, (2, 3)\nx = 2\n"
           "def f(): pass\nclass K: pass\nfor i in range(2):\n    y = i\n"
           "with open('f') as fh:\n    z: int = 3\nif (w := 4):\n    q += 1\n")
    assert assigned_names(src) == ["T", "os", "a", "b", "c", "x", "f", "K", "i", "y", "fh",
                                   "z", "w", "q"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x))


class SelfLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 3)

    def forward(self, idx, targets=None):
        out = self.l(idx)
        return out if targets is None else nn.functional.cross_entropy(out, targets)


def _find(ns, src, **kw):
    return discover(ns, src, MagisFlags(**kw))


def test_discover_model_inputs_loss():
    block = nn.Linear(4, 4)
    model = nn.Sequential(block, nn.ReLU())
    ns = {"block": block, "model": model, "crit": nn.MSELoss(), "x": torch.randn(2, 4),
          "y": torch.randn(2, 4), "n": 3}
    f = _find(ns, "block = ...\nmodel = ...\ncrit = ...\nx = ...\ny = ...\nn = 3")
    # the block lives inside the model: one candidate; the MSELoss is the loss
    assert (f.model_name, f.loss_name, f.input_names) == ("model", "crit", ["x", "y"])
    assert f.inputs[0] is ns["x"] and f.loss_fn is ns["crit"]


def test_discover_by_forward_names_and_target():
    ns = {"m": SelfLoss(), "data": torch.randn(2, 5), "idx": torch.randn(2, 4),
          "targets": torch.tensor([0, 1])}
    f = _find(ns, "m = 1\ndata = 1\nidx = 1\ntargets = 1")
    assert f.input_names == ["idx", "targets"] and f.loss_fn is None
    # forward(x) matched by name; with a loss, the target is the tensor named like one
    ns2 = {"m": Net(), "x": torch.randn(2, 4), "labels": torch.ones(2), "extra": torch.ones(1),
           "loss_fn": lambda o, t: o.sum()}
    f = _find(ns2, "m = 1\nx = 1\nlabels = 1\nextra = 1\ndef loss_fn(o, t): pass")
    assert f.input_names == ["x", "labels"] and f.loss_name == "loss_fn"


def test_discover_from_earlier_cell_and_flags():
    ns = {"net": Net(), "x": torch.randn(2, 4), "batch": (torch.randn(2, 4),)}
    f = _find(ns, "x = torch.randn(2, 4)")            # the model came from an earlier cell
    assert f.model_name == "net" and f.input_names == ["x"]
    f = _find(ns, "", model="net", inputs=["batch"], mode="infer")
    assert f.inputs == ns["batch"]


@pytest.mark.parametrize("ns,src,flags,msg", [
    ({"x": torch.ones(1)}, "x = 1", {}, "found no model"),
    ({"a": Net(), "b": Net(), "x": torch.ones(1, 4)}, "a = 1\nb = 1\nx = 1", {},
     r"several candidate models \(a, b\).*--model"),
    ({"a": Net()}, "a = 1", {}, "no example input tensors"),
    ({"a": Net(), "p": torch.ones(1), "q": torch.ones(1), "r": torch.ones(1)},
     "a = 1\np = 1\nq = 1\nr = 1", {"mode": "infer"}, r"found tensors p, q, r but a takes 1"),
    ({"a": Net(), "x": torch.ones(1)}, "", {"model": "nope"}, "no variable named 'nope'"),
    ({"a": 3, "x": torch.ones(1)}, "", {"model": "a"}, "not a torch.nn.Module"),
    ({"a": Net(), "x": torch.ones(1)}, "", {"loss": "x"}, "not callable"),
    ({"a": Net(), "x": torch.ones(1)}, "", {"loss": "x", "mode": "infer"}, "--mode infer"),
    ({"a": Net(), "x": torch.ones(1), "l1": nn.L1Loss(), "criterion": nn.MSELoss()},
     "a = 1\nx = 1\nl1 = 1\ncriterion = 1", {}, "several loss functions"),
])
def test_discover_errors(ns, src, flags, msg):
    with pytest.raises(UsageError, match=msg):
        _find(ns, src, **flags)


def test_import_stays_cheap():
    code = ("import sys, magis_nb; heavy = [m for m in ('IPython', 'matplotlib', 'ipywidgets', "
            "'torch') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_swap_flags():
    from IPython.core.error import UsageError
    from IPython.core.magic_arguments import parse_argstring

    from magis_nb.notebook.flags import from_args
    from magis_nb.notebook.magic import MagisMagics

    def flags(line):
        return from_args(parse_argstring(MagisMagics.magis, line))
    assert flags("").swap is None
    assert flags("--no-swap").swap is False
    assert flags("--swap --profile rtx3090").swap is True
    with pytest.raises(UsageError, match="--swap or --no-swap"):
        flags("--swap --no-swap")


def test_ddp_flag_needs_torch_distributed():
    import os

    import torch.distributed as dist
    from IPython.core.error import UsageError
    from IPython.core.magic_arguments import parse_argstring

    from magis_nb.notebook.flags import from_args
    from magis_nb.notebook.magic import MagisMagics

    def flags(line):
        return from_args(parse_argstring(MagisMagics.magis, line))
    assert flags("").ddp is False
    with pytest.raises(UsageError, match="init_process_group first"):
        flags("--ddp")
    from magis_nb.bench.ddp import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        assert flags("--ddp --mem 0.5").ddp is True
        with pytest.raises(UsageError, match="training step"):
            flags("--ddp --mode infer")
    finally:
        dist.destroy_process_group()
