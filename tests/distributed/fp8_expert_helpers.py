"""Workers of the float8 expert tests (`test_fp8_experts`): one grouped product under expert
parallelism against the same product of every rank's rows, and the tiny Mixtral trained in
fp8 (emulated) under dp × ep. Importable, for the started processes."""

from __future__ import annotations

import dataclasses

from dist_helpers import train_cases
from hf_helpers import HFCase, hf_module, hf_plan

from ptc.plan import Plan

ROUTED = ((5, 0, 20, 7), (0, 0, 33, 2))
"""Rows each of 2 ranks routes to each of 4 experts: expert 1 receives none, rank 0's
experts (0, 1) 5 rows, rank 1's (2, 3) 62, in groups of partial 32-row blocks."""
K, N = 64, 96


def ep_grouped_worker(recipes: tuple[str, ...]) -> dict:
    """Worker (2 ranks, gloo, ep 2): per recipe, the largest |ep - whole| of y, dx and the
    rank's experts' dW over the fp32 bound (`test_fp8_experts`), and the amaxes the rank's
    delayed-scaling state recorded for its experts (tensorwise).

    ep: each rank's rows (`ROUTED`) go to their experts' ranks by `ep_dispatch`, are
    multiplied by the rank's two experts with their local offsets, and come back by
    `ep_combine`. Whole: every rank's rows, expert by expert in the order the dispatch
    gives them (source rank 0's, then 1's), multiplied by all four experts on each rank.
    tensorwise is delayed, both states loaded with the same history (the whole tensors'
    amaxes), so that both scale alike; rowwise and mxfp8 scale each row and each expert's
    rows by themselves, which ep leaves alone."""
    import torch
    import torch.distributed as dist

    from ptc.ops.comm import bind_axes
    from ptc.ops.expert_parallel import ep_combine, ep_dispatch
    from ptc.ops.fp8_grouped import fp8_grouped_mm
    from ptc.ops.fp8_linear import Fp8Scaling

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    experts = len(ROUTED[0])
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(sum(c), K, generator=g) * torch.logspace(-3, 2, K) for c in ROUTED]
    dys = [torch.randn(sum(c), N, generator=g) * torch.logspace(-3, 0, N) for c in ROUTED]
    w = (torch.randn(experts, N, K, generator=g)
         * torch.logspace(0, -2, experts)[:, None, None]).transpose(-2, -1)
    # The whole product's rows: expert-major, each expert's rows source-major.
    order = []
    starts = [torch.cumsum(torch.tensor((0, *c[:-1])), 0).tolist() for c in ROUTED]
    for e in range(experts):
        for s, counts in enumerate(ROUTED):
            order += [(s, starts[s][e] + i) for i in range(counts[e])]
    x_all = torch.stack([xs[s][i] for s, i in order])
    dy_all = torch.stack([dys[s][i] for s, i in order])
    offs_all = torch.cumsum(torch.tensor(ROUTED).sum(0), 0).to(torch.int32)
    mine = torch.tensor([j for j, (s, _) in enumerate(order) if s == rank])
    local = slice(rank * experts // world, (rank + 1) * experts // world)
    history = torch.cat([x_all.abs().max().reshape(1), w.abs().amax(dim=(1, 2)),
                         dy_all.abs().max().reshape(1)])[:, None]

    def state(recipe, ep):
        delayed = recipe == "tensorwise"
        scaling = Fp8Scaling(delayed=delayed, window=1, emulate=True, axis=None,
                             recipe=recipe, experts=experts, expert_axis="ep" if ep else None)
        if delayed:
            scaling.load_history(history, torch.device("cpu"))
        return scaling

    def leaves(*tensors):
        return [t.detach().clone().requires_grad_() for t in tensors]

    slack = 2 * (max(K, N, sum(map(sum, ROUTED))) + 4) * 2.0**-24 * (1 + 2**-3) ** 2
    plain = lambda a, b, offs: torch._grouped_mm(a, b, offs)  # noqa: E731
    magnitude = {"y": plain(x_all.abs(), w.abs(), offs_all)[mine],
                 "dx": plain(dy_all.abs(), w.abs().mT, offs_all)[mine],
                 "dw": plain(x_all.abs().t(), dy_all.abs(), offs_all)[local]}
    out = {}
    with bind_axes({"ep": dist.group.WORLD}):
        for recipe in recipes:
            x, wl = leaves(xs[rank], w[local])
            sent_offs = torch.cumsum(torch.tensor(ROUTED[rank]), 0).to(torch.int32)
            rows, offs, route = ep_dispatch(x, sent_offs, experts=experts)
            split = state(recipe, True)
            y = ep_combine(fp8_grouped_mm(rows, wl, offs, split), route)
            y.backward(dys[rank])
            xw, ww = leaves(x_all, w)
            whole = fp8_grouped_mm(xw, ww, offs_all, state(recipe, False))
            whole.backward(dy_all)
            pairs = (("y", y.detach(), whole.detach()[mine]), ("dx", x.grad, xw.grad[mine]),
                     ("dw", wl.grad, ww.grad[local]))
            out[recipe] = {name: ((a - b).abs() / (slack * magnitude[name] + 1e-30)).max().item()
                           for name, a, b in pairs}
            if recipe == "tensorwise":  # the rows of the rank's experts, their weights
                first = int(offs_all[local.start - 1]) if local.start else 0
                held = slice(first, int(offs_all[local.stop - 1]))
                want = torch.zeros(experts + 2)
                want[0], want[-1] = x_all[held].abs().max(), dy_all[held].abs().max()
                want[1 + local.start:1 + local.stop] = w[local].abs().amax(dim=(1, 2))
                out["pending"] = (split.pending.tolist(), want.tolist())
    dist.destroy_process_group()
    return out


def fp8_moe_plan(case: tuple) -> Plan:
    """(HFCase, dtype[, fp8 recipe, fp8 scaling]): the case's plan of the tiny transformers
    model, in fp8 (emulated) with that recipe and scaling, or in `dtype`."""
    hf, dtype, *fp8 = case
    plan = hf_plan(hf)
    recipe, scaling = fp8 or ("tensorwise", "delayed")
    return dataclasses.replace(plan, train=dataclasses.replace(
        plan.train, dtype=dtype, fp8_emulate=dtype == "fp8", fp8_recipe=recipe,
        fp8_scaling=scaling))


def run_fp8_moe_cases(cases: list[tuple]) -> dict:
    """Worker: train every case from its seeded module (`dist_helpers.train_cases`)."""
    return train_cases(cases, fp8_moe_plan, lambda case: hf_module(case[0]))


MIXTRAL = HFCase("mixtral", dp=2)
"""The tiny Mixtral of the ep tests (4 experts, top-2) on 2 data-parallel ranks."""
