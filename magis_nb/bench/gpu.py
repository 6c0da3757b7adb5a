"""gpu: the one-shot GPU check (built to finish within 8 minutes on one GPU).

1. the GPU-marked tests (``pytest -m gpu``);
2. simcheck on the device: every tiny zoo model in program order, simulated peak
   next to the measured one (the bytes asked of the caching allocator, and the
   blocks it handed out), and the step held against eager;
3. gpt (bf16), unet and vit (fp32, TF32 off so that allclose is meaningful) at
   the zoo's "gpu" size (a few GB of activations): eager against magis_nb at
   mem_budget 0.5 and 0.3 (one search at the tighter budget; 0.5 re-selected
   from its Pareto front): measured peak next to the simulated one, median step
   time (CUDA events), allclose (bf16 within bf16 tolerance);
4. every measured plan with swaps runs one more step with timed copies: the
   transfer time on the copy stream and how much of it compute waited for.

Writes ``gpu.json`` and ``gpu.md`` into ``--out``. ``--device cpu --size tiny``
runs the same pipeline on the CPU (no tests, no CUDA timings): a dry run.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from .. import zoo
from ..capture import eager_step
from ..program import trace
from ..runtime.measure import CudaOpPeaks, Measurement, measure_cpu, measure_cuda, model_baseline
from ..snapshot import ModelSnapshot
from ..timing import clear_grads, time_steps
from ..verify import Reference, compare_models
from .common import parser

MiB = 2**20
BUDGETS = (0.5, 0.3)
# fp32 on a GPU: different kernels for split shapes change the summation order.
TOL = {torch.float32: dict(rtol=1e-3, atol=1e-5, rel_atol=1e-4),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5, rel_atol=1.6e-2)}


class Device:
    """Peak and time of one step, the same way for eager and for plans."""

    def __init__(self, name: str):
        self.dev = torch.device(name)
        self.cuda = self.dev.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def peak(self, fn, own) -> Measurement:
        """One step's peak, counting of what was there before only the ``own``
        tensors (not a reference copy, not earlier results). On CUDA ``peak`` is in
        the bytes asked of the caching allocator, ``allocated`` in the blocks it
        handed out (`measure_cuda`)."""
        return measure_cuda(fn, own, self.dev) if self.cuda else measure_cpu(fn, own)

    def time(self, fn, reps: int = 7) -> float:
        """Median seconds of ``reps`` steps after one warm-up (CUDA events on GPU)."""
        return time_steps(fn, reps, warmup=1, cuda=self.cuda).step_s


def run_tests(root: Path) -> dict:
    t0 = time.perf_counter()
    if not (root / "tests").is_dir():
        return {"rc": None, "summary": f"no tests/ under {root}", "seconds": 0.0}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                        str(root / "tests")], cwd=root, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    return {"rc": p.returncode, "summary": lines[-1] if lines else p.stderr[-500:],
            "seconds": round(time.perf_counter() - t0, 1),
            "failures": [ln for ln in lines if ln.startswith("FAILED")][:10]}


def _failed(model: str, exc: BaseException) -> dict:
    """A row for a model whose check raised: the one-shot run goes on without it."""
    return {"model": model, "error": f"{type(exc).__name__}: {exc}"[:500], "allclose": False}


def simcheck(d: Device, names) -> list[dict]:
    rows = []
    for name in names:
        try:
            rows.append(_simcheck_one(d, name))
        except Exception as e:  # noqa: BLE001 -- recorded in the report
            rows.append(_failed(name, e))
        if d.cuda:
            torch.cuda.empty_cache()
    return rows


def _slack(model, inputs, loss_fn) -> tuple[dict[str, float], float]:
    """The safety net's extra atol per tensor (a multiple of eager's own error
    against a wider copy: Note [eager's own error]) and eager's largest own error."""
    ref = Reference(model, inputs, loss_fn, "train")
    spread, slack = ref.spread(), ref.slack()
    ref.restore()
    return slack, max(spread.values(), default=0.0)


def _simcheck_one(d: Device, name: str) -> dict:
    case = zoo.build(name, "tiny", device=d.dev)
    dt = case.dtype
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    slack, own_err = _slack(case.model, case.inputs, case.loss_fn)
    ref = copy.deepcopy(case.model)
    mod = prog.module()
    start = ModelSnapshot.of(case.model)
    torch.manual_seed(0)
    mod.step(*case.inputs)                  # warm-up: kernels, cuBLAS workspace
    start.restore()
    torch.manual_seed(0)
    m = d.peak(lambda: mod.step(*case.inputs), model_baseline(case.model, case.inputs))
    peak, got = m.peak, m.result
    torch.manual_seed(0)
    want = eager_step(ref, case.inputs, case.loss_fn)
    cmp = compare_models(ref, case.model, want, got, **TOL[dt], slack=slack)
    sim = prog.simulate().peak
    row = {"model": name, "sim_peak": sim, "measured_peak": peak, "allocated_peak": m.allocated,
           "rel_error": abs(peak - sim) / sim, "allclose": cmp.allclose,
           "max_abs_err": cmp.max_abs_err, "eager_own_err": own_err,
           "mismatches": cmp.mismatches[:3]}
    if d.cuda and row["rel_error"] > 0.01:
        # where the allocator's peak departs from the simulated one: per-op scratch
        start.restore()
        probe = CudaOpPeaks(d.dev)
        torch.manual_seed(0)
        with probe:
            mod.step(*case.inputs)
        row["probe"] = probe.summary()
    start.restore()
    return row


def _eager_time(d: Device, ref, inputs, loss_fn) -> float:
    """Eager's step time, on a copy of ``ref`` (timing steps move BatchNorm stats),
    freed on return."""
    timer = copy.deepcopy(ref)
    fresh = clear_grads(timer.parameters())

    def eager():
        fresh()
        return eager_step(timer, inputs, loss_fn)

    return d.time(eager)


def compare(d: Device, name: str, size: str, time_budget: float) -> list[dict]:
    """Eager, then magis_nb at each budget, on one model."""
    from ..search.optimize import optimize

    case = zoo.build(name, size, device=d.dev)
    model, inputs, loss_fn = case.model, case.inputs, case.loss_fn
    own = model_baseline(model, inputs)
    start = ModelSnapshot.of(model)
    slack, own_err = _slack(model, inputs, loss_fn)

    # Eager runs on a copy, which then holds the reference gradients and buffers.
    ref = copy.deepcopy(model)
    eager_step(ref, inputs, loss_fn)            # warm-up
    start.restore(into=ref)
    torch.manual_seed(0)
    m = d.peak(lambda: eager_step(ref, inputs, loss_fn), model_baseline(ref, inputs))
    e_peak, want = m.peak, m.result
    e_time = _eager_time(d, ref, inputs, loss_fn)
    rows = [{"model": name, "size": size, "dtype": str(case.dtype).removeprefix("torch."),
             "strategy": "eager", "budget": None, "peak": e_peak, "allocated": m.allocated,
             "reserved": m.reserved,
             "time": e_time, "peak_ratio": 1.0, "time_ratio": 1.0, "allclose": True}]
    t0 = time.perf_counter()
    res = optimize(model, inputs, loss_fn=loss_fn, mem_budget=min(BUDGETS), time_budget=time_budget)
    search_s = time.perf_counter() - t0
    fresh_model = clear_grads(model.parameters())
    for b in BUDGETS:
        plan = res.select(mem_budget=b)
        mod = res.module
        start.restore()
        torch.manual_seed(0)
        mod.step(*inputs)                       # warm-up (pinned buffers, kernels)
        start.restore()
        torch.manual_seed(0)
        m = d.peak(lambda: mod.step(*inputs), own)
        peak, got = m.peak, m.result
        cmp = compare_models(ref, model, want, got, **TOL[case.dtype], slack=slack)

        def step():
            fresh_model()
            return mod.step(*inputs)

        t = d.time(step)
        row = {"model": name, "size": size, "dtype": rows[0]["dtype"], "strategy": "magis_nb",
               "budget": b, "met": res.met, "peak": peak, "allocated": m.allocated, "reserved": m.reserved,
               "sim_peak": plan.peak, "sim_rel_error": abs(peak - plan.peak) / plan.peak,
               "time": t, "peak_ratio": peak / e_peak, "time_ratio": t / e_time,
               "sim_lat_ratio": plan.latency / res.before.latency,
               "allclose": cmp.allclose, "max_abs_err": cmp.max_abs_err, "eager_own_err": own_err,
               "mismatches": cmp.mismatches[:3], "swaps": len(plan.swaps),
               "remat": len(plan.remat), "fission": [f"{r.dim}/{r.n}" for r in plan.fission],
               "search_s": round(search_s, 1), "states": res.states}
        if plan.swaps and d.cuda:
            mod.timed_copies = True
            step()
            st = mod.transfer_stats()
            mod.timed_copies = False
            row.update(transfer_s=st.transfer_s, stall_s=st.stall_s, hidden=st.hidden,
                       copies=st.copies)
        rows.append(row)
        start.restore()
    return rows


def _mib(n) -> str:
    """MiB with two decimals; blank where there is no such count (the CPU has no
    caching allocator)."""
    return f"{n / MiB:.2f}" if n else ""


def _md(report: dict) -> str:
    out = [f"# bench gpu: {report['device_name']}", "",
           f"torch {report['torch']}, {report.get('seconds', 0):.0f} s in all.", ""]
    t = report.get("tests")
    if t:
        out += [f"GPU tests: `{t['summary']}` (rc {t['rc']}, {t['seconds']} s)", ""]
    if report.get("simcheck"):
        out += ["## simcheck (tiny zoo, program order)", "",
                "| model | simulated MiB | measured MiB | rel. error | allocator blocks MiB | allclose |",
                "|---|---|---|---|---|---|"]
        for r in report["simcheck"]:
            if "error" in r:
                out.append(f"| {r['model']} | failed: {r['error']} | | | False |")
                continue
            out.append(f"| {r['model']} | {r['sim_peak'] / MiB:.2f} | {r['measured_peak'] / MiB:.2f} "
                       f"| {r['rel_error']:.4f} | {_mib(r.get('allocated_peak'))} "
                       f"| {r['allclose']} |")
        out.append("")
    out += ["## eager vs magis_nb", "",
            "| model | dtype | strategy | budget | peak MiB | peak/eager | sim. peak MiB | "
            "sim. error | time ms | time/eager | allclose | swaps | transfer ms | hidden |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["compare"]:
        if "error" in r:
            out.append(f"| {r['model']} | | failed: {r['error']} |" + " |" * 11)
            continue
        sim = f"{r['sim_peak'] / MiB:.1f}" if "sim_peak" in r else ""
        err = f"{r['sim_rel_error']:.4f}" if "sim_rel_error" in r else ""
        tr = f"{r['transfer_s'] * 1e3:.2f}" if "transfer_s" in r else ""
        hid = f"{r['hidden']:.2f}" if "hidden" in r else ""
        out.append(f"| {r['model']} | {r['dtype']} | {r['strategy']} | {r['budget'] or ''} "
                   f"| {r['peak'] / MiB:.1f} | {r['peak_ratio']:.3f} | {sim} | {err} "
                   f"| {r['time'] * 1e3:.2f} | {r['time_ratio']:.3f} | {r['allclose']} "
                   f"| {r.get('swaps', '')} | {tr} | {hid} |")
    return "\n".join(out) + "\n"


def main(argv) -> int:
    p = parser("gpu", __doc__)
    p.add_argument("--out", required=True, help="folder for gpu.json and gpu.md")
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="gpu", help="zoo size of the eager-vs-plan models")
    p.add_argument("--models", default="gpt,unet,vit")
    p.add_argument("--simcheck", default=",".join(zoo.names("tiny")),
                   help="tiny models for the simcheck ('' to skip)")
    p.add_argument("--time-budget", type=float, default=20.0, help="search seconds per model")
    p.add_argument("--no-tests", action="store_true", help="skip the GPU-marked tests")
    a = p.parse_args(argv)
    d = Device(a.device)
    if d.cuda and not torch.cuda.is_available():
        print("bench gpu: CUDA is not available here (torch.cuda.is_available() is False); "
              "run it on a machine with a GPU, or pass --device cpu --size tiny for a dry run")
        return 2
    if d.cuda:
        # fp32 plans are held against eager at 1e-3: TF32 matmuls would not be
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    report = {"device": str(d.dev), "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name(d.dev) if d.cuda else "cpu",
              "tf32": False}
    root = Path(__file__).resolve().parents[2]
    report["simcheck"], report["compare"] = [], []

    def write():
        # after every phase: a run cut short still leaves what it measured
        report["seconds"] = time.perf_counter() - t0
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        with open(os.path.join(a.out, "gpu.md"), "w") as f:
            f.write(_md(report))

    if d.cuda and not a.no_tests:
        report["tests"] = run_tests(root)
        print("tests:", report["tests"]["summary"], flush=True)
        write()
    report["simcheck"] = simcheck(d, [n for n in a.simcheck.split(",") if n])
    for r in report["simcheck"]:
        print(f"simcheck {r['model']}: " + (r["error"] if "error" in r else
              f"rel err {r['rel_error']:.4f} allclose {r['allclose']}"), flush=True)
    write()
    for name in a.models.split(","):
        try:
            rows = compare(d, name, a.size, a.time_budget)
        except Exception as e:  # noqa: BLE001 -- recorded in the report
            rows = [_failed(name, e)]
        report["compare"] += rows
        for r in rows:
            print(f"{name}: {r['error']}" if "error" in r else
                  f"{name} {r['strategy']} {r['budget']}: peak {r['peak_ratio']:.3f} "
                  f"time {r['time_ratio']:.3f} allclose {r['allclose']}"
                  + (f" hidden {r['hidden']:.2f}" if "hidden" in r else ""), flush=True)
        if d.cuda:
            torch.cuda.empty_cache()
        write()
    print(_md(report))
    bad = [r for r in report["simcheck"] if not r["allclose"]] + \
          [r for r in report["compare"] if not r["allclose"]]
    return 1 if bad else 0
