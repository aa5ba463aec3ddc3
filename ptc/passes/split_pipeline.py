"""The split_pipeline pass: cut the captured graph into pp × v stage graphs.

The pass returns a *pipeline graph*: a GraphModule whose submodules
`stage_0` .. `stage_{p·v-1}` are the stage graphs and whose own graph calls
them in order, handing each stage's boundary values to the next. Run in
one process it computes exactly what the captured graph computed (a test
checks that), and `PTC_DUMP_DIR` shows the cut. The passes after this one
run on every stage graph (`ptc.lower.driver.run_passes`), and the
Program keeps one lowered graph per stage — graphs per stage, never per
rank. `ptc.compiler.records.stages` defines what each stage graph records.

Where the cut goes is decided before the passes, with the estimate
(`ptc.compiler.records.decisions`): the plan the pass reads pins how many layers
each stage holds (its first/last_stage_layers, as the cost model chose them,
or its stage_boundaries), else the layers are shared evenly, the later
stages taking one more where they do not divide. The pass only applies it:
- *atoms*: consecutive nodes of one transformer layer, or of one other
  module (embed, norm, head, ...), form an atom; glue nodes of the model's
  own forward (module path "" or a container of the blocks) join the atom
  before them (the first atom when at the start). Cuts go between atoms: a
  stage starts at its first layer's atom (a last stage of no layer at what
  follows the last layer: the norm, head and loss).
- A plan's stage_boundaries may name any atom ("norm"); a plan that pins a
  cut at an atom that is no layer pins every cut, since only layers can be
  shared out.

What crosses a cut is read off the graph: every tensor made before the cut
and used after it, with its captured shape; a tensor used two stages later
passes through the stage between. Graph inputs (tokens, targets) never
cross: each rank reads them itself. A non-tensor value used across the cut
(a size, a dtype) is recomputed in the later stage when it depends only on
graph inputs, and otherwise becomes the constant capture specialised it to.
A parameter used by several stages (tied input embedding and LM head) is
copied into each; the stage graphs record it as tied, and the runtime sums
its gradients between those stages.
"""

from __future__ import annotations

import copy
import logging
import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn

from ptc.compiler.records.decisions import Decisions
from ptc.compiler.graph.lazy_code import graph_module
from ptc.compiler.graph.meta import copy_meta, get_info, graph_info, update_graph_record
from ptc.compiler.graph.nodes import module_path, walk
from ptc.compiler.graph.params import used_params
from ptc.compiler.records.stages import DATA_ROLES, Boundary, PipelineInfo, StageInfo
from ptc.compiler.graph.stage_graphs import pipeline_info, stage_info
from ptc.errors import CompileError, DiagnosticSink, did_you_mean
from ptc.plan import ParallelSpec, Plan, stage_rank

log = logging.getLogger("ptc.passes.split_pipeline")

_FREE = dict(flops=0, params=0, param_bytes=0)


def split_pipeline_pass(gm: fx.GraphModule, decisions: Decisions) -> fx.GraphModule:
    """Cut the graph into pp × virtual_stages stage graphs where the decisions put the cut.

    Pipeline parallelism runs consecutive pieces of the model on different
    ranks; the cut decides the pipeline's speed (its slowest stage) and
    memory, so the cost model chooses it before the passes (`resolve`) and
    this pass applies it, so that the Program runs the cut that was priced.
    Returns the pipeline graph (module docstring); a plan with pp = 1 gets
    `gm` back unchanged.
    """
    plan = decisions.plan
    par = plan.parallel
    if par.pp == 1:
        return gm
    if pipeline_info(gm) is not None or stage_info(gm) is not None:
        raise CompileError("pipeline_split: the graph is already split into stages")
    chunks = par.pp * par.virtual_stages
    atoms, names = find_atoms(gm)
    starts = _chunk_starts(gm, par, names, chunks)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    atom_of = {node: i for i, nodes in enumerate(atoms) for node in nodes}
    stage_of = {node: _chunk_of(atom_of[node], starts) for node in atom_of}
    stages = _build_stages(gm, plan, atoms, names, stage_of, order, starts)
    pipeline = _pipeline_graph(gm, stages)
    _log_split(stages, len(atoms))
    return pipeline


# ---------------------------------------------------------------------- atoms


def find_atoms(gm: fx.GraphModule) -> tuple[list[list[fx.Node]], list[str]]:
    """The graph's atoms in order (lists of nodes) and their names (see module docstring).

    Placeholders, get_attr nodes and the output belong to no atom: graph
    inputs are read by every stage, attributes are copied into each stage
    that reads them.
    """
    blocks = graph_info(gm).blocks_path or ""
    glue = {""} | {".".join(blocks.split(".")[:i]) for i in range(1, blocks.count(".") + 1)}
    atoms: list[list[fx.Node]] = []
    names: list[str] = []
    pending: list[fx.Node] = []  # glue before the first atom
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        info = get_info(node)
        path = module_path(node)
        if info is not None and info.layer is not None:
            key = f"{blocks}.{info.layer}" if blocks else f"layer {info.layer}"
        elif path in glue:
            key = None
        else:
            key = path
        if key is None or (names and names[-1] == key):
            (atoms[-1] if atoms else pending).append(node)
            continue
        atoms.append(pending + [node])
        names.append(key)
        pending = []
    if pending:
        if not atoms:
            raise CompileError("pipeline_split: the graph has no module to cut at")
        atoms[-1].extend(pending)
    return atoms, names


def _chunk_starts(gm: fx.GraphModule, par: ParallelSpec, names: list[str], chunks: int
                  ) -> tuple[int, ...]:
    """Index of each stage's first atom: the plan's layer counts, or its atom pins."""
    layers = graph_info(gm).num_layers
    if layers < chunks and not par.pins_layers:
        raise CompileError(f"pipeline_split: the graph has {layers} layers and cannot be cut "
                           f"into {chunks} stages of at least one layer each; pin the cuts "
                           f"with parallel.stage_boundaries")
    for name in par.stage_boundaries:
        if name is not None and name not in names:
            raise CompileError(f"pipeline_split: stage_boundaries: no graph piece named "
                               f"{name!r}{did_you_mean(name, names)}; pieces: "
                               f"{', '.join(names)}")
    sink = DiagnosticSink()
    counts = par.stage_layers(layers, sink) if par.pins_layers else _even(layers, chunks)
    if counts is not None and not sink.errors:
        return (0, *_layer_starts(gm, counts, names))
    if any(b is None for b in par.stage_boundaries):
        raise CompileError(f"pipeline_split: {sink.errors[0].message}; a cut at a piece that is "
                           f"no layer needs every cut pinned")
    return (0, *_atom_starts(par.stage_boundaries, names))


def _even(layers: int, chunks: int) -> tuple[int, ...]:
    """`layers` shared by `chunks` stages, the later ones taking one more where uneven."""
    base, extra = divmod(layers, chunks)
    return tuple(base + (c >= chunks - extra) for c in range(chunks))


def _atom_starts(pins: tuple[str, ...], names: list[str]) -> list[int]:
    """The atoms `stage_boundaries` names (each a piece of the graph), stage 1's first."""
    starts = [names.index(name) for name in pins]
    if starts != sorted(set(starts)):
        raise CompileError(f"pipeline_split: stage_boundaries must start later stages at later "
                           f"pieces, got {list(pins)}")
    return starts


def _layer_starts(gm: fx.GraphModule, counts: tuple[int, ...], names: list[str]) -> list[int]:
    """Index of the first atom of stages 1 .. of layer counts `counts` (stage 0 first)."""
    info = graph_info(gm)

    def atom(layer: int) -> int:
        return names.index(f"{info.blocks_path}.{layer}" if info.blocks_path
                           else f"layer {layer}")

    starts, first = [], 0
    for count in counts[:-1]:
        first += count
        # A last stage of no layer starts at what follows the last layer (norm, head, loss).
        starts.append(atom(first) if first < info.num_layers else atom(first - 1) + 1)
    return starts


def _chunk_of(atom: int, starts: tuple[int, ...]) -> int:
    return max(c for c, s in enumerate(starts) if s <= atom)


# ------------------------------------------------------------ what crosses


def _is_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    info = get_info(node)
    return val is None and info is not None and len(info.shapes) == 1


def _last_use(node: fx.Node, atom_of: Mapping[fx.Node, int], n: int) -> int:
    """Index of the last atom that uses `node` (n for the graph's output)."""
    last = -1
    for user in node.users:
        last = max(last, n if user.op == "output" else atom_of.get(user, -1))
    return last


def _requires_grad(gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """Whether each node's value depends on a parameter (its gradient flows back)."""
    out: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            out[node] = False
        elif node.op == "get_attr":
            value = _fetch(gm, str(node.target))
            out[node] = isinstance(value, nn.Parameter) and value.requires_grad
        else:
            own = node.op == "call_module" and any(
                p.requires_grad for _, p in used_params(gm, node))
            out[node] = own or any(out.get(a, False) for a in node.all_input_nodes)
    return out


def _fetch(gm: fx.GraphModule, target: str):
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _recomputable(node: fx.Node) -> bool:
    """Whether a non-tensor value can be recomputed from graph inputs alone (tokens.size(1))."""
    return not _is_tensor(node) and node.op not in ("get_attr", "output") and all(
        a.op == "placeholder" or _recomputable(a) for a in node.all_input_nodes)


# ----------------------------------------------------------- stage graphs


def _build_stages(gm: fx.GraphModule, plan: Plan, atoms: list[list[fx.Node]], names: list[str],
                  stage_of: dict[fx.Node, int], order: dict[fx.Node, int],
                  starts: tuple[int, ...]) -> list[fx.GraphModule]:
    chunks = len(starts)
    grads = _requires_grad(gm)
    # Tensors each cut carries: made at or before stage c, used after it.
    carried: list[list[fx.Node]] = [[] for _ in range(chunks)]
    for node, c in stage_of.items():
        if not _is_tensor(node):
            continue
        users = [chunks - 1 if u.op == "output" else stage_of.get(u, c) for u in node.users]
        for cut in range(c, max(users, default=c)):
            carried[cut].append(node)
    for nodes in carried:
        nodes.sort(key=order.__getitem__)
    tied = _tied_params(gm, stage_of)
    stages = []
    for c in range(chunks):
        inputs = carried[c - 1] if c > 0 else []
        outputs = carried[c] if c < chunks - 1 else []
        atom_range = range(starts[c], starts[c + 1] if c + 1 < chunks else len(atoms))
        graph, data = _stage_graph(gm, c, stage_of, order, inputs, outputs, chunks)
        stage_gm = _stage_module(gm, graph, c)
        info = StageInfo(
            index=c, num_stages=chunks, chunk=c // plan.parallel.pp,
            rank=stage_rank(c, plan.parallel.pp, plan.parallel.schedule),
            inputs=tuple(_boundary(n, grads) for n in inputs),
            outputs=tuple(_boundary(n, grads) for n in outputs), data=data,
            tied=tuple((name, canonical) for canonical, names_by_stage in tied.items()
                       for stage, name in names_by_stage if stage == c),
            atoms=tuple(names[a] for a in atom_range))
        stage_gm.meta.update(gm.meta)  # what earlier passes left (capture info, tp layout)
        update_graph_record(stage_gm, stage=info)
        stages.append(stage_gm)
    return stages


def _boundary(node: fx.Node, grads: dict[fx.Node, bool]) -> Boundary:
    info = get_info(node)
    dtype = info.dtypes[0]
    return Boundary(name=node.name, shape=tuple(info.shapes[0]), dtype=dtype,
                    requires_grad=grads[node] and dtype.is_floating_point)


def _stage_graph(gm: fx.GraphModule, c: int, stage_of: dict[fx.Node, int],
                 order: dict[fx.Node, int], inputs: list[fx.Node], outputs: list[fx.Node],
                 chunks: int) -> tuple[fx.Graph, tuple[str, ...]]:
    """Stage c's graph: boundary placeholders, data placeholders, its nodes, its outputs."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        copy_meta(node, env[node], kind="input", **_FREE)
    mine = [n for n in gm.graph.nodes if stage_of.get(n) == c
            or (n.op == "output" and c == chunks - 1)]
    needed = _closure(mine, stage_of, c)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and n in needed]
    for node in placeholders:
        env[node] = graph.placeholder(node.name)
        copy_meta(node, env[node])
    inputs_in_order = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in sorted(needed - set(placeholders), key=order.__getitem__):
        if node.op not in ("get_attr", "output") and stage_of.get(node) != c \
                and not _recomputable(node):
            env[node] = _constant(node)
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
        copy_meta(node, env[node])
    if c < chunks - 1:
        result = graph.output(tuple(env[n] for n in outputs))
        copy_meta(outputs[-1], result, kind="output", shapes=tuple(
            get_info(n).shapes[0] for n in outputs), dtypes=tuple(
            get_info(n).dtypes[0] for n in outputs), **_FREE)
    graph.lint()
    # Captured graphs take (tokens, targets) by position, whatever the model calls them.
    return graph, tuple(DATA_ROLES[inputs_in_order.index(n)] for n in placeholders)


def _closure(mine: list[fx.Node], stage_of: dict[fx.Node, int], c: int) -> set[fx.Node]:
    """Stage c's nodes plus what they read that no boundary carries.

    That is: graph inputs, attributes, and non-tensor values of other
    stages (with their own inputs when they are recomputed from graph inputs).
    Tensors of earlier stages are boundary inputs and are left out.
    """
    constants: set[fx.Node] = set()  # read as the value capture specialised them to

    def reads(node: fx.Node) -> list[fx.Node]:
        out = []
        for arg in node.all_input_nodes:
            if stage_of.get(arg) == c or arg.op in ("placeholder", "get_attr") or (
                    not _is_tensor(arg) and _recomputable(arg)):
                out.append(arg)
            elif not _is_tensor(arg):
                constants.add(arg)
        return out

    return set(walk(mine, reads)) | constants


def _constant(node: fx.Node):
    """The value capture specialised a non-tensor node to (a size, a dtype, a shape tuple)."""
    value = node.meta.get("val")
    if isinstance(value, (int, float, bool, torch.dtype, torch.Size, str)) or (
            isinstance(value, tuple) and all(isinstance(v, int) for v in value)):
        return value
    raise CompileError(f"pipeline_split: {node.name} ({node.format_node()}) is used across a "
                       f"stage cut, is not a tensor, and has no constant value to pass "
                       f"({type(value).__name__}); pin the cut elsewhere with the `boundaries` "
                       f"knob")


def _stage_module(gm: fx.GraphModule, graph: fx.Graph, c: int) -> fx.GraphModule:
    """A GraphModule of stage c's graph owning its own copies of the modules it calls.

    One deepcopy memo per stage keeps weights shared within the stage
    shared, and makes a weight used by two stages two copies (tied).
    """
    memo: dict[int, Any] = {}
    root = {}
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr") and node.target not in root:
            root[node.target] = copy.deepcopy(_fetch(gm, str(node.target)), memo)
    return graph_module(root, graph, f"Stage{c}")


def _tied_params(gm: fx.GraphModule, stage_of: dict[fx.Node, int]
                 ) -> dict[str, list[tuple[int, str]]]:
    """Canonical name -> [(stage, name there)] of every parameter read by several stages."""
    canonical: dict[int, str] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
    uses: dict[int, dict[int, str]] = {}
    for node in gm.graph.nodes:
        stages = {stage_of[u] for u in node.users if u in stage_of} if node.op == "get_attr" \
            else {stage_of[node]} if node in stage_of else set()
        for name, p in used_params(gm, node):
            for stage in stages:
                uses.setdefault(id(p), {}).setdefault(stage, name)
    return {canonical[pid]: sorted(by_stage.items())
            for pid, by_stage in uses.items() if len(by_stage) > 1}


# -------------------------------------------------------- pipeline graph


def _pipeline_graph(gm: fx.GraphModule, stages: list[fx.GraphModule]) -> fx.GraphModule:
    """The graph that calls the stage graphs in order (runs as the captured graph did)."""
    graph = fx.Graph()
    inputs = {}
    for role, node in zip(DATA_ROLES, (n for n in gm.graph.nodes if n.op == "placeholder")):
        inputs[role] = graph.placeholder(node.name)
        copy_meta(node, inputs[role])
    values: dict[str, fx.Node] = {}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for c, stage in enumerate(stages):
        info = stage_info(stage)
        args = [values[b.name] for b in info.inputs] + [inputs[d] for d in info.data]
        call = graph.call_module(f"stage_{c}", tuple(args))
        copy_meta(out_node, call, module_path="", module_type="", layer=None, kind="other",
                  shapes=tuple(b.shape for b in info.outputs),
                  dtypes=tuple(b.dtype for b in info.outputs), **_FREE)
        if info.is_last:
            result = graph.output(call)
            copy_meta(out_node, result)
            break
        for i, b in enumerate(info.outputs):
            values[b.name] = graph.call_function(operator.getitem, (call, i))
            copy_meta(call, values[b.name], kind="view", shapes=(b.shape,), dtypes=(b.dtype,))
    graph.lint()
    pipeline = graph_module({f"stage_{c}": s for c, s in enumerate(stages)}, graph, "Pipeline")
    pipeline.meta.update(gm.meta)
    tied: dict[str, list[int]] = {}
    for stage in stages:
        for _, canonical in stage_info(stage).tied:
            tied.setdefault(canonical, []).append(stage_info(stage).index)
    last = stage_info(stages[-1])
    update_graph_record(pipeline, pipeline=PipelineInfo(
        pp=len(stages) // (last.chunk + 1), virtual=last.chunk + 1,
        stages=tuple(f"stage_{c}" for c in range(len(stages))),
        tied=tuple((name, tuple(ss)) for name, ss in tied.items())))
    return pipeline


def _log_split(stages: list[fx.GraphModule], atoms: int) -> None:
    for stage in stages:
        info = stage_info(stage)
        crossing = ", ".join(f"{b.name} {list(b.shape)} {str(b.dtype).removeprefix('torch.')}"
                             for b in info.outputs)
        log.info("stage %d (rank %d, chunk %d): %s .. %s, %d pieces%s", info.index, info.rank,
                 info.chunk, info.atoms[0], info.atoms[-1], len(info.atoms),
                 f"; sends {crossing}" if crossing else "")
        for name, canonical in info.tied:
            log.info("stage %d holds tied weight %s (as %s): gradients summed across stages",
                     info.index, canonical, name)
    log.info("split %d pieces into %d stages", atoms, len(stages))
