"""The `ptc` command line: check, compile, and the commands built on them.

Each command parses its arguments, calls one library function and prints
what it returns; the logic lives in the library so that Python users get
the same results. Exit codes: 0 success, 1 the plan (or run) failed,
2 bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.text import Text

from ptc.compiler.collector import collector_off
from ptc.errors import PlanError, PtcError, UnpricedError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

_out = Console(highlight=False, soft_wrap=True)
_err = Console(stderr=True, highlight=False, soft_wrap=True)


def _load(path: str, overrides: dict[str, str]):
    """The plan file with the command line's `--section.key value` overrides."""
    from ptc.dsl import load_plan  # noqa: PLC0415 - keep `ptc --help` fast

    plan = load_plan(path, overrides=overrides)
    for warning in plan.warnings:
        _err.print(warning.render(), markup=False)
    return plan


def cmd_check(args: argparse.Namespace) -> int:
    """Validate plan files and what a run of each would need (`ptc.lower.preflight`); print
    every problem of each, with line and caret."""
    status = EXIT_OK
    for path in args.plans:
        try:
            plan = _load(path, args.overrides)
            if not args.plan_only:
                _preflight(plan, args)
        except PlanError as exc:
            _err.print(str(exc), markup=False)
            n = len(exc.diagnostics)
            _err.print(f"{path}: {n} error{'s' if n != 1 else ''}", markup=False)
            status = EXIT_FAILED
            continue
        except PtcError as exc:
            _err.print(f"{path}: error: {exc}", markup=False)
            status = EXIT_FAILED
            continue
        p = plan.parallel
        _out.print(f"{path}: ok — {plan.model.family} on {plan.num_gpus} x {plan.hardware.gpu}, "
                   f"tp={p.tp}{f' cp={p.cp}' if p.cp != 1 else ''} pp={p.pp} dp={p.dp} "
                   f"zero={p.zero}", markup=False)
    return status


def _preflight(plan, args: argparse.Namespace) -> None:
    """Raise PlanError with what a run of `plan` would meet (files, folders, factory, memory);
    print the warnings."""
    from ptc.lower.preflight import preflight  # noqa: PLC0415 - reads files, imports torch

    found = preflight(plan, overrides=args.overrides, allow_oom=getattr(args, "allow_oom", False),
                      compiler=_compile)
    for warning in (d for d in found if d.severity == "warning"):
        _err.print(warning.render(), markup=False)
    errors = [d for d in found if d.severity == "error"]
    if errors:
        raise PlanError(errors)


def _compile(plan):
    """`compile_plan(plan)`, imported when called: a plan refused by the file checks is
    answered before torch is imported."""
    from ptc.lower.driver import compile_plan  # noqa: PLC0415 - imports torch

    return compile_plan(plan)


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile a plan: summarise the captured model and list what the passes did."""
    from ptc.lower.driver import compile_plan  # noqa: PLC0415
    from ptc.views.summary import render_summary, summarize  # noqa: PLC0415
    from ptc.views.tables import Prose  # noqa: PLC0415

    plan = _load(args.plan, args.overrides)
    program = compile_plan(plan, on_capture=lambda gm: _out.print(render_summary(summarize(gm))))
    for line in program.pass_log:
        _out.print(Prose(f"pass: {line}"))
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a stage's lowered graph (with its collectives), its Graphviz, or the schedule."""
    from ptc.views.inspect import graph_to_dot, render_graph  # noqa: PLC0415
    from ptc.lower.driver import compile_plan  # noqa: PLC0415
    from ptc.views.schedule_grid import render_schedule  # noqa: PLC0415

    plan = _load(args.plan, args.overrides)
    if (args.steps or args.ranks) and not args.schedule:
        _err.print("error: --steps and --ranks select rows and columns of --schedule",
                   markup=False)
        return EXIT_USAGE
    if args.schedule:  # the schedule follows from the plan alone: no need to compile
        try:
            _out.print(render_schedule(plan, args.steps, args.ranks), markup=False, end="")
        except ValueError as exc:
            _err.print(f"error: {exc}", markup=False)
            return EXIT_USAGE
        return EXIT_OK
    program = compile_plan(plan)
    if args.dot:
        with open(args.dot, "w", encoding="utf-8") as f:
            f.write(graph_to_dot(program, args.stage))
        _out.print(f"wrote {args.dot} (stage {args.stage})", markup=False)
        return EXIT_OK
    text = render_graph(program, args.stage, args.format, color=_out.is_terminal,
                        width=_out.width)
    _out.print(Text.from_ansi(text), end="")
    return EXIT_OK


def cmd_bench_comm(args: argparse.Namespace) -> int:
    """Measure collective bandwidth on each mesh axis against the plan's hardware figures."""
    from ptc.runtime.bench_comm import bench_comm, parse_size  # noqa: PLC0415
    from ptc.views.comm_report import render_comm  # noqa: PLC0415

    plan = _load(args.plan, args.overrides)
    try:
        sizes = parse_size(args.min_size), parse_size(args.max_size)
    except ValueError as exc:
        _err.print(f"error: {exc}", markup=False)
        return EXIT_USAGE
    report = bench_comm(plan, min_size=sizes[0], max_size=sizes[1], iters=args.iters,
                        warmup=args.warmup)
    _out.print(render_comm(report))
    return EXIT_FAILED if report.flagged and args.strict else EXIT_OK


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure this machine's compute rates and links for the plan; write a hardware profile."""
    from ptc.hwprofile import write_profile  # noqa: PLC0415
    from ptc.models import build_model  # noqa: PLC0415
    from ptc.runtime.bench_comm import parse_size  # noqa: PLC0415
    from ptc.lower.driver import compile_plan  # noqa: PLC0415
    from ptc.runtime.calibrate import (  # noqa: PLC0415
        RoutingRun,
        Settings,
        calibrate,
        render_profile,
    )
    from ptc.worker import MODELS  # noqa: PLC0415

    plan = _load(args.plan, args.overrides)
    try:
        settings = Settings(seconds=args.seconds, rounds=args.rounds,
                            min_size=parse_size(args.min_size),
                            max_size=parse_size(args.max_size), iters=args.iters,
                            warmup=args.warmup)
    except ValueError as exc:
        _err.print(f"error: {exc}", markup=False)
        return EXIT_USAGE
    profile = calibrate(plan, settings, build=build_model,
                        routing=RoutingRun(compiler=compile_plan, models=MODELS))
    write_profile(profile, args.output)
    _out.print(render_profile(profile, plan), markup=False)
    from_plan = os.path.relpath(Path(args.output).resolve(), Path(args.plan).resolve().parent)
    _out.print(f"wrote {args.output}; the plan takes its figures with hardware {{ profile = "
               f"\"{from_plan}\" }} (a path from the plan's folder)", markup=False)
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    """Train a plan on one process per rank through torch's elastic launcher.

    The plan is read here, once, with its overrides; the launcher writes it into the run's
    log folder (`ptc.worker.write_plan`) and the workers read that. Inside a launched worker
    (`torchrun ... -m ptc run PLAN`) it trains the plan read here as this rank.
    """
    from ptc.runtime.launcher import in_worker, launch  # noqa: PLC0415

    extra = [f"--{flag.replace('_', '-')}={value}" for flag, value in
             (("nnodes", args.nnodes), ("node_rank", args.node_rank),
              ("rdzv_endpoint", args.rdzv_endpoint), ("rdzv_backend", args.rdzv_backend),
              ("rdzv_id", args.rdzv_id), ("max_restarts", args.max_restarts))
             if value is not None]
    plan = _load(args.plan, args.overrides)  # report plan errors before any process starts
    if in_worker():
        from ptc.worker import train  # noqa: PLC0415 - imports torch

        return train(plan)
    _preflight(plan, args)  # refused on a missing file before torch is imported
    from ptc.worker import write_plan  # noqa: PLC0415 - imports torch

    return launch(_priced_on_this_host(plan), write_plan, nproc=args.nproc,
                  extra_launcher_args=extra, log_dir=args.log_dir)


def _priced_on_this_host(plan, *, measure: bool = True):
    """`ptc.runtime.host_profile.priced_on_this_host`, saying on stderr when it measures."""
    from ptc.models import build_model  # noqa: PLC0415
    from ptc.runtime.host_profile import priced_on_this_host  # noqa: PLC0415 - imports torch

    return priced_on_this_host(plan, measure=measure, build=build_model,
                               say=lambda line: _err.print(line, markup=False))


def cmd_dump(args: argparse.Namespace) -> int:
    """Print the plan as the language writes it, overrides applied."""
    from ptc.dsl import dump_plan  # noqa: PLC0415

    _out.print(dump_plan(_load(args.plan, args.overrides)), markup=False, end="")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    """Search the layouts of a plan and print the best ones and why others failed."""
    from ptc.views.explain import render_search  # noqa: PLC0415

    plan = _priced_on_this_host(_load(args.plan, args.overrides), measure=False)
    _out.print(render_search(plan, top=args.top))
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    """Print the plan's memory per stage (with its formula) and its time breakdown: the
    decisions of its compile (the estimate made once, there), or with --plan-only the
    plan's own estimate."""
    from ptc.compiler.search.estimate import estimate  # noqa: PLC0415
    from ptc.lower.preflight import memory_problems  # noqa: PLC0415
    from ptc.views.explain import render_explain  # noqa: PLC0415

    plan = _priced_on_this_host(_load(args.plan, args.overrides), measure=False)
    if args.plan_only:
        est = estimate(plan)
    else:
        decisions = _compile(plan).decisions
        if decisions.estimate is None:
            raise UnpricedError(decisions.unpriced or "the compile made no prediction")
        plan, est = decisions.plan, decisions.estimate
    _out.print(render_explain(plan, est, compiled=not args.plan_only))
    problems = memory_problems(plan, est, overrides=args.overrides)
    if problems:
        raise PlanError(problems)  # printed after the explanation: exit 1
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    """Write one self-contained HTML page: schedule, memory, step time, passes, graphs."""
    from ptc.views.html_report import render_report  # noqa: PLC0415
    from ptc.lower.driver import compile_plan  # noqa: PLC0415

    page = render_report(compile_plan(_priced_on_this_host(_load(args.plan, args.overrides),
                                                           measure=False)))
    Path(args.output).write_text(page, encoding="utf-8")
    _out.print(f"wrote {args.output}", markup=False)
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    """Write a checkpoint's trained weights as a torch state dict or a Hugging Face directory."""
    from ptc.models import build_model  # noqa: PLC0415
    from ptc.runtime.export import export_hf, export_torch, step_directory  # noqa: PLC0415

    source, step = step_directory(args.checkpoint)
    if args.hf:
        written = export_hf(source, args.hf, build=build_model)
    else:
        written = export_torch(source, args.torch, build=build_model)
    _out.print(f"wrote {written}: the weights of step {step} ({args.checkpoint})", markup=False)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every `ptc` command."""
    parser = argparse.ArgumentParser(
        prog="ptc", description="Compile and run parallel training plans.",
        epilog="Every command that reads a PLAN takes overrides of its fields: "
               "--section.key value (e.g. --parallel.tp 4 --train.steps 100), checked "
               "like a line of the file.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def command(name: str, func: Callable[[argparse.Namespace], int], help_text: str):
        # argparse %-formats a command's help line but prints its description as written.
        p = sub.add_parser(name, help=help_text, description=help_text.replace("%%", "%"))
        p.set_defaults(func=func)
        return p

    p = command("check", cmd_check, "Check plan files and what a run of each needs here (files, "
                "folders, factory, memory); exit 0 when valid, 1 when not.")
    p.add_argument("plans", nargs="+", metavar="PLAN", help="plan file(s) (.ptc)")
    p.add_argument("--plan-only", dest="plan_only", action="store_true",
                   help="check the plans themselves, not this machine's files and folders "
                        "nor memory (a plan written for another cluster)")

    p = command("compile", cmd_compile,
                "Capture the plan's model and summarise parameters, FLOPs and layers.")
    p.add_argument("plan", metavar="PLAN", help="plan file (.ptc)")

    p = command("inspect", cmd_inspect, "Show what the compiler did: a stage's lowered graph "
                "with every collective, as code or a table, Graphviz, or the pipeline schedule.")
    p.add_argument("plan", metavar="PLAN", help="plan file (.ptc)")
    p.add_argument("--stage", type=int, default=0, help="pipeline stage to show (default 0)")
    p.add_argument("--format", choices=("code", "table"), default="code",
                   help="readable fx code (default) or a table of nodes")
    p.add_argument("--dot", metavar="FILE", help="write the stage graph as Graphviz to FILE")
    p.add_argument("--schedule", action="store_true",
                   help="print the pipeline schedule as a step x rank grid")
    p.add_argument("--steps", default=None, metavar="A:B",
                   help="with --schedule: only steps A to B-1 (or N, or A,B,C)")
    p.add_argument("--ranks", default=None, metavar="A:B",
                   help="with --schedule: only these pipeline ranks (A:B, N or A,B,C)")

    p = command("run", cmd_run, "Train a plan: one process per rank (gloo on CPUs, NCCL on "
                "GPUs) through torch's elastic launcher; rank 0 prints each step.")
    p.add_argument("plan", metavar="PLAN", help="plan file (.ptc)")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes on this node (default: tp*cp*pp*dp / nodes)")
    p.add_argument("--nnodes", default=None, help="nodes, or MIN:MAX for an elastic job")
    p.add_argument("--node-rank", dest="node_rank", default=None, help="this node's rank")
    p.add_argument("--rdzv-endpoint", dest="rdzv_endpoint", default=None,
                   help="rendezvous HOST:PORT for multi-node runs")
    p.add_argument("--rdzv-backend", dest="rdzv_backend", default=None,
                   help="rendezvous backend (default c10d)")
    p.add_argument("--rdzv-id", dest="rdzv_id", default=None, help="job id shared by all nodes")
    p.add_argument("--allow-oom", dest="allow_oom", action="store_true",
                   help="run a plan whose predicted memory exceeds the budget (a warning)")
    p.add_argument("--log-dir", dest="log_dir", default=None,
                   help="every rank's stdout and stderr go to files here (default: "
                        "checkpoint_dir/logs, else a new temporary folder)")
    p.add_argument("--max-restarts", dest="max_restarts", type=int, default=None,
                   help="restart the whole group up to N times after a rank fails")

    p = command("bench-comm", cmd_bench_comm, "Measure all-reduce, all-gather, reduce-scatter "
                "and send/recv bandwidth on each mesh axis (like nccl-tests), compare with the "
                "plan's hardware figures, and flag axes below 80 %%.")
    p.add_argument("plan", metavar="PLAN", help="plan file (.ptc)")
    p.add_argument("--min-size", dest="min_size", default="1M", help="smallest message (1M)")
    p.add_argument("--max-size", dest="max_size", default="1G", help="largest message (1G)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size (20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per size (5)")
    p.add_argument("--strict", action="store_true", help="exit 1 when any axis is flagged")

    p = command("calibrate", cmd_calibrate, "Measure, on the plan's device and processes, "
                "the GEMM rate, the memory-bound rate, the per-op dispatch overhead and each "
                "mesh axis's link latency and bandwidth; write them as a hardware profile "
                "that a plan names with hardware { profile = \"FILE\" }.")
    p.add_argument("plan", metavar="PLAN", help="plan file (.ptc)")
    p.add_argument("-o", "--output", default="hw.json", help="the profile (hw.json)")
    p.add_argument("--seconds", type=float, default=0.3,
                   help="time one round of each compute probe runs for (0.3)")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds of the compute probes; each takes its median (5)")
    p.add_argument("--min-size", dest="min_size", default="4K",
                   help="smallest collective message (4K)")
    p.add_argument("--max-size", dest="max_size", default="16M",
                   help="largest collective message (16M; sizes step by 4x)")
    p.add_argument("--iters", type=int, default=10, help="timed collectives per size (10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed collectives per size (3)")

    p = command("plan", cmd_plan, "Search every valid layout (tp/pp/dp may be auto) and "
                "rank them by predicted step time.")
    p.add_argument("plan", metavar="PLAN", help="plan file (.ptc)")
    p.add_argument("--top", type=int, default=5, help="how many layouts to show (default 5)")

    p = command("explain", cmd_explain, "Explain a plan: memory per stage against HBM with "
                "the symbolic formula, step-time breakdown, bubble and warnings, as the "
                "compile decided them.")
    p.add_argument("plan", metavar="PLAN", help="plan file (.ptc)")
    p.add_argument("--plan-only", action="store_true",
                   help="estimate the plan without compiling its model (faster; the cut and "
                        "policies are those a compile would choose)")

    p = command("report", cmd_report, "Write an HTML page of the compiled plan: the pipeline "
                "schedule as a Gantt chart, memory per stage against the budget, the step-time "
                "breakdown, the pass log and each stage's lowered graph.")
    p.add_argument("plan", metavar="PLAN", help="plan file (.ptc)")
    p.add_argument("-o", "--output", default="report.html", help="the page (report.html)")

    p = command("dump", cmd_dump, "Print the plan as text, with the command line's "
                "--section.key value overrides applied.")
    p.add_argument("plan", metavar="PLAN", help="plan file (.ptc)")

    p = command("export", cmd_export, "Write the trained weights of a checkpoint under the "
                "model's own names: a torch state dict, or a Hugging Face save_pretrained "
                "directory that from_pretrained loads.")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a checkpoint step directory, or a checkpoint_dir (its latest)")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--hf", metavar="DIR", help="write a save_pretrained directory")
    out.add_argument("--torch", metavar="FILE", help="write a torch.save state dict")
    return parser


TRAINS_HERE = frozenset({"run"})
"""Commands that may train in this process (a one-process plan): they keep Python's cyclic
garbage collector. The others end within seconds; it is off for them, since importing torch
and compiling make millions of objects that its collections walk again and again (a quarter
of a second of the imports, about a second of compiling the 80-layer 70B example) to
reclaim a few MB that the process's end returns anyway."""


def entry() -> int:
    """The `ptc` program (console script, `python -m ptc`): `main` in a process that ends with
    its command.

    Python's cyclic garbage collector is off from the start, for the imports
    too, and is not given back after a command (`TRAINS_HERE` turns it on
    again): given back, its first collection walks everything torch and the
    compile made, a quarter of a second before a process ends that frees it
    all anyway, more after a deep model's compile.
    """
    gc.disable()
    return main(process=True)


def main(argv: Sequence[str] | None = None, *, process: bool = False) -> int:
    """Run one command (`argv`, else the process's arguments); returns the exit code.

    Called from Python (`process` false) it gives the garbage collector back
    as it found it; `entry` runs it for the `ptc` program itself.
    """
    from ptc.dsl.overrides import split_overrides  # noqa: PLC0415

    parser = build_parser()
    try:
        rest, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
        args = parser.parse_args(rest)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    except PlanError as exc:
        _err.print(str(exc), markup=False)
        return EXIT_USAGE
    args.overrides = overrides
    if args.command in TRAINS_HERE:
        if process:
            gc.enable()  # `entry` turned it off for the imports
        pause = contextlib.nullcontext()
    else:  # as it was after: main may be called from Python, in a process that goes on
        pause = contextlib.nullcontext() if process else collector_off()
    try:
        with pause:
            return args.func(args)
    except PlanError as exc:
        _err.print(str(exc), markup=False)
        return EXIT_FAILED
    except PtcError as exc:
        _err.print(f"error: {exc}", markup=False)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(entry())
