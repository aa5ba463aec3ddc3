"""The generic pass runner: whole-graph passes, the pipeline split, per-stage passes.

A pass is `fn(gm, decisions, **knobs) -> GraphModule` (DESIGN convention 1),
its knobs keyword-only parameters of its own. The runner takes the pass list
in three parts around the one seam:

1. whole-graph passes run on the captured graph;
2. the split cuts it into stage graphs (pp = 1: the graph is the only
   stage); at the seam every stage graph gets its StageInfo, and the
   Decisions what the seam fixes: the tp layout and each stage's parameter
   layout (`ptc.lower.seam.with_stage_layouts`);
3. per-stage passes run on each stage graph, reading those Decisions, and
   change it in place; then each stage's overlap plan joins the Decisions
   (`ptc.lower.seam.with_overlap`).

No pass asks whether the graph is split. After every pass the verifier
(`ptc.lower.verify`) checks the graph, so a broken graph names the pass that
broke it; a pass that raises is reported with the passes run before it. What
a pass logs on the "ptc.passes" logger becomes the pass log. Debugging:
`PTC_DUMP_DIR` writes the graph after capture and after each pass
(`00_captured.txt`, `01_shard_tensors_pass.txt`, `04_checkpoint_layers_pass.stage1.txt`,
...) as readable code and a node list; `PTC_DISABLE_PASSES` (comma-separated
pass names) skips passes the plan does not need.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import fx

from ptc.compiler.records.decisions import Decisions
from ptc.compiler.graph.lazy_code import code_version
from ptc.compiler.graph.meta import update_graph_record
from ptc.lower.seam import with_overlap, with_stage_layouts
from ptc.compiler.graph.stage_graphs import pipeline_stages, whole_graph_stage
from ptc.errors import CompileError
from ptc.lower.verify import Rerun, verify_graph

Pass = Callable[..., fx.GraphModule]
PASS_LOGGER = "ptc.passes"
DUMP_ENV = "PTC_DUMP_DIR"
DISABLE_ENV = "PTC_DISABLE_PASSES"


@dataclass(frozen=True, slots=True, kw_only=True)
class PassList:
    """The passes of a compile, around the seam."""

    whole: Sequence[Pass]
    """Passes over the whole captured graph, in order."""
    split: Pass | None
    """The pass that cuts the graph into stage graphs (None: the graph is one stage)."""
    per_stage: Sequence[Pass]
    """Passes over each stage graph, in order."""

    def names(self) -> list[str]:
        """Every pass's name, in the order they run."""
        return [fn.__name__ for fn in (*self.whole, *([self.split] if self.split else ()),
                                       *self.per_stage)]


@dataclass(frozen=True, slots=True, kw_only=True)
class Lowered:
    """What the runner returns: the stage graphs, the graph they came from, the pass log, and
    the Decisions completed at the seam and after the per-stage passes."""

    stages: tuple[fx.GraphModule, ...]
    """The lowered stage graphs, stage 0 first."""
    graph: fx.GraphModule
    """The pipeline graph calling the stages in order, or the only stage."""
    log: tuple[str, ...]
    """What each pass logged, prefixed with its name."""
    decisions: Decisions
    """The Decisions the passes ran with, with the seam's layouts and the overlap plans."""


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_passes(gm: fx.GraphModule, decisions: Decisions, passes: PassList, *,
               knobs: Mapping[str, Mapping[str, Any]] | None = None,
               disabled: Sequence[str] = (),
               dump_dir: str | os.PathLike | None = None,
               deepen: Pass | None = None) -> Lowered:
    """Run `passes` on the captured graph `gm`; return the stage graphs and the pass log.

    `knobs` maps a pass's function name to its keyword knobs; `disabled`
    names passes to skip (added to those in PTC_DISABLE_PASSES). `deepen`
    (`fn(gm, decisions) -> GraphModule`) runs between the whole-graph passes
    and the split, checked as a pass: the driver's stamping of a graph lowered
    at a few layers out to the plan's depth (`ptc.lower.stamp`).
    """
    dump_dir = dump_dir or os.environ.get(DUMP_ENV)
    skip = _disabled(passes, disabled)
    plan = decisions.plan
    log: list[str] = []
    done: list[str] = []
    index = 0
    rerun = Rerun(gm)  # meta results shared by every check of this compile

    def apply(fn: Pass, graph: fx.GraphModule, stage: int | None = None) -> fx.GraphModule:
        nonlocal index
        name = fn.__name__
        version = code_version(graph)
        out = _run_one(fn, graph, decisions, dict((knobs or {}).get(name, {})), done, log)
        # A pass recompiles exactly the graphs it changes (DESIGN convention 1): no recompile
        # means an unchanged graph, whose shapes the last check found right.
        changed = out is not graph or code_version(out) != version
        verify_graph(out, plan, after=name, shapes=changed, rerun=rerun)
        index += stage is None or stage == 0
        _dump(dump_dir, index, name if stage is None else f"{name}.stage{stage}", out)
        return out

    _dump(dump_dir, 0, "captured", gm)
    for fn in passes.whole:
        if fn.__name__ not in skip:
            gm = apply(fn, gm)
            done.append(fn.__name__)
    if deepen is not None:
        gm = apply(deepen, gm)
    graph = gm
    if passes.split is not None and passes.split.__name__ not in skip:
        graph = apply(passes.split, gm)
        done.append(passes.split.__name__)
    stages = [stage for _, stage in pipeline_stages(graph)] or [graph]
    if len(stages) == 1 and graph is stages[0]:
        update_graph_record(graph, stage=whole_graph_stage(graph))
    decisions = with_stage_layouts(decisions, graph, stages)
    for fn in passes.per_stage:
        if fn.__name__ in skip:
            continue
        for s, stage in enumerate(stages):
            if apply(fn, stage, s if len(stages) > 1 else None) is not stage:
                raise CompileError(f"pass {fn.__name__} returned a new graph for stage {s}: "
                                   "per-stage passes change their stage graph in place")
        done.append(fn.__name__)
    return Lowered(stages=tuple(stages), graph=graph, log=tuple(log),
                   decisions=with_overlap(decisions, stages))


def _run_one(fn: Pass, gm: fx.GraphModule, decisions: Decisions, knobs: dict[str, Any],
             done: list[str], log: list[str]) -> fx.GraphModule:
    """Run one pass, collecting what it logs; a failure names it and the passes before it."""
    name = fn.__name__
    logger = logging.getLogger(PASS_LOGGER)
    handler, level = _Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        return fn(gm, decisions, **knobs)
    except Exception as exc:
        after = ", ".join(done) if done else "capture only"
        raise CompileError(f"pass {name} failed (passes run before it: {after}): "
                           f"{type(exc).__name__}: {exc}", pass_name=name) from exc
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        log.extend(f"{name}: {message}" for message in handler.messages)


def _disabled(passes: PassList, disabled: Sequence[str]) -> set[str]:
    """The passes to skip: `disabled` and PTC_DISABLE_PASSES; unknown names are an error."""
    names = [*disabled, *(n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",")
                          if n.strip())]
    valid = passes.names()
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise CompileError(f"{DISABLE_ENV}: no pass named {', '.join(unknown)}; "
                           f"the passes are {', '.join(valid)}")
    return set(names)


def _dump(dump_dir: str | os.PathLike | None, index: int, name: str, gm: fx.GraphModule) -> None:
    if not dump_dir:
        return
    path = Path(dump_dir)
    path.mkdir(parents=True, exist_ok=True)
    text = gm.print_readable(print_output=False) + "\n\n# nodes\n" + str(gm.graph) + "\n"
    (path / f"{index:02d}_{name}.txt").write_text(text)
