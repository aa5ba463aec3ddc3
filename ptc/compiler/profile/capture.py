"""Profiling one layer: the plan's model built at one layer on meta, captured, and read
as regions (pre, layer, post) whose quantities `measure` and `fit` turn into a profile."""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from ptc.compiler.graph.meta import get_info, graph_info
from ptc.compiler.graph.nodes import (GROUPED_MM_OPS, attention_parts, is_embedding, is_linear,
                                      linear_weight, node_shape, op_name)
from ptc.compiler.graph.recompute_regions import EXTRA_POLICIES, recompute_regions
from ptc.compiler.graph.work import runs_causal_kernel
from ptc.compiler.graph.tp_structure import (COLWISE, ROWWISE, VOCAB, Sharding, infer_sharding,
                                             rule_paths)
from ptc.compiler.profile.classes import (is_saved_term, saved_classes, tp_regions,
                                          with_gathered_copies)
from ptc.compiler.profile.fit import (fit_gemms, fit_polynomial, fit_work, profile_functions,
                                      profile_points, work_points)
from ptc.compiler.profile.measure import measure_saved, measure_work
from ptc.compiler.profile.models import model_source
from ptc.compiler.profile.regions import layer_nodes, node_regions
from ptc.compiler.profile.types import DTYPES, SAVED_REGIONS, ModelProfile, ParamGroups, b, s
from ptc.errors import CompileError, PtcError
from ptc.plan import ModelSpec, ShardRule


def profile_one_layer(spec: ModelSpec, dtype: str, shards: tuple[ShardRule, ...],
                      fp8_recipe: str = "tensorwise") -> ModelProfile:
    """Capture the model at seven (b, s) points and fit every term; a built-in family with
    one layer, a custom model whole (its first layer stands for the others). `shards`: the
    rules that override how tensor parallelism splits a linear (`infer_sharding`);
    `fp8_recipe`: how dtype "fp8"'s float8 linears scale (what they keep and cast)."""
    from ptc.compiler.capture import capture  # noqa: PLC0415 - capture needs the model zoo
    custom = spec.family == "custom"
    model = model_source().build(spec if custom else dataclasses.replace(spec, layers=1),
                                 "meta")
    config = getattr(model, "config", None)  # a transformers model says how long it may be
    max_seq = spec.max_seq or getattr(config, "max_position_embeddings", None)
    points = profile_points(max_seq or 64)
    samples, first = [], None
    recipe = fp8_recipe if dtype == "fp8" else None
    work_samples: dict[tuple[int, int], dict[str, int]] = {}
    gemm_samples: dict[tuple[int, int], dict[str, list]] = {}
    for pb, ps in dict.fromkeys(points + work_points(points)):  # each graph measured first
        gm = capture(model, micro_batch=pb, seq_len=ps, dtype=DTYPES[dtype],
                     buffers_as_built=True)  # as the runtime binds them
        split = infer_sharding(gm, shards)
        if (pb, ps) in points:
            samples.append(measure_saved(gm, split, fp8=recipe))
            gathered = with_gathered_copies(gm, split)
            if gathered is not None:
                samples[-1].update({f"sp:{name}": value for name, value in measure_saved(
                    gathered, split, fp8=recipe).items() if is_saved_term(name)})
        work_samples[pb, ps], gemm_samples[pb, ps] = measure_work(gm, split, fp8=recipe)
        if first is None:  # a custom model whose shape cannot be read says so before the rest
            if custom and not graph_info(gm).num_layers:
                raise PtcError(f"model \"{spec.factory}\": ptc finds no stack of like layers "
                               f"(a ModuleList of blocks) in {type(model).__name__}, and its "
                               "memory and cost models price a model layer by layer, so ptc "
                               "cannot predict its memory or step time; compile, inspect and "
                               "run work without predictions")
            unlike = custom and _layers_unlike(gm)
            if unlike:
                raise PtcError(f"model \"{spec.factory}\": its layers are not alike ({unlike}), "
                               "and ptc's memory and cost models price every layer as its "
                               "first, so ptc cannot predict its memory or step time; compile, "
                               "inspect and run work without predictions")
            first, sharding = gm, split
            shape = graph_shape(gm, dataclasses.replace(spec, max_seq=max_seq),
                                infer_sharding(gm)) \
                if custom else spec
    fit = {name: fit_polynomial(points[:6], [smp[name] for smp in samples[:6]]) for name in samples[0]}
    pb, ps = points[6]
    bad = [name for name, poly in fit.items() if poly.subs({b: pb, s: ps}) != samples[6][name]]
    work, work_b1, bad_work = fit_work(points, work_samples)
    gemms, gemms_b1 = fit_gemms(points, gemm_samples)
    for name in bad + bad_work:  # the last point of each fit checks its polynomial form
        if custom:
            what = "work on the device" if name in bad_work else "saved activations"
            raise PtcError(f"model \"{spec.factory}\": its {what} ({name}) is "
                           "not the polynomial in micro-batch and sequence length that "
                           "ptc's memory and cost models fit, so ptc cannot predict its memory "
                           "or step time; compile, inspect and run work without predictions")
        raise ValueError(f"profile term {name} is not polynomial in b, s of the expected degree")
    params, tied_elements = _param_groups(first, sharding)
    tp_entries, tp_exits = tp_regions(first, sharding, shape.hidden)
    saved = {r: saved_classes(fit, r) for r in SAVED_REGIONS}
    policies = [p for p in EXTRA_POLICIES if f"{p}.tp" in fit]
    sp_saved = {r: saved_classes(fit, f"sp:{r}") for r in (*SAVED_REGIONS, *policies)
                if f"sp:{r}.tp" in fit}
    unavailable = _unavailable(first)
    blocks = graph_info(first).blocks_path
    layer_paths = tuple(sorted(f"{blocks}.{{}}.{p[len(blocks) + 3:]}" for p in rule_paths(first)
                               if blocks and p.startswith(f"{blocks}.0.")))
    profile = ModelProfile(
        layers=1, hidden=shape.hidden, heads=shape.heads, kv_heads=shape.num_kv_heads,
        vocab=shape.vocab,
        dtype_bytes=DTYPES[dtype].itemsize,
        saved={r: saved[r] for r in ("pre", "layer", "post")}, layer_output=saved["out"],
        output_unsaved=saved["out_unsaved"], input_unsaved=saved["in_unsaved"],
        flops={r: fit[f"{r}.flops"] for r in ("pre", "layer", "post")},
        core_flops=fit["core.flops"], kv_flops=fit["kv.flops"], fp8_flops=fit["fp8.flops"],
        work=work, work_b1=work_b1, causal_kernel=runs_causal_kernel(first),
        gemms=gemms, gemms_b1=gemms_b1,
        policy_saved={p: saved_classes(fit, p) for p in policies},
        policy_flops={p: fit[f"{p}.flops"] for p in policies},
        policy_gathers={p: int(fit[f"{p}.gathers"]) for p in policies},
        tp_entries=tp_entries, tp_exits=tp_exits, sp_gathered=fit["sp.gathered"],
        sp_scattered=fit["sp.scattered"], sp_saved=sp_saved,
        holds_input=frozenset({"full", *(p for p in policies if fit[f"{p}.holds"])}),
        unavailable=unavailable, layer_paths=layer_paths, params=params, tied=tied_elements > 0,
        tied_elements=tied_elements, **_routing(first),
        boundary_elements=b * s * shape.hidden,
        shape=shape if custom else None)
    return dataclasses.replace(profile, fn=profile_functions(profile))


def _routing(gm: torch.fx.GraphModule) -> dict[str, int]:
    """The first layer's routed experts: rows per token they compute (the top-k: the rows
    of its first grouped product over the tokens of the capture) and how many there are
    (dim 0 of the stack it multiplies by); zeros without one."""
    record = graph_info(gm)
    for n in gm.graph.nodes:
        info = get_info(n)
        if info is not None and info.layer == 0 and op_name(n) in GROUPED_MM_OPS:
            rows = node_shape(n.args[0])[0]
            return {"routed_rows": rows // (record.micro_batch * record.seq_len),
                    "routed_experts": gm.get_parameter(linear_weight(n)).shape[0]}
    return {"routed_rows": 0, "routed_experts": 0}


def _layers_unlike(gm: torch.fx.GraphModule) -> str | None:
    """How the first layer of a model captured whole differs from another in the parameters
    it reads (a dense first layer before mixture-of-experts ones, convolution layers among
    attention ones), or None when all read as many. Layers that differ only in their ops
    (one without RoPE, a sliding window) are priced as the first."""
    params: dict[int, int] = {}
    for n in gm.graph.nodes:
        info = get_info(n)
        if info is not None and info.layer is not None:
            params[info.layer] = params.get(info.layer, 0) + (info.params or 0)
    first = params.get(0, 0)
    other = next((layer for layer, count in sorted(params.items()) if count != first), None)
    if other is None:
        return None
    return (f"layer 0 reads {first:,} parameter elements, layer {other} "
            f"{params[other]:,}")


def graph_shape(gm: torch.fx.GraphModule, spec: ModelSpec, sharding: Sharding) -> ModelSpec:
    """`spec` with the shape numbers a captured graph shows: layers, hidden size, heads and
    key/value heads of the first attention, MLP inner size, vocabulary (a custom model's
    plan names none of them); `sharding`: the split the graph implies (`infer_sharding`)."""
    info = graph_info(gm)
    attention = next((p for n in gm.graph.nodes if (p := attention_parts(n)) is not None), None)
    q = node_shape(attention.q) if attention is not None else None
    k = node_shape(attention.k) if attention is not None else None
    hidden = ffn = None
    projections = []  # the first attention's q/k/v linears: output features each
    for n in gm.graph.nodes:
        path = is_linear(n) or is_embedding(n)
        style, why = sharding.styles.get(path), sharding.why.get(path, "")
        if hidden is None and style == VOCAB and is_embedding(n):
            hidden = node_shape(n)[-1]
        if ffn is None and why == "MLP output projection":
            ffn = node_shape(n.args[0])[-1]
        if why.startswith("attention q/k/v") and get_info(n).layer == 0:
            projections.append(node_shape(n)[-1])
    if hidden is None or q is None:
        raise PtcError(f"model \"{spec.factory}\": no token embedding or attention found in its "
                       "graph, so ptc cannot predict its memory or step time; compile, inspect "
                       "and run work without predictions")
    heads, head_dim = q[-3], q[-1]
    # Key/value heads from the projections (the attention may see them repeated): k's
    # features, or what a fused qkv holds besides q's.
    kv_features = projections[1] if len(projections) == 3 else \
        (projections[0] - heads * head_dim) // 2 if len(projections) == 1 else None
    kv_heads = kv_features // head_dim if kv_features else (k[-3] if k is not None else None)
    return dataclasses.replace(spec, layers=info.num_layers, hidden=hidden, heads=heads,
                               kv_heads=kv_heads, ffn=ffn,
                               vocab=info.vocab, max_seq=spec.max_seq or info.seq_len)


def _unavailable(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Policies of EXTRA_POLICIES layer 0 cannot take -> the CompileError's message."""
    nodes, out = layer_nodes(gm, node_regions(gm)), {}
    for policy in EXTRA_POLICIES:
        try:
            recompute_regions(nodes, policy, 0)
        except CompileError as err:
            out[policy] = str(err)
    return out


def _param_groups(gm: torch.fx.GraphModule,
                  sharding: Sharding) -> tuple[dict[str, ParamGroups], int]:
    """Parameter elements per region ("layer": layer 0's), split or replicated as tensor
    parallelism splits them, and the elements of a head tied to the embedding."""
    region = node_regions(gm)
    readers: dict[str, list[str]] = {}  # parameter name -> regions of the nodes reading it
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            readers.setdefault(str(n.target), []).extend(region[u.name] for u in n.users)
        elif n.op == "call_module":
            for leaf, _ in gm.get_submodule(str(n.target)).named_parameters():
                readers.setdefault(f"{n.target}.{leaf}", []).append(region[n.name])
    by_id: dict[int, list[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    order = ("pre", "layer", "later", "post")
    groups = {r: [0, 0, 0, 0, 0, 0] for r in ("pre", "layer", "post")}
    stacks = {linear_weight(n) for n in gm.graph.nodes if op_name(n) in GROUPED_MM_OPS}
    tied_elements = 0
    for names in by_id.values():
        found = [r for name in names for r in readers.get(name, [])]
        if not found:
            continue
        where = min(found, key=order.index)
        if where == "later":
            continue
        numel = gm.get_parameter(names[0]).numel()
        if len(names) > 1 and len({r for r in found}) > 1:
            tied_elements = numel  # a head tied to the embedding: counted with the embedding
        # by module path, or by the parameter's own name (a stack of expert weights)
        styles = {sharding.styles.get(name, sharding.styles.get(name.rpartition(".")[0]))
                  for name in names}
        # A row-parallel linear's weight is split (an expert stack's too, whatever its
        # name); its bias, one vector, is replicated.
        split = bool(styles & {COLWISE, VOCAB}) or (
            ROWWISE in styles and gm.get_parameter(names[0]).dim() > 1)
        g = groups[where]
        g[0 if split else 1] += numel
        g[2] += 1
        if any(name in stacks for name in names):
            g[4 if split else 5] += numel
        if split and any(name.rpartition(".")[0] in sharding.kv_projections
                         for name in names):
            g[3] += numel
    return {r: ParamGroups(*g) for r, g in groups.items()}, tied_elements
