"""Measuring a captured layer at one (b, s) point: the bytes each recompute policy saves
by class, and the work (GEMM, attention, memory-bound, op counts) each region runs."""

from __future__ import annotations

import torch
import torch.fx

from ptc.compiler.graph.activations import saved_and_output_storages
from ptc.compiler.graph.gemm_tiles import split_dim
from ptc.compiler.graph.meta import get_info
from ptc.compiler.graph.nodes import attention_parts, linear_in_dim, linear_out_dim, linear_weight
from ptc.compiler.graph.recompute_regions import (EXTRA_POLICIES, attention_cores, is_matmul,
                                                  recompute_regions)
from ptc.compiler.graph.tp_structure import COLWISE, ROWWISE, VOCAB, Sharding
from ptc.compiler.graph.work import GemmCall, graph_work
from ptc.compiler.profile.classes import (kv_nodes, linear_styles, saved_whole, sp_moves,
                                          tp_sharded, whole_under_sp)
from ptc.compiler.profile.fp8 import fp8_casts, fp8_gemms as find_fp8_gemms, kept_as, \
    with_fp8_copies
from ptc.compiler.profile.regions import (boundary_nodes, layer_nodes, meta_inputs, node_regions,
                                          placeholder_names)
from ptc.compiler.profile.types import (COUNTS, SAVED_CLASS_TERMS, SAVED_REGIONS, WORK_CLASSES,
                                        WORK_QUANTITIES, WORK_REGIONS)
from ptc.errors import CompileError


def measure_saved(gm: torch.fx.GraphModule, sharding: Sharding, *,
             fp8: str | None = None) -> dict[str, int]:
    """Saved bytes by region and class, and FLOPs by region, of one capture split as
    `sharding` says; `fp8`: the `train.fp8_recipe` whose float8 GEMMs save their inputs
    as train dtype "fp8" runs them (`with_fp8_copies`), None when not fp8."""
    region, sharded = node_regions(gm), tp_sharded(gm, sharding)
    # What selective recompute reruns: the regions the activation_checkpoint pass makes.
    core = {n.name for c in attention_cores(layer_nodes(gm, region)) for n in c}
    kv_path = kv_nodes(gm, sharding, sharded)
    out = {f"{r}.{c}": 0 for r in SAVED_REGIONS
           for c in SAVED_CLASS_TERMS}
    whole = whole_under_sp(gm, sharded)
    placeholders = placeholder_names(gm)
    storages, outputs = saved_and_output_storages(gm, meta_inputs(gm),
                                                  held=boundary_nodes(gm, region))
    fp8_gemms = find_fp8_gemms(gm, fp8)
    for st in storages:
        nbytes = with_fp8_copies(st, fp8_gemms)
        cls = "tp" if st.producer in sharded else "seq"
        split_scales = kept_as(st, fp8_gemms, st.savers)[2] if cls == "tp" else 0
        # A graph input (targets) belongs where it is used.
        r = region[st.savers[0] if st.producer in placeholders and st.savers
                   else st.producer]
        if r == "later":  # layers after the first are alike: layer 0 stands for them
            continue
        kept_after = [x for x in st.savers if region[x] != "layer"]
        if not st.savers:  # held by a fully recomputed layer's checkpoint, as its input
            targets = ("out", "out_unsaved") if r == "layer" else ("in_unsaved",)
        elif r == "layer" and (kept_after or st.held):
            # Kept after the layer: by a node after it, or as the next layer's input.
            targets = (r, "out") if kept_after else (r, "out", "out_unsaved")
        else:
            targets = (r,)
        # Selective recompute drops what the core saves of what it makes; a saver after the
        # core still keeps the storage (or, a float8 GEMM, its own copy of it).
        dropped = nbytes - with_fp8_copies(st, fp8_gemms, [x for x in st.savers
                                                              if x not in core]) \
            if st.producer in core else 0
        kept_whole = st.producer in placeholders or saved_whole(st, whole)
        for target in targets:
            if kept_whole:  # token ids, targets, a whole module's: whole on every tp rank
                out[f"{target}.whole"] += nbytes
                out[f"{target}.core_whole"] += dropped
            for c in (cls, "kv") if st.producer in kv_path else (cls,):
                out[f"{target}.{c}"] += nbytes
                out[f"{target}.core_{c}"] += dropped
            out[f"{target}.split_const"] += split_scales
    # Selective recompute keeps the core's inputs, whether or not backward saved them: the
    # storages they view (a transposed v is its projection's output) that nothing saves.
    saved_keys, added = {st.key for st in storages if st.savers}, set()
    for n in gm.graph.nodes:
        if n.name in core or n.op in ("get_attr", "placeholder") or region[n.name] == "later" \
                or not any(u.name in core for u in n.users):
            continue
        for key, (nbytes, producer) in outputs.get(n.name, {}).items():
            if key in saved_keys or key in added or region.get(producer) != region[n.name]:
                continue
            added.add(key)
            cls = "tp" if producer in sharded else "seq"
            for c in (cls, "kv") if producer in kv_path else (cls,):
                out[f"{region[n.name]}.core_{c}"] -= nbytes
            if producer in whole or any(u.name in whole for u in n.users if u.name in core):
                out[f"{region[n.name]}.core_whole"] -= nbytes
    out.update(sp_moves(gm, region, sharded, whole))
    whole_keys = {st.key for st in storages if saved_whole(st, whole)} | {
        key for name in whole for key in outputs.get(name, {})}
    out.update(_policy_terms(gm, storages, outputs, region, sharded, kv_path, sharding,
                             whole_keys, fp8_gemms))
    out.update({f"{r}.flops": 0 for r in ("pre", "layer", "post", "core", "kv", "fp8")})
    for n in gm.graph.nodes:
        info = get_info(n)
        if info is not None and info.flops and region[n.name] != "later":
            out[f"{region[n.name]}.flops"] += info.flops
            if n.name in core and region[n.name] == "layer":
                out["core.flops"] += info.flops
            if n.name in kv_path and region[n.name] == "layer":
                out["kv.flops"] += info.flops
            if n.name in fp8_gemms and region[n.name] == "layer":
                out["fp8.flops"] += info.flops
    return out


def _policy_terms(gm: torch.fx.GraphModule, storages, outputs, region: dict[str, str],
                  sharded: set[str], kv_path: set[str], sharding: Sharding,
                  whole_keys: set[int], fp8_gemms: set[str]) -> dict[str, int]:
    """Per policy of EXTRA_POLICIES layer 0 can take: the bytes of the storages layer 0
    makes that stay kept under it, by class (`{policy}.tp`, `.seq`, `.kv`, `.whole`), the
    FLOPs it recomputes (`.flops`), whether a region reads the layer's input (`.holds`) and
    how many inputs of column-parallel linears its regions recompute (`.gathers`).

    Kept: what a node outside the regions saves, each region's inputs (torch's
    checkpoint holds them) and a saving region's matmul outputs, with the
    log-sum-exp of a fused attention kernel: its selective checkpoint caches
    every output of those aten ops (not the operand copies a batched matmul
    makes around its bmm: they are recomputed).
    """
    nodes, out = layer_nodes(gm, region), {}
    crossing = boundary_nodes(gm, region)
    styles = linear_styles(gm, sharding)
    rowwise = {name for name, style in styles.items() if style == ROWWISE}
    for policy in EXTRA_POLICIES:
        try:
            regions = recompute_regions(nodes, policy, 0)
        except CompileError:
            continue
        inside = {n.name for r in regions for n in r.nodes}
        kept_nodes = {n.name for r in regions if r.saving for n in r.nodes if is_matmul(n)}
        read = {a.name for r in regions for n in r.nodes for a in n.all_input_nodes
                if a not in r.nodes and a.op != "get_attr"}
        # Per storage: its bytes kept whole, and the float8 copies the GEMMs after the
        # regions keep of it (`with_fp8_copies`).
        whole_kept: dict[int, tuple[int, str]] = {}
        copies: dict[int, tuple[int, str]] = {}
        split_scales: dict[int, tuple[int, str]] = {}
        for st in storages:
            after = [x for x in st.savers if x not in inside]
            if not after:
                continue
            whole, copy_bytes, split = kept_as(st, fp8_gemms, after)
            if whole:
                whole_kept[st.key] = (st.nbytes, st.producer)
            if copy_bytes:
                copies[st.key] = (copy_bytes, st.producer)
                split_scales[st.key] = (split, st.producer)
        for name in read | kept_nodes:  # the regions' inputs and kept matmul outputs
            whole_kept.update(outputs.get(name, {}))
        kernels = {n.name for r in regions if r.saving for n in r.nodes
                   if (parts := attention_parts(n)) is not None and parts.fused}
        whole_kept.update({st.key: (st.nbytes, st.producer) for st in storages
                           if st.internal and st.producer in kernels})
        kept = [*whole_kept.items(), *copies.items()]
        terms = dict.fromkeys(SAVED_CLASS_TERMS, 0)
        for key, (nbytes, producer) in kept:
            if region.get(producer) != "layer":
                continue
            terms["tp" if producer in sharded else "seq"] += nbytes
            if producer in kv_path:
                terms["kv"] += nbytes
            if (producer in rowwise and producer in kept_nodes  # before its reduce-scatter
                    or key in whole_keys):  # a whole module's (`whole_under_sp`)
                terms["whole"] += nbytes
        terms["split_const"] = sum(split for split, producer in split_scales.values()
                                   if region.get(producer) == "layer" and producer in sharded)
        out.update({f"{policy}.{c}": v for c, v in terms.items()})
        out[f"{policy}.flops"] = sum(get_info(n).flops for r in regions for n in r.nodes
                                     if get_info(n) is not None and n.name not in kept_nodes)
        out[f"{policy}.holds"] = int(bool(read & crossing) and any(
            region[name] != "layer" for name in read))
        members = {n.name for r in regions for n in r.nodes}
        out[f"{policy}.gathers"] = len({n.args[0].name for n in nodes
                                        if styles.get(n.name) == COLWISE and n.name in members
                                        and isinstance(n.args[0], torch.fx.Node)
                                        and n.args[0].name in inside})
    return out


def _reruns(gm: torch.fx.GraphModule, region: dict[str, str]) -> dict[str, set[str]]:
    """Per policy of EXTRA_POLICIES layer 0 can take: the nodes its recompute reruns (every
    node of its regions but a saving region's matmuls, whose outputs are kept)."""
    nodes, out = layer_nodes(gm, region), {}
    for policy in EXTRA_POLICIES:
        try:
            regions = recompute_regions(nodes, policy, 0)
        except CompileError:
            continue
        out[policy] = {n.name for r in regions for n in r.nodes
                       if not (r.saving and is_matmul(n))}
    return out


def measure_work(gm: torch.fx.GraphModule, sharding: Sharding, *, fp8: str | None = None
          ) -> tuple[dict[str, int], dict[str, list[tuple[GemmCall, frozenset[str], str | None]]]]:
    """Forward and backward device work by region and class (`ModelProfile.work`), split
    as `sharding` says; and per "{region}.{phase}" its GEMMs, each with its node's classes
    and the dimension tensor parallelism divides (`gemm_tiles.split_dim`). `fp8`: the
    `train.fp8_recipe` whose quantisations the layers' linears run beside their GEMMs as
    train dtype "fp8" runs them (`fp8_casts`), None when not fp8."""
    region, sharded = node_regions(gm), tp_sharded(gm, sharding)
    core = {n.name for c in attention_cores(layer_nodes(gm, region)) for n in c}
    reruns = _reruns(gm, region)
    kv_path = kv_nodes(gm, sharding, sharded)
    styles = linear_styles(gm, sharding)
    split = sharded | {name for name, style in styles.items() if style == ROWWISE}
    whole = whole_under_sp(gm, sharded)
    fp8_gemms = find_fp8_gemms(gm, fp8)
    out = {f"work.{r}.{ph}.{q}.{c}": 0 for r in WORK_REGIONS for ph in ("fwd", "bwd")
           for q in WORK_QUANTITIES for c in WORK_CLASSES if q not in COUNTS or c == "all"}
    out.update({f"work.{rerun_region(p)}.fwd.{q}.{c}": 0 for p in reruns
                for q in WORK_QUANTITIES for c in WORK_CLASSES if q not in COUNTS or c == "all"})
    gemms: dict[str, list[tuple[GemmCall, frozenset[str], str | None]]] = {}
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, node_work in graph_work(gm, meta_inputs(gm)).items():
        r = region.get(name, "post")
        if r == "later":
            continue
        targets = (r, "core") if r == "layer" and name in core else (r,)
        classes = ("all", *(("tp",) if name in split else ()),
                   *(("kv",) if name in kv_path else ()), *(("whole",) if name in whole else ()))
        reran = [rerun_region(p) for p, names in reruns.items() if name in names]
        split_by = _split_weight(gm, nodes[name], styles.get(name)) if name in nodes \
            else (None, None, None)
        for ph, w, calls in (("fwd", node_work.forward, node_work.forward_gemms),
                             ("bwd", node_work.backward, node_work.backward_gemms)):
            values = {"gemm": w.gemm, "attn": w.attention, "mem": w.memory,
                      "fmem": w.fused_memory, "ops": w.ops, "kern": w.kernels}
            if name in fp8_gemms and node_work.forward_gemms:
                for q, value in fp8_casts(node_work.forward_gemms[0], ph, fp8,
                                          fp8_gemms.experts.get(name, 1)).items():
                    values[q] += value
            shaped = [(call, frozenset(classes) - {"all"}, split_dim(call, *split_by))
                      for call in calls]
            for target in (*targets, *(reran if ph == "fwd" else ())):
                for q, value in values.items():
                    for c in classes if q not in COUNTS else ("all",):
                        out[f"work.{target}.{ph}.{q}.{c}"] += int(value)
                gemms.setdefault(f"{target}.{ph}", []).extend(shaped)
    return out, gemms


def _split_weight(gm: torch.fx.GraphModule, node: torch.fx.Node, style: str | None
                  ) -> tuple[str | None, int | None, tuple[int, ...] | None]:
    """(weight name, the dimension of it tensor parallelism splits, its shape) of a linear
    that `style` splits; Nones for any other node (`gemm_tiles.split_dim`)."""
    weight = linear_weight(node)
    out_dim = linear_out_dim(node) if weight else None
    if style not in (COLWISE, ROWWISE, VOCAB) or out_dim is None:
        return None, None, None
    try:
        shape = tuple(gm.get_parameter(weight).shape)
    except AttributeError:
        return None, None, None
    return weight, out_dim if style != ROWWISE else linear_in_dim(node), shape


def rerun_region(policy: str) -> str:
    """The `ModelProfile.work` region of what recomputing one layer under `policy` (one of
    EXTRA_POLICIES) reruns, forward only."""
    return f"rerun[{policy}]"
