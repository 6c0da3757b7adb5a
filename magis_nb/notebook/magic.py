"""``%%magis`` and ``%magis_budget``: the notebook layer over `magis_nb.optimize`."""
from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import flags as F
from .cellexec import run_cell_body
from .discover import discover
from .session import Session, infeasible_message, measured_infeasible_message


@magics_class
class MagisMagics(Magics):
    def __init__(self, shell):
        super().__init__(shell)
        self.sessions: dict[str, Session] = {}   # by module variable name
        self.last: Session | None = None
        self.sliders: dict = {}   # by module name: a re-run replaces (and frees) the old one

    @magic_arguments()
    @argument("--model", metavar="NAME", help="the nn.Module to optimize (default: the one "
              "the cell defined)")
    @argument("--inputs", metavar="A,B", help="example inputs in call order, the loss target "
              "last (default: the tensors the cell defined)")
    @argument("--loss", metavar="NAME", help="loss_fn(output, target) (default: a loss the "
              "cell defined, else the model returns its own loss)")
    @argument("--mode", default="train", metavar="train|infer",
              help="optimize a training step (forward+backward) or inference (default: train)")
    @argument("--mem", metavar="BUDGET", help="memory budget: a ratio of the unoptimized peak "
              "(0.5, 50%%) or a size (800MB, 2GB = 2e9 bytes, 1.5GiB)")
    @argument("--lat", metavar="RATIO", help="latency budget as a ratio of the unoptimized "
              "step (1.1); with no budget: lowest peak within 10%% latency")
    @argument("--time", metavar="SECONDS", help="search time budget (default: 60)")
    @argument("--states", metavar="N", help="bound the search by the states it explores "
              "(the outcome then does not depend on how loaded the machine is; --time "
              "still caps it)")
    @argument("--profile", metavar="NAME", help="cost model: rtx3090, a100, h100, h200, cpu "
              "(roofline) or measured (default: measured on this machine)")
    @argument("-o", dest="out", metavar="NAME", help="variable for the optimized module "
              "(default: <model>_opt); the result goes to NAME_result")
    @argument("-q", dest="quiet", action="store_true", help="quiet: no progress, report or plots")
    @argument("--no-plot", dest="no_plot", action="store_true",
              help="no figures (report and slider still shown)")
    @argument("--no-algebra", dest="no_algebra", action="store_true",
              help="no algebraic rewrites (merged matmuls, moved scales): the plan's "
              "ops stay those of the model")
    @argument("--no-swap", dest="no_swap", action="store_true",
              help="no swapping to host memory (the default on a CPU without a GPU --profile: "
              "host and device memory are the same RAM there)")
    @argument("--swap", action="store_true",
              help="allow swapping to host memory (the default on a GPU or with a GPU --profile)")
    @argument("--ddp", action="store_true",
              help="data parallel: every rank runs the cell with its shard; gradient buckets "
              "are all_reduced from inside the plan (torch.distributed initialized first)")
    @argument("--measured", action="store_true",
              help="require plans timed against eager PyTorch here (the default wherever "
              "the step runs on this machine): an error where they cannot be, as with a "
              "GPU --profile")
    @argument("--strict", action="store_true",
              help="a budget the search misses is an error and nothing is bound (by "
              "default the best plan found is bound and the report says NOT met)")
    @argument("--simulated", action="store_true",
              help="choose on simulated latency alone: no plan is timed (faster; the "
              "latency shown is the cost model's)")
    @cell_magic
    def magis(self, line, cell):
        """Run the cell, then optimize the model it defined for memory (MAGIS).

        The cell runs once in the notebook's namespace (like %%time). The model and
        its example inputs are found among what the cell defined; the optimized
        module is bound to <model>_opt and the OptimizeResult to <model>_opt_result.
        If anything after the cell fails (no model, capture), a UsageError says why
        and no name is bound beyond what the cell itself did. A budget the search
        misses binds the best plan found and says NOT met (--strict: a UsageError).

            %%magis --mem 0.5 --time 20
            model = GPT(cfg)
            x = torch.randint(0, 256, (8, 64)); y = torch.randint(0, 256, (8, 64))
            loss_fn = nn.CrossEntropyLoss()
        """
        __tracebackhide__ = True  # noqa: F841  (the user's frames, not ours, in tracebacks)
        args = F.from_args(parse_argstring(self.magis, line))   # bad flags: before the cell runs
        source = run_cell_body(self.shell, cell)
        self._optimize(args, source)

    def _optimize(self, args: F.MagisFlags, source: str) -> None:
        from ..capture.export import CaptureError
        from ..search import optimize
        from .progress import reporter

        ns = self.shell.user_ns
        found = discover(ns, source, args)
        name = args.out or f"{found.model_name}_opt"
        progress = reporter(self.shell, args.quiet, args.time, found.model_name)
        try:
            result = optimize(found.model, found.inputs, loss_fn=found.loss_fn, mode=args.mode,
                              mem_budget=args.mem, lat_budget=args.lat, time_budget=args.time,
                              max_states=args.states,
                              device_profile=args.profile, progress=progress,
                              algebra=args.algebra, swap=args.swap,
                              process_group=True if args.ddp else None,
                              measure_time=args.measure_time)
        except CaptureError as e:
            if progress is not None:
                progress.close(failed="capture failed")
            raise UsageError(f"%%magis could not capture {found.model_name} "
                             f"(inputs {', '.join(found.input_names)}): {e}") from None
        except BaseException as e:
            if progress is not None:
                progress.close(failed=type(e).__name__)
            raise
        if progress is not None:
            progress.close()
        missed = not result.met and not result.interrupted and result.budget_kind is not None
        why = (measured_infeasible_message(result) if result.fits
               else infeasible_message(result)) if missed else ""
        if missed and args.strict:
            raise UsageError(why + " Nothing was bound.")
        session = Session(ns, name, found.model_name, result)
        session.bind()
        self.sessions[name] = session
        self.last = session
        if missed:
            # Note [a missed budget in a notebook]: a search bounded by seconds can
            # miss by a hair on a loaded machine (0.503 against --mem 0.5); the best
            # plan found is bound and said plainly, the slider moves on from it
            print(why + f" Bound the best plan found to {name} (--strict: an error instead).")
        if not args.quiet:
            self._report(session, args.plot)

    def _report(self, session: Session, plot: bool) -> None:
        from IPython.display import display
        from .plots import pareto_figure, show_png, timeline_figure
        from .progress import in_kernel
        r = session.result
        if in_kernel(self.shell):
            display({"text/html": r._repr_html_(), "text/plain": repr(r)}, raw=True)
        else:
            print(r.message)
            print(r.table())
        print(f"bound: {session.name} (module), {session.result_name} (result)"
              + ("; interrupted, best plan so far" if r.interrupted else ""))
        if plot:
            show_png(timeline_figure(r), "<memory timeline before/after>")
            show_png(pareto_figure(r), "<Pareto front: peak vs latency>")
        # a data-parallel plan is every rank's: no re-selection on one rank
        if in_kernel(self.shell) and len(r.pareto) > 1 and not r.builder.live:
            from .slider import BudgetSlider
            slider = BudgetSlider(session, plot=plot)
            self.sliders[session.name] = slider
            display(slider)

    @magic_arguments()
    @argument("budget", nargs="?", help="memory budget: ratio (0.4, 40%%) or size (1.5GB)")
    @argument("--lat", metavar="RATIO", help="a latency budget instead of a memory budget")
    @argument("-o", dest="out", metavar="NAME", help="which %%magis result (default: the last)")
    @argument("-q", dest="quiet", action="store_true", help="no table")
    @line_magic
    def magis_budget(self, line):
        """Re-select the plan of a %%magis result for another budget, without a new search.

        Picks from the recorded Pareto front and re-binds the module variable.

            %magis_budget 0.4
            %magis_budget 2GB -o model_opt
            %magis_budget --lat 1.2
        """
        args = parse_argstring(self.magis_budget, line)
        session = self._session(args.out)
        mem = F.parse_mem(args.budget)
        lat = F.parse_ratio("--lat", args.lat)
        if mem is not None and lat is not None:
            raise UsageError("%magis_budget takes a memory budget or --lat, not both")
        session.reselect(mem_budget=mem, lat_budget=lat)
        if not args.quiet:
            r = session.result
            print(r.message)
            print(r.table())
            print(f"bound: {session.name}")

    def _session(self, name: str | None) -> Session:
        if name is None:
            if self.last is None:
                raise UsageError("no %%magis result yet: run a %%magis cell first")
            return self.last
        if name not in self.sessions:
            known = ", ".join(self.sessions) or "none yet"
            raise UsageError(f"-o {name}: no %%magis result bound to that name (known: {known})")
        return self.sessions[name]
