"""Cutting a chain of graph pieces into pipeline stages so that the slowest is as fast as possible.

Terms: an *atom* is a run of graph nodes that stays in one stage (the
embedding, one transformer layer, the final norm, the head with the loss);
cuts go between atoms. Each atom is priced once, from the graph:
- `seconds` per micro-batch: forward F (its nodes' FLOPs), backward 2F and
  recompute (F again for a fully recomputed layer, the attention core's
  FLOPs for a selective one), at the plan's achievable FLOP rate — so an
  embedding (a lookup, no FLOPs) weighs little and an LM head over a large
  vocabulary weighs several layers;
- `state_bytes`: weights, gradients and optimizer state of the parameters
  it first uses, divided as the plan's ZeRO stage divides them;
- `activation_bytes`: what one micro-batch's forward leaves saved for
  backward in it (ptc.compiler.activations, read off the graph, which is
  not checkpointed yet), times the share its layer's recompute policy keeps
  (the memory model's ratio of policy to none). Layers alike are run once:
  a layer making the same calls on operands alike as an earlier one
  (`call_cache.nodes_signature`) saves what that one saves (`_twins`).
A cut costs the point-to-point time of the tensors crossing it (forward
activations and backward gradients), charged to the stages on both sides:
a cut where little crosses is preferred among equally fast ones.

`balance` picks k contiguous chunks minimising the slowest chunk's time,
then the sum of squared chunk times (so the rest are even too), such that
each chunk fits its memory: model state + activations × the units its rank
keeps in flight under the schedule (`memory.in_flight`), within the plan's
memory budget (HBM less `memory_margin`) less the runtime reserve. With v chunks per rank the rank's HBM and its
in-flight units are shared by its chunks, and each chunk is charged 1/v of
both (exact when the rank's chunks are alike). Pinned cuts are kept.
Dynamic programming over the atoms, O(n²·k).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from ptc.compiler.activations import saved_storages
from ptc.compiler.call_cache import Unkeyable, nodes_signature
from ptc.compiler.decisions import Decisions
from ptc.compiler.meta import get_info
from ptc.compiler.program import used_params
from ptc.errors import CompileError, PtcError
from ptc.plan import DTYPE_BYTES, Plan

log = logging.getLogger("ptc.compiler.balance")

RECOMPUTE_CORE_KINDS = frozenset({"matmul", "attention", "softmax", "dropout"})
"""Node kinds of the attention core, what selective recompute runs again."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AtomCost:
    """The price of one atom, per micro-batch."""

    name: str
    """"embed", "layers.3", "head", ..."""
    flops: int
    """Forward FLOPs."""
    seconds: float
    """Forward + backward + recompute seconds."""
    state_bytes: float
    """Weights, gradients and optimizer state of its parameters on one rank."""
    activation_bytes: float
    """Bytes one micro-batch saves for backward in it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Split:
    """A chosen cut: where each chunk starts, and its predicted time and memory."""

    starts: tuple[int, ...]
    """Index of each chunk's first atom (starts[0] == 0)."""
    seconds: tuple[float, ...]
    """Per chunk: seconds per micro-batch, its cuts' transfers included."""
    memory: tuple[float, ...]
    """Per chunk: predicted peak bytes (model state + in-flight activations)."""


def price_atoms(gm: fx.GraphModule, atoms: Sequence[Sequence[fx.Node]], names: Sequence[str],
                decisions: Decisions) -> list[AtomCost]:
    """Price every atom of the captured graph `gm` for the plan (see module docstring)."""
    from ptc.compiler.memory import held_per_element, precision  # noqa: PLC0415 - sympy (slow)

    plan = decisions.plan
    hw, train, par = plan.hardware, plan.train, plan.parallel
    rate = hw.peak_flops[train.compute_dtype] * hw.achievable_fraction
    dtype_bytes = DTYPE_BYTES[train.compute_dtype]
    prec = precision(dtype_bytes, train.optimizer.name, train.optimizer.momentum,
                     DTYPE_BYTES[train.grad_dtype], plan.grad_wire_bytes)
    zero, dp = par.zero, par.dp
    weight, (grad, grad_shard), state = held_per_element(prec, zero)
    per_element = (weight / (dp if zero >= 3 else 1) + grad + grad_shard / dp
                   + state / (dp if zero >= 1 else 1))
    kept, rerun = _kept_share(plan)
    saved = _saved_bytes(gm, atoms)
    seen: set[int] = set()
    costs = []
    for index, (nodes, name) in enumerate(zip(atoms, names)):
        flops = core = elements = 0
        layer = None
        for node in nodes:
            info = get_info(node)
            if info is not None:
                flops += info.flops
                core += info.flops if info.kind in RECOMPUTE_CORE_KINDS else 0
                layer = info.layer if layer is None else layer
            for _, p in used_params(gm, node):
                if id(p) not in seen:
                    seen.add(id(p))
                    elements += p.numel()
        policy = decisions.policy(layer)
        recompute = {"none": 0, "selective": core, "full": flops}.get(policy)
        if recompute is None:  # op-level or module recompute: the profile's share of the layer
            recompute = flops * rerun(policy)
        costs.append(AtomCost(name=name, flops=flops, seconds=(3 * flops + recompute) / rate,
                              state_bytes=elements * per_element,
                              activation_bytes=saved[index] * kept(policy)))
    return costs


def _kept_share(plan: Plan) -> tuple[Callable[[str], float], Callable[[str], float]]:
    """Policy -> share of a layer's saved bytes that stays saved (1 for "none"), and policy
    -> share of a layer's forward FLOPs it recomputes.

    From the memory model's per-layer activations at the plan's shape (a
    custom model's profile is read off its own graph). A model that cannot be
    profiled has its layers charged all their bytes (an upper bound).
    """
    from ptc.compiler.memory import layer_activation_bytes  # noqa: PLC0415 - sympy (slow)
    from ptc.compiler.profile import plan_profile, with_model_shape  # noqa: PLC0415

    try:
        plan = with_model_shape(plan)
        profile = plan_profile(plan)
    except (PtcError, ValueError):
        return (lambda policy: 1.0), (lambda policy: 1.0)
    from ptc.compiler.cost import policy_flops  # noqa: PLC0415
    from ptc.compiler.recompute import LAYER_POLICIES  # noqa: PLC0415

    shape = dict(micro_batch=plan.train.micro_batch, seq_len=plan.train.seq_len,
                 tp=plan.parallel.tp, sp=plan.parallel.sequence_parallel)
    policies = [p for p in LAYER_POLICIES if p not in profile.unavailable]
    bytes_of = {p: layer_activation_bytes(profile, p, **shape) for p in policies}
    layer = profile.fn["flops.layer"](plan.train.micro_batch, plan.train.seq_len)
    return ((lambda policy: bytes_of[policy] / bytes_of["none"] if bytes_of["none"] else 1.0),
            (lambda policy: policy_flops(profile, policy, plan.train.micro_batch,
                                         plan.train.seq_len) / layer if layer else 1.0))


def _saved_bytes(gm: fx.GraphModule, atoms: Sequence[Sequence[fx.Node]]) -> list[float]:
    """Bytes saved for backward per atom: each storage counts in every atom that saves it.

    A graph lowered for tp > 1 with sequence parallelism does not run in one
    process (its shapes assume the other tp ranks' gathers): then each atom
    is charged its nodes' outputs, views aside — an upper bound.
    """
    atom_of = {node.name: i for i, nodes in enumerate(atoms) for node in nodes}
    inputs = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            info = get_info(node)
            inputs.append(torch.zeros(info.shapes[0], dtype=info.dtypes[0], device="meta"))
    out = [0.0] * len(atoms)
    twins, twin_nodes = _twins(gm, atoms)
    try:
        storages = saved_storages(gm, inputs, twins=twin_nodes)
    except Exception as exc:  # any op that cannot run here: fall back to the bound
        log.info("activation bytes bounded by node outputs (%s: %s)", type(exc).__name__,
                 str(exc).splitlines()[0])
        for index, nodes in enumerate(atoms):
            out[index] = sum(get_info(n).out_bytes for n in nodes
                             if get_info(n) is not None and get_info(n).kind != "view")
        return out
    for storage in storages:
        for index in {atom_of[s] for s in storage.savers if s in atom_of}:
            out[index] += storage.nbytes
    for index, twin in twins.items():
        out[index] = out[twin]
    return out


def _twins(gm: fx.GraphModule, atoms: Sequence[Sequence[fx.Node]]
           ) -> tuple[dict[int, int], dict[str, str]]:
    """Atoms that need not run to be priced: each, by index, with the earlier atom making the
    same calls on operands alike (`call_cache.nodes_signature`: the layers after the first of
    a stack of identical ones), which saves what it would; and, by name, each of their nodes
    with its counterpart there, whose value it takes in the run."""
    first: dict[tuple, int] = {}
    twins: dict[int, int] = {}
    for index, nodes in enumerate(atoms):
        try:
            sig = nodes_signature(gm, list(nodes))
        except Unkeyable:
            continue
        twin = first.setdefault(sig, index)
        if twin != index:
            twins[index] = twin
    nodes = {node.name: twin_node.name for index, twin in twins.items()
             for node, twin_node in zip(atoms[index], atoms[twin])}
    return twins, nodes


def balance(costs: Sequence[AtomCost], cut_seconds: Sequence[float], chunks: int, *,
            pins: Mapping[int, int], units: Sequence[float], budget: float) -> Split:
    """Cut the atoms into `chunks` contiguous chunks (see the module docstring).

    `cut_seconds[a]`: transfer time of the cut after atom a. `pins`: chunk
    index -> the atom it must start with. `units[c]`: activation multiplier
    of chunk c (its share of the in-flight units of its rank). `budget`:
    bytes one chunk may use. Raises CompileError when no cut fits.
    """
    n = len(costs)
    if n < chunks:
        raise CompileError(f"the graph has {n} pieces ({', '.join(c.name for c in costs)}) and "
                           f"cannot be cut into {chunks} non-empty stages")
    seconds = _prefix([c.seconds for c in costs])
    state = _prefix([c.state_bytes for c in costs])
    act = _prefix([c.activation_bytes for c in costs])

    def time(c: int, i: int, j: int) -> float:
        edges = (cut_seconds[i - 1] if i > 0 else 0.0) + (cut_seconds[j - 1] if j < n else 0.0)
        return seconds[j] - seconds[i] + edges

    def memory(c: int, i: int, j: int) -> float:
        return state[j] - state[i] + units[c] * (act[j] - act[i])

    split = _cut(n, chunks, pins, time, lambda c, i, j: memory(c, i, j) <= budget)
    if split is None:
        least = _cut(n, chunks, pins, memory, lambda c, i, j: True)
        worst = max(range(chunks), key=lambda c: memory(c, *_bounds(least, c, n)))
        raise CompileError(
            f"no cut of the model into {chunks} pipeline stages fits the memory: the best cut "
            f"still needs {memory(worst, *_bounds(least, worst, n)) / 2**30:.2f} GiB on stage "
            f"{worst} (model state and in-flight activations) for {budget / 2**30:.2f} GiB "
            f"available; use more stages, a higher ZeRO stage, activation checkpointing or a "
            f"smaller micro-batch")
    bounds = [_bounds(split, c, n) for c in range(chunks)]
    return Split(starts=tuple(split), seconds=tuple(time(c, *b) for c, b in enumerate(bounds)),
                 memory=tuple(memory(c, *b) for c, b in enumerate(bounds)))


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _bounds(starts: Sequence[int], c: int, n: int) -> tuple[int, int]:
    return starts[c], starts[c + 1] if c + 1 < len(starts) else n


def _cut(n: int, chunks: int, pins: Mapping[int, int], cost: Callable[[int, int, int], float],
         fits: Callable[[int, int, int], bool]) -> list[int] | None:
    """Chunk starts minimising (max cost, sum of squared costs) among cuts that fit, or None."""
    inf = (float("inf"), float("inf"))
    # best[c][j]: chunks 0..c-1 cover atoms [0, j); value (max, sum of squares), and the start.
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    start = [[-1] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = (0.0, 0.0)
    for c in range(chunks):
        # Leave at least one atom for each later chunk.
        for i in range(c, n - (chunks - c) + 1):
            if best[c][i] == inf or (c in pins and pins[c] != i):
                continue
            last = n if c == chunks - 1 else n - (chunks - c - 1)
            for j in range(i + 1, last + 1):
                if c + 1 < chunks and c + 1 in pins and pins[c + 1] != j:
                    continue
                if c == chunks - 1 and j != n:
                    continue
                if not fits(c, i, j):
                    continue
                x = cost(c, i, j)
                value = (max(best[c][i][0], x), best[c][i][1] + x * x)
                if value < best[c + 1][j]:
                    best[c + 1][j], start[c + 1][j] = value, i
    if best[chunks][n] == inf:
        return None
    starts, j = [], n
    for c in range(chunks, 0, -1):
        j = start[c][j]
        starts.append(j)
    return starts[::-1]
