"""Depth by copying: a deep stack of identical layers is lowered once and stamped out.

A built-in model's layers are alike: the same modules, the same calls on
operands of the same shapes. Capturing and lowering 80 of them costs 40
times what 2 cost, node by node, for graphs that differ only in their
layer index. So the driver (`compile_plan`) captures the plan's model at
three layers — the first, one middle layer, the last — runs the
whole-graph passes on that graph, and only then gives it the plan's depth
here: the middle layer's nodes are copied once per missing layer, the
last layer moves to the end, and every copy reads the layer before it,
exactly as a graph lowered at full depth would. The pipeline split and the
per-stage passes then run on the full graph as always, and the verifier
checks it.

What a copy of layer 1 becomes at index k (`stamp_layers`):
- its `call_module` / `get_attr` targets, node names, module paths and
  layer index name layer k; each copy gets its own parameters and buffers
  (copies of layer 1's, in their shapes after the passes: tp-local);
- an operand made in layer 1 is the copy's own node; one made in layer 0
  (the input of the layer, or anything else it reads of the layer before
  it) is the node at the same place in layer k - 1; one made before the
  layers (shared tables, the embedding) stays that node;
- dropout sites (`ptc.ops.dropout`) are numbered in forward order: a copy's
  sites and every site after it move by the sites of the layers added;
- the tensor-parallel layout lists the copies' parameters as layer 1's.

A graph is stamped only where that is what full-depth lowering gives:
the three layers must run the same calls in the same order (layer index
aside), their nodes must come as three unbroken runs, no layer may read a
layer other than the one before it or the nodes before the layers, nothing
after the layers may read a layer but the last, no parameter of the middle
layer may be shared with another module, and the plan's shard rules must
treat every layer alike. Anything else raises `NotStampable`, and the
driver compiles the model at full depth instead. `representative_layers` says which
plans are lowered this way: the built-in families, 4 layers and more, and
only the whole-graph passes whose work is per layer (tensor and sequence
parallelism; context parallelism and fp8 lower at full depth).
`tests/lower/test_stamp.py` compares stamped programs with programs
lowered at full depth, node by node, over the layouts the passes handle.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import re
from collections import OrderedDict

import torch
from torch import fx, nn

from ptc.compiler.records.decisions import Decisions
from ptc.compiler.graph.lazy_code import graph_module, owner_module
from ptc.compiler.records.graph_meta import KEY
from ptc.compiler.graph.meta import get_info, graph_info, graph_record
from ptc.compiler.graph.tp_structure import matching_rule
from ptc.ops.dropout import site_attention, site_dropout
from ptc.plan import Plan

log = logging.getLogger("ptc.passes.stamp")

REPRESENTATIVE_LAYERS = 3
"""Layers captured and lowered before stamping: the first, one middle layer, the last."""
MIN_LAYERS = REPRESENTATIVE_LAYERS + 1
"""Plans with fewer layers are lowered at full depth (stamping would save nothing)."""


class NotStampable(Exception):
    """The representative graph cannot be stamped out to full depth; the message says why."""


def representative_layers(plan: Plan) -> int | None:
    """How many layers of the plan's model to capture and lower before stamping
    (REPRESENTATIVE_LAYERS), or None when the plan is compiled at full depth: a user's model,
    fewer than MIN_LAYERS layers, or a whole-graph pass whose work is not per layer (context
    parallelism, fp8)."""
    model = plan.model
    if model.family == "custom" or (model.layers or 0) < MIN_LAYERS:
        return None
    if plan.parallel.cp > 1 or plan.train.dtype == "fp8":
        return None
    return REPRESENTATIVE_LAYERS


def stamp_layers(gm: fx.GraphModule, layers: int, plan: Plan) -> fx.GraphModule:
    """A new GraphModule: `gm` (3 layers) with its middle layer copied out to `layers` layers.

    `gm` is left as it was. Raises NotStampable where copying would not give
    what lowering at full depth gives (module docstring).
    """
    capture = graph_info(gm)
    blocks = capture.blocks_path
    if blocks is None or capture.num_layers != REPRESENTATIVE_LAYERS:
        raise NotStampable(f"a graph of {REPRESENTATIVE_LAYERS} repeated blocks is stamped, "
                           f"this one has {capture.num_layers}")
    parts = _Parts.of(gm, blocks)
    _check_rules(plan, blocks, parts.middle, layers)
    stamper = _Stamper(gm, blocks, parts, layers)
    graph = stamper.graph()
    new = graph_module(stamper.root_module(), graph, type(gm).__name__)
    _keep_aliases(new, gm, blocks)
    record = graph_record(gm)
    tp = record.tensor_parallel
    if tp is not None:
        tp = dataclasses.replace(tp, params=stamper.names(tp.params),
                                 partial_grads=tuple(stamper.names(dict.fromkeys(
                                     tp.partial_grads))))
    new.meta[KEY] = dataclasses.replace(
        record, capture=dataclasses.replace(capture, num_layers=layers), tensor_parallel=tp)
    return new


def stamp_layers_pass(gm: fx.GraphModule, decisions: Decisions) -> fx.GraphModule:
    """`stamp_layers` to the plan's depth, run by the runner after the whole-graph passes.

    Logs which layers the passes before it saw: their counts are the representative's.
    """
    layers = decisions.plan.model.layers
    out = stamp_layers(gm, layers, decisions.plan)
    copies = "layer 2" if layers == 4 else f"layers 2..{layers - 2}"
    log.info("the passes above lowered layers 0, 1 and 2 of %d (their counts are of those); "
             "layer 1 copied to %s, layer 2 moved to layer %d", layers, copies, layers - 1)
    return out


@dataclasses.dataclass
class _Parts:
    """The nodes of a 3-layer graph: before the layers, each layer's, after them."""

    pre: list[fx.Node]
    layers: tuple[list[fx.Node], list[fx.Node], list[fx.Node]]
    post: list[fx.Node]

    @property
    def middle(self) -> list[fx.Node]:
        """The representative layer's nodes (layer 1)."""
        return self.layers[1]

    @classmethod
    def of(cls, gm: fx.GraphModule, blocks: str) -> _Parts:
        """Split `gm`'s nodes; NotStampable unless they come as pre, 0, 1, 2, post."""
        runs: list[tuple[int | None, list[fx.Node]]] = []
        for node in gm.graph.nodes:
            info = get_info(node)
            layer = None if info is None else info.layer
            if runs and runs[-1][0] == layer:
                runs[-1][1].append(node)
            else:
                runs.append((layer, [node]))
        order = [layer for layer, _ in runs]
        if order != [None, 0, 1, 2, None]:
            raise NotStampable(f"the nodes of {blocks} do not come as one run per layer "
                               f"(runs by layer: {order})")
        pre, l0, l1, l2, post = (nodes for _, nodes in runs)
        parts = cls(pre=pre, layers=(l0, l1, l2), post=post)
        parts._check_alike(blocks)
        parts._check_reads()
        return parts

    def _check_alike(self, blocks: str) -> None:
        """The three layers make the same calls in the same order, layer index aside."""
        rows = [[_row(node, blocks, i) for node in nodes] for i, nodes in enumerate(self.layers)]
        for i in (0, 2):
            try:
                alike = rows[i] == rows[1]
            except RuntimeError:  # a tensor constant among the operands: not compared here
                alike = False
            if not alike:
                raise NotStampable(f"layer {i} of {blocks} differs from layer 1")

    def _check_reads(self) -> None:
        """Each layer reads only itself, the layer before it and the nodes before the layers;
        the nodes after them read only the last layer among the layers."""
        before = set(self.pre)
        l0, l1, l2 = (set(nodes) for nodes in self.layers)
        allowed = ((l0, before), (l1, l0 | before), (l2, l1 | before))
        for own, (mine, reads) in zip(self.layers, allowed):
            for node in own:
                for arg in node.all_input_nodes:
                    if arg not in mine and arg not in reads:
                        raise NotStampable(f"node {node.name} reads {arg.name}, outside the "
                                           "layer before it")
        for node in self.post:
            if any(arg in l0 or arg in l1 for arg in node.all_input_nodes):
                raise NotStampable(f"node {node.name} after the layers reads a layer but the last")


def _row(node: fx.Node, blocks: str, layer: int):
    """What a layer's node does, its layer index taken out: op, target, constants, meta."""
    info = get_info(node)
    target = node.target
    if isinstance(target, str):
        target = _index_out(target, blocks, layer)
    shapes = None if info is None else (info.kind, info.shapes, info.dtypes, info.flops,
                                        info.params, _index_out(info.module_path, blocks, layer))
    args, kwargs = node.args, node.kwargs
    if _is_site(node):  # numbered in forward order: the one constant that differs by layer
        args, kwargs = _with_site(node, args, kwargs, None)
    return (node.op, target, _constants(args), _constants(kwargs), shapes)


def _with_site(node: fx.Node, args: tuple, kwargs: dict, site: int | None) -> tuple[tuple, dict]:
    """A dropout site's (args, kwargs) with its site number replaced by `site`."""
    if node.target is site_dropout:
        return (*args[:3], site, *args[4:]), kwargs
    return args, {**kwargs, "site": site}


def _constants(value):
    """`value` with every node replaced by a marker: what a node's operands hold besides nodes."""
    if isinstance(value, fx.Node):
        return "<node>"
    if isinstance(value, (list, tuple)):
        return type(value)(_constants(v) for v in value)
    if isinstance(value, dict):
        return {k: _constants(v) for k, v in value.items()}
    return value


def _index_out(text: str, blocks: str, layer: int) -> str:
    return _Renamer(blocks, layer)(text, "#")


class _Renamer:
    """Renames layer `src` in dotted paths ("layers.1.attn") and fx names ("layers_1_attn");
    each text is parsed once, then renamed to any layer by a join."""

    def __init__(self, blocks: str, src: int):
        flat_blocks = blocks.replace(".", "_")
        self._dotted = re.compile(rf"(?<![\w.]){re.escape(blocks)}\.{src}(?=\.|$)")
        self._flat = re.compile(rf"(?<!\w){re.escape(flat_blocks)}_{src}(?=_|$)")
        self._blocks, self._flat_blocks = blocks, flat_blocks
        self._parts: dict[str, list[str]] = {}

    def __call__(self, text: str, dst: int | str) -> str:
        """`text` with layer `src` named `dst`."""
        parts = self._parts.get(text)
        if parts is None:
            marked = self._dotted.sub(f"{self._blocks}.\0", text)
            parts = self._parts[text] = self._flat.sub(f"{self._flat_blocks}_\0",
                                                       marked).split("\0")
        return str(dst).join(parts)

    def to(self, dst: int):
        """The rename to layer `dst`, as a function of the text."""
        return functools.partial(self, dst=dst)


def _is_site(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (site_dropout, site_attention)


def _check_rules(plan: Plan, blocks: str, middle: list[fx.Node], layers: int) -> None:
    """NotStampable unless every shard rule treats each layer as it treats layer 1."""
    rules = plan.parallel.shards
    if not rules:
        return
    paths = {info.module_path for node in middle if (info := get_info(node)) is not None}
    rename = _Renamer(blocks, 1)
    for path in paths:
        chosen = matching_rule(path, rules)
        for k in range(layers):
            if matching_rule(rename(path, k), rules) is not chosen:
                raise NotStampable(f"a shard rule treats layer {k} of {blocks} otherwise "
                                   "than layer 1")


class _Stamper:
    """Builds the full-depth graph and the attributes it reads."""

    def __init__(self, gm: fx.GraphModule, blocks: str, parts: _Parts, layers: int):
        self.gm, self.blocks, self.parts, self.layers = gm, blocks, parts, layers
        self.root: dict[str, object] = {}
        self.sites = sum(_is_site(node) for node in parts.middle)
        middle = self._own_module()
        # each copy's attributes: layer 1's module tree with meta tensors of its own
        self._copies = {k: _fresh_module(middle, {}) for k in range(2, layers - 1)}

    def _own_module(self) -> nn.Module:
        """Layer 1's module, checked to share no tensor with the rest of the graph and to hold
        only meta tensors (each copy gets new empty ones)."""
        middle = self.gm.get_submodule(f"{self.blocks}.1")
        inside = {id(t): t for t in (*middle.parameters(), *middle.buffers())}
        if any(not t.is_meta for t in inside.values()):
            raise NotStampable(f"layer 1 of {self.blocks} holds tensors off the meta device")
        prefix = f"{self.blocks}.1."
        if any(id(t) in inside for name, t in (
                *self.gm.named_parameters(remove_duplicate=False),
                *self.gm.named_buffers(remove_duplicate=False)) if not name.startswith(prefix)):
            raise NotStampable(f"layer 1 of {self.blocks} shares a tensor with another module")
        return middle

    def graph(self) -> fx.Graph:
        """The full-depth graph: pre, layers 0 and 1, the copies, the last layer, post."""
        graph = fx.Graph()
        graph._codegen = self.gm.graph._codegen
        env: dict[fx.Node, fx.Node] = {}
        last = self.layers - 1
        for node in self.parts.pre + self.parts.layers[0] + self.parts.middle:
            env[node] = self._copy(graph, node, env, rename=None, layer=None, shift=0)
        previous = {a: b for a, b in zip(self.parts.layers[0], self.parts.middle)}
        layer_env = {n: env[n] for n in self.parts.middle}
        middle = _Renamer(self.blocks, 1)
        for k in range(2, last):
            # the layer before this one: what layer 1 read of layer 0, this copy reads of it
            mine = {**env, **{a: layer_env[b] for a, b in previous.items()}}
            rename = middle.to(k)
            for node in self.parts.middle:
                mine[node] = self._copy(graph, node, mine, rename=rename, layer=k,
                                        shift=(k - 1) * self.sites)
            layer_env = {node: mine[node] for node in self.parts.middle}
        # the last layer reads the last copy where it read layer 1
        outer = {**env, **layer_env}
        shift = (last - 2) * self.sites
        rename = _Renamer(self.blocks, 2).to(last)
        for node in self.parts.layers[2]:
            outer[node] = self._copy(graph, node, outer, rename=rename, layer=last, shift=shift)
        for node in self.parts.post:
            outer[node] = self._copy(graph, node, outer, rename=None, layer=None, shift=shift)
        return graph

    def _copy(self, graph: fx.Graph, node: fx.Node, env: dict, *, rename, layer: int | None,
              shift: int) -> fx.Node:
        """`node` in `graph`, its operands through `env`, renamed to layer `layer`."""
        args = fx.map_arg(node.args, env.__getitem__)
        kwargs = fx.map_arg(node.kwargs, env.__getitem__)
        if shift and _is_site(node):
            site = node.args[3] if node.target is site_dropout else node.kwargs["site"]
            args, kwargs = _with_site(node, args, kwargs, site + shift)
        target = node.target
        if node.op in ("get_attr", "call_module"):
            new_target = rename(target) if rename else target
            self.root[new_target] = self._attribute(new_target, target, layer)
            target = new_target
        name = rename(node.name) if rename else node.name
        new = graph.create_node(node.op, target, args, kwargs, name=name, type_expr=node.type)
        new.meta = self._meta(node, rename, layer)
        return new

    def root_module(self) -> nn.Module:
        """A module holding every attribute the graph reads, placed in the graph's order (as
        a GraphModule built from the model places them)."""
        root = nn.Module()
        for target, value in self.root.items():
            _place(*owner_module(root, target), value)
        return root

    def _attribute(self, target: str, source: str, layer: int | None):
        """The module or tensor `target` names: a copy's own, else `gm`'s under `source`."""
        if layer in self._copies:
            rest = target.removeprefix(f"{self.blocks}.{layer}.")
            module = self._copies[layer]
            owner, _, leaf = rest.rpartition(".")
            return getattr(module.get_submodule(owner) if owner else module, leaf)
        owner, _, leaf = source.rpartition(".")
        return getattr(self.gm.get_submodule(owner) if owner else self.gm, leaf)

    def _meta(self, node: fx.Node, rename, layer: int | None) -> dict:
        meta = dict(node.meta)
        if rename is None:
            return meta
        info = get_info(node)
        if info is not None:
            meta[KEY] = dataclasses.replace(info, layer=layer,
                                            module_path=rename(info.module_path))
        stack = meta.get("nn_module_stack")
        if stack is not None:
            meta["nn_module_stack"] = OrderedDict(
                (rename(key), (rename(path), kind)) for key, (path, kind) in stack.items())
        return meta

    def names(self, by_name: dict) -> dict:
        """`by_name` (parameter name -> value) with layer 1's entries copied to each stamped
        layer, right after layer 1's, and layer 2's renamed to the last layer."""
        last = self.layers - 1
        middle = [name for name in by_name if name.startswith(f"{self.blocks}.1.")]
        to_last = _Renamer(self.blocks, 2).to(last)
        out = {}
        for name, value in by_name.items():
            out[to_last(name) if name.startswith(f"{self.blocks}.2.") else name] = value
            if middle and name == middle[-1]:
                rename = _Renamer(self.blocks, 1)
                for k in range(2, last):
                    out.update((rename(n, k), by_name[n]) for n in middle)
        return out


def _fresh_module(module: nn.Module, made: dict[int, object]) -> nn.Module:
    """A copy of `module`'s tree with new empty meta tensors in place of its own (ties kept:
    `made` maps what was copied to its copy). Cheaper than copy.deepcopy by far."""
    if id(module) in made:
        return made[id(module)]
    new = object.__new__(type(module))
    made[id(module)] = new
    # its own hook dicts, buffer-persistence set and the like: nothing one copy changes
    # reaches another
    object.__setattr__(new, "__dict__", {
        key: copy.copy(value) if isinstance(value, (dict, set)) else value
        for key, value in module.__dict__.items()})
    new._parameters = {name: _fresh_tensor(t, made) for name, t in module._parameters.items()}
    new._buffers = {name: _fresh_tensor(t, made) for name, t in module._buffers.items()}
    new._modules = {name: None if m is None else _fresh_module(m, made)
                    for name, m in module._modules.items()}
    return new


def _fresh_tensor(t, made: dict[int, object]):
    if t is None:
        return None
    if id(t) not in made:
        fresh = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
        made[id(t)] = nn.Parameter(fresh, t.requires_grad) if isinstance(t, nn.Parameter) \
            else fresh
    return made[id(t)]


def _place(owner: nn.Module, leaf: str, value) -> None:
    if isinstance(value, nn.Parameter):
        owner.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        owner.register_buffer(leaf, value)
    else:
        owner.add_module(leaf, value)


def _keep_aliases(new: fx.GraphModule, gm: fx.GraphModule, blocks: str) -> None:
    """Hold in `new` every other name `gm` holds one of its parameters under (a tied
    weight's: capture's `keep_tied_names`), in `gm`'s order; layers 1 and 2 have no other
    names (`_Stamper._own_module`, `_Parts`)."""
    held = {id(p) for p in new.parameters()}
    have = {name for name, _ in new.named_parameters(remove_duplicate=False)}
    moved = (f"{blocks}.1.", f"{blocks}.2.")
    for name, param in gm.named_parameters(remove_duplicate=False):
        if name in have or id(param) not in held or name.startswith(moved):
            continue
        owner, leaf = owner_module(new, name)
        owner.register_parameter(leaf, param)
