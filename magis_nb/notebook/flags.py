"""Flag values of ``%%magis`` and ``%magis_budget``: parsed and checked up front.

Every check raises `UsageError` before anything runs, so a typo in a flag never
costs a search (or leaves half a result in the namespace).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from IPython.core.error import UsageError

# Decimal units as disks and cloud GPUs are sold ("2GB" = 2e9 bytes); binary units
# as PyTorch's memory_summary prints them ("2GiB" = 2 * 2**30).
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(%|[kmgt]?i?b)?\s*$", re.I)
MODES = ("train", "infer")


@dataclass
class MagisFlags:
    """What ``%%magis`` was asked to do, after validation."""
    model: str | None = None
    inputs: list[str] | None = None
    loss: str | None = None
    mode: str = "train"
    mem: float | int | None = None     # ratio (<= 16) or bytes, as optimize() takes it
    lat: float | None = None           # ratio of the unoptimized latency
    time: float = 60.0
    states: int | None = None          # bound on the states searched (optimize's max_states)
    profile: str | None = None
    out: str | None = None
    quiet: bool = False
    plot: bool = True
    algebra: bool = True
    measured: bool = False             # plans must be timed here (an error where they cannot)
    simulated: bool = False            # no plan is timed: the choice on simulated latency
    swap: bool | None = None           # None: optimize's default (swaps only for a GPU)
    ddp: bool = False                  # data parallel on torch.distributed's default group
    strict: bool = False               # a missed budget raises (and binds nothing)

    @property
    def measure_time(self) -> bool | None:
        """optimize()'s ``measure_time``: True (--measured), False (--simulated), or
        None (wherever the step runs here)."""
        return True if self.measured else False if self.simulated else None


def parse_mem(text: str | None) -> float | int | None:
    """'0.5' -> 0.5 (ratio), '50%' -> 0.5, '2GB' -> 2_000_000_000, '1.5GiB' -> bytes."""
    if text is None:
        return None
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"--mem {text!r}: expected a ratio of the unoptimized peak "
                         "(0.5, 50%) or a size (800MB, 2GB, 1.5GiB)")
    value, unit = float(m.group(1)), (m.group(2) or "").lower()
    if value <= 0:
        raise UsageError(f"--mem {text!r}: the budget must be positive")
    if unit == "%":
        return value / 100
    if unit == "":
        # optimize() reads values <= 16 as ratios, larger ones as bytes
        if value > 16 and value != int(value):
            raise UsageError(f"--mem {text!r}: a plain number above 16 is a byte count "
                             "and must be whole; add a unit (MB, GiB) or give a ratio")
        return value if value <= 16 else int(value)
    nbytes = int(value * _UNITS[unit])
    if nbytes <= 16:
        raise UsageError(f"--mem {text!r}: {nbytes} bytes is no budget; did you mean a ratio?")
    return nbytes


def parse_ratio(flag: str, text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected a number such as 1.1") from None
    if value <= 0:
        raise UsageError(f"{flag} {text!r}: must be positive")
    return value


def parse_names(flag: str, text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError(f"{flag} {text!r}: expected comma-separated variable names")
    for n in names:
        check_identifier(flag, n)
    return names


def check_identifier(flag: str, name: str | None) -> str | None:
    if name is not None and not name.isidentifier():
        raise UsageError(f"{flag} {name!r} is not a Python variable name")
    return name


def check_profile(text: str | None) -> str | None:
    """None (measure this machine), a profile name, 'measured[:dev]' or 'roofline:NAME'."""
    if text is None:
        return None
    from ..simulate.profiles import profile_names
    known = profile_names()
    kind, _, arg = text.partition(":")
    if text in known or kind == "measured" or (kind == "roofline" and arg in known):
        return text
    raise UsageError(f"--profile {text!r}: unknown device profile; choose one of "
                     f"{', '.join(known)} (or 'measured' for this machine)")


def from_args(args) -> MagisFlags:
    """Validate the argparse namespace of ``%%magis`` into `MagisFlags`."""
    if args.mode not in MODES:
        raise UsageError(f"--mode {args.mode!r}: expected train or infer")
    time = parse_ratio("--time", args.time)
    states = None
    if args.states is not None:
        try:
            states = int(args.states)
        except ValueError:
            states = 0
        if states < 1:
            raise UsageError(f"--states {args.states!r}: give a whole number of states, at least 1")
    if args.mem is not None and args.lat is not None:
        raise UsageError("give --mem or --lat, not both: a memory budget picks the fastest "
                         "plan under it, a latency budget the lowest peak within it")
    profile = check_profile(args.profile)
    if args.swap and args.no_swap:
        raise UsageError("give --swap or --no-swap, not both")
    if args.ddp:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError("--ddp plans data parallel on torch.distributed's default group: "
                             "call torch.distributed.init_process_group first, on every rank "
                             "(each rank runs this cell with its shard of the batch)")
        if args.mode != "train" or args.measured:
            raise UsageError("--ddp plans a training step (not --mode infer) and its budget "
                             "is the plan's own (not --measured)")
    if args.measured and args.simulated:
        raise UsageError("give --measured or --simulated, not both")
    if args.measured and profile is not None and not profile.startswith("measured"):
        raise UsageError(f"--measured times plans on this machine: leave out --profile "
                         f"{profile} (a roofline plans for another device)")
    return MagisFlags(
        model=check_identifier("--model", args.model),
        inputs=parse_names("--inputs", args.inputs),
        loss=check_identifier("--loss", args.loss),
        mode=args.mode,
        mem=parse_mem(args.mem),
        lat=parse_ratio("--lat", args.lat),
        time=60.0 if time is None else time,
        states=states,
        profile=profile,
        out=check_identifier("-o", args.out),
        quiet=args.quiet,
        plot=not args.no_plot,
        algebra=not args.no_algebra,
        measured=args.measured,
        simulated=args.simulated,
        swap=True if args.swap else False if args.no_swap else None,
        ddp=args.ddp,
        strict=args.strict,
    )
