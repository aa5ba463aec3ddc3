"""`resolve`: the plan's open choices made once for a captured graph, before any pass,
into the Decisions record (`ptc.compiler.records.decisions`, whose docstring says what is
decided where); the cost model runs here, once per compile."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import fx

from ptc.compiler.cost.step_sync import guard_folds
from ptc.compiler.graph.meta import graph_info
from ptc.compiler.graph.recompute_regions import LAYER_POLICIES
from ptc.compiler.records.decisions import Decisions
from ptc.errors import CompileError, PtcError, UnpricedError
from ptc.plan import DTYPE_BYTES, Plan, is_auto_checkpoint

if TYPE_CHECKING:
    from ptc.compiler.records.estimate import Estimate


log = logging.getLogger("ptc.compiler")

POLICIES = LAYER_POLICIES
"""Recompute policies of a layer (`ptc.compiler.graph.recompute_regions`)."""


def resolve(gm: fx.GraphModule, plan: Plan) -> Decisions:
    """Make the plan's open choices for the captured graph `gm` (see the module docstring).

    Raises CompileError when checkpoint = auto cannot fit a stage even with
    every layer fully recomputed: compiling such a plan would only fail
    later, out of memory.
    """
    from ptc.compiler.search.estimate import \
        balanced_cut  # noqa: PLC0415 - profiles the model (sympy)

    if not plan.is_resolved:
        raise CompileError("compiling needs a resolved plan: tp, pp and dp must not be auto")
    layers = graph_info(gm).num_layers
    priced, unpriced = None, None
    try:
        _check_priced_model(gm, plan)
        plan, priced = balanced_cut(plan)
    except (PtcError, ValueError) as exc:
        priced, unpriced = None, f"no predicted step time: {exc}"
        log.warning(unpriced)
    par = plan.parallel
    # An expert unit is reduced over fewer ranks than the job: no all-reduce carries the guard.
    folds = par.ep == 1 and guard_folds(zero=par.zero, dp=par.dp,
                                        world=par.tp * par.cp * par.pp * par.dp,
                                        offload=par.offload != "none",
                                        grad_bytes=DTYPE_BYTES[plan.train.grad_dtype],
                                        wire_bytes=plan.grad_wire_bytes)
    return Decisions(plan=plan, checkpoint=_policies(plan, layers, priced), estimate=priced,
                     unpriced=unpriced, guard_folds=folds)


def _check_priced_model(gm: fx.GraphModule, plan: Plan) -> None:
    """UnpricedError when the module compiled (`gm`, captured from the module given to
    `ptc.compile`) is not the model the cost model priced: for a custom plan that is the
    one its factory builds, and a module of other parameters or layers would get that
    model's memory, step time and checkpoint = auto policies."""
    if plan.model.family != "custom":
        return
    from ptc.compiler.profile.cache import plan_profile, with_model_shape  # noqa: PLC0415 - sympy

    profile = plan_profile(with_model_shape(plan))
    params = profile.params
    priced = params["pre"].total + profile.layers * params["layer"].total + params["post"].total
    compiled = sum(p.numel() for p in gm.parameters())
    layers = graph_info(gm).num_layers
    if (priced, profile.layers) != (compiled, layers):
        raise UnpricedError(
            f"the module compiled has {compiled:,} parameter elements in {layers} layers, and "
            f"the model the plan's factory \"{plan.model.factory}\" builds (the one ptc prices) "
            f"has {priced:,} in {profile.layers}: predictions of that model would not be this "
            "one's; name a factory that builds this module")


def _policies(plan: Plan, layers: int, priced: Estimate | None) -> tuple[str, ...]:
    """Each layer's recompute policy: the plan's, or checkpoint = auto's choice."""
    ckpt = plan.parallel.checkpoint
    if not is_auto_checkpoint(ckpt):
        if isinstance(ckpt, str):
            return (ckpt,) * layers
        return tuple(ckpt[i] if i < len(ckpt) else "none" for i in range(layers))
    if priced is None:
        raise CompileError(f"checkpoint = {ckpt} needs the cost model's estimate of the plan, "
                           "which failed (see the warning above); name a policy instead")
    if not priced.fits:
        from ptc.compiler.search.fit import nothing_fits_message  # noqa: PLC0415

        raise CompileError(nothing_fits_message(plan, list(priced.stage_memory_bytes)))
    return tuple(priced.layout.checkpoint)
