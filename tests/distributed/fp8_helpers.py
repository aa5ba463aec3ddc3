"""Worker of the float8 compute tests: the tiny models trained under `train.dtype = fp8`
(emulated) and bf16, with and without tp. Importable, for the started processes."""

from __future__ import annotations

import dataclasses

from dist_helpers import train_cases
from tp_helpers import TPCase, tp_plan

from ptc.plan import Plan


def fp8_plan(case: tuple) -> Plan:
    """(family, tp, dtype, fp8 scaling[, "sp"]): the tp test's plan of the tiny model, in
    `dtype` (fp8 emulated) on one sample-pair micro-batch, with sequence parallelism when
    the case says "sp"."""
    family, tp, dtype, scaling, *sp = case
    plan = tp_plan(TPCase(family, tp, sp=sp == ["sp"]))
    return dataclasses.replace(plan, train=dataclasses.replace(
        plan.train, dtype=dtype, fp8_scaling=scaling, fp8_emulate=True))


def run_fp8_cases(cases: list[tuple]) -> dict:
    """Worker: train every case (`dist_helpers.train_cases`)."""
    return train_cases(cases, fp8_plan)


def fp8_ckpt_plan(*, tp: int, dp: int, steps: int, pp: int = 1) -> Plan:
    """The checkpoint tests' tiny Llama at ZeRO-1 in fp8 (emulated, delayed scaling)."""
    from ckpt_helpers import ckpt_plan

    plan = ckpt_plan(dp=dp, zero=1, tp=tp, pp=pp, steps=steps)
    return dataclasses.replace(plan, train=dataclasses.replace(
        plan.train, dtype="fp8", fp8_scaling="delayed", fp8_emulate=True))


def _histories(trainer) -> dict:
    """Every rank's (tp rank, dp rank, {linear: history}) (collective; on every rank)."""
    import torch.distributed as dist

    from ptc.runtime.fp8_state import scalings

    mine = (trainer.tp_rank, trainer.dp_rank,
            {name: s.saved_history(trainer.device).clone() for name, s in scalings(trainer).items()})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def fp8_resume_worker(directory: str, steps: int) -> dict:
    """tp 2 x dp 2: train 2·steps uninterrupted, checkpointing after `steps`; then resume from
    that checkpoint and train the rest, and once more with the histories emptied after the
    restore (the control). Rank 0 returns losses, full states and the saved histories."""
    import torch.distributed as dist
    from ckpt_helpers import _checkpointer, _trainer, full_state, layout

    plan = fp8_ckpt_plan(tp=2, dp=2, steps=2 * steps)
    trainer = _trainer(plan)
    losses = [trainer.train_step(k).loss for k in range(steps)]
    checkpointer = _checkpointer(trainer, directory)
    checkpointer.save(steps, steps * plan.train.global_batch, {"layout": layout(plan)})
    checkpointer.close()
    saved = _histories(trainer)
    losses += [trainer.train_step(k).loss for k in range(steps, 2 * steps)]
    out = {"uninterrupted": {"losses": losses, "state": full_state(trainer)}, "saved": saved}
    for name, forget in (("resumed", False), ("fresh history", True)):
        trainer = _trainer(plan)
        manifest = _checkpointer(trainer, directory).restore()
        if forget:
            from ptc.runtime.fp8_state import scalings

            for state in scalings(trainer).values():
                state.history = state.pending = None
        restored = _histories(trainer)
        losses = [trainer.train_step(k).loss for k in range(manifest.step, 2 * steps)]
        out[name] = {"losses": losses, "state": full_state(trainer), "restored": restored}
    dist.destroy_process_group()
    return out


def fp8_reshard_worker(jobs: list[tuple[int, int, int]], directory: str) -> dict:
    """Per (tp, pp, dp): restore the tp 2 x dp 2 checkpoint; every rank's restored histories."""
    import torch.distributed as dist
    from ckpt_helpers import _checkpointer, _trainer

    out = {}
    for tp, pp, dp in jobs:
        trainer = _trainer(fp8_ckpt_plan(tp=tp, pp=pp, dp=dp, steps=1))
        _checkpointer(trainer, directory).restore()
        out[(tp, pp, dp)] = _histories(trainer)
        dist.destroy_process_group()
    return out


def fp8_pp_plan(case: tuple[str, int, str, str, int]) -> Plan:
    """(family, pp, schedule, fp8 scaling, virtual stages): the pipeline tests' 4-layer tiny
    model, 4 micro-batches of one sample, in fp8 (emulated)."""
    from pp_helpers import Case, pp_plan

    family, pp, schedule, scaling, virtual = case
    plan = pp_plan(Case(family, pp, schedule, 4, virtual=virtual))
    return dataclasses.replace(plan, train=dataclasses.replace(
        plan.train, dtype="fp8", fp8_scaling=scaling, fp8_emulate=True))


def run_fp8_pp_cases(cases: list[tuple[str, int, str, str, int]]) -> dict:
    """Worker: train every pipeline case (`dist_helpers.train_cases`)."""
    return train_cases(cases, fp8_pp_plan)


RECIPE_SEQ = 64
"""Sequence length of the recipe tests: a rank's chunk under sequence parallelism at tp 2
holds one whole mxfp8 block of 32 tokens."""


def fp8_recipe_plan(case: tuple) -> Plan:
    """(family, tp, fp8 recipe[, "sp"[, "async"]]): the tp test's tiny model widened so that
    every linear's shard holds whole 32-blocks at tp 2 (hidden 64; Llama with 4 key/value
    heads), at sequence length RECIPE_SEQ, in fp8 (emulated, current scaling) with that
    recipe; with "async" sequence parallelism's collectives are collective matmuls."""
    family, tp, recipe, *extras = case
    plan = tp_plan(TPCase(family, tp, sp="sp" in extras,
                          tp_comm="async" if "async" in extras else "sync"))
    heads = {"kv_heads": 4} if family == "llama" else {}
    model = dataclasses.replace(plan.model, hidden=64, max_seq=RECIPE_SEQ, **heads)
    return dataclasses.replace(plan, model=model, train=dataclasses.replace(
        plan.train, seq_len=RECIPE_SEQ, dtype="fp8", fp8_recipe=recipe, fp8_scaling="current",
        fp8_emulate=True))


def run_fp8_recipe_cases(cases: list[tuple]) -> dict:
    """Worker: train every recipe case (`dist_helpers.train_cases`)."""
    return train_cases(cases, fp8_recipe_plan)


def split_gemm_worker(recipes: tuple[str, ...], grouped: bool = False) -> dict:
    """Worker (2 ranks, gloo): per recipe and tp role, the largest |split - unsplit| of y,
    dx and dW of one fp8_linear (`grouped`: one fp8_grouped_mm of 3 experts, one of which
    receives no row), each over its bound (`test_fp8_recipes`): the GEMM run whole on every
    rank, then column-parallel (W's output features split: y and dW by column, dx a partial
    sum) and row-parallel (W's and x's input features split: y a partial sum, dx and dW by
    column), each rank's pieces joined."""
    import torch
    import torch.distributed as dist

    from ptc.ops.comm import bind_axes
    from ptc.ops.fp8_grouped import fp8_grouped_mm
    from ptc.ops.fp8_linear import COLUMN, ROW, Fp8Scaling, fp8_linear

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 64, generator=g) * torch.logspace(-2, 1, 64)
    w = torch.randn(3 if grouped else 1, 128, 64, generator=g) * torch.logspace(0, -2, 128)[:, None]
    dy = torch.randn(64, 128, generator=g) * torch.logspace(-3, 0, 128)
    offs = torch.tensor([24, 24, 64], dtype=torch.int32)
    if grouped:  # the stack [experts, in, out] as a model's [out, in] experts are read
        w, n_dim, k_dim = w.transpose(-2, -1), 2, 1
        op = lambda x, w, s: fp8_grouped_mm(x, w, offs, s)  # noqa: E731
        plain = lambda a, b: torch._grouped_mm(a, b, offs)  # noqa: E731
        magnitude = {"y": plain(x.abs(), w.abs()), "dx": plain(dy.abs(), w.abs().mT),
                     "dw": plain(x.abs().t(), dy.abs())}
    else:  # [2, 32, 64] tokens of a linear's weight [out, in]
        x, w, dy, n_dim, k_dim = x.reshape(2, 32, 64), w[0], dy.reshape(2, 32, 128), 0, 1
        op = lambda x, w, s: fp8_linear(x, w, None, s)  # noqa: E731
        magnitude = {"y": x.abs().reshape(-1, 64) @ w.abs().t(),
                     "dx": dy.abs().reshape(-1, 128) @ w.abs(),
                     "dw": dy.abs().reshape(-1, 128).t() @ x.abs().reshape(-1, 64)}

    def run(x, w, dy, recipe, role):
        x, w = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
        scaling = Fp8Scaling(delayed=False, window=1, emulate=True, axis="tp" if role else None,
                             recipe=recipe, role=role, experts=w.shape[0] if grouped else 1)
        y = op(x, w, scaling)
        y.backward(dy)
        return y.detach(), x.grad, w.grad

    def joined(t, dim):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim)

    def summed(t):
        dist.all_reduce(t)
        return t

    def part(t, dim):
        size = t.shape[dim] // world
        return t.narrow(dim, rank * size, size)

    out = {}
    # fp32 sums in another order: 2·(K + 4)·2^-24 of the products' magnitudes (K at most
    # 128, the dgrad's), the float8
    # operands within 2^-3 of the originals (e4m3, current scaling: no saturation).
    slack = 2 * (128 + 4) * 2.0**-24 * (1 + 2**-3) ** 2
    with bind_axes({"tp": dist.group.WORLD}):
        for recipe in recipes:
            whole = run(x, w, dy, recipe, None)
            y, dx, dw = run(x, part(w, n_dim), part(dy, -1), recipe, COLUMN)
            column = (joined(y, -1), summed(dx), joined(dw, n_dim))
            y, dx, dw = run(part(x, -1), part(w, k_dim), dy, recipe, ROW)
            row = (summed(y), joined(dx, -1), joined(dw, k_dim))
            for role, split in ((COLUMN, column), (ROW, row)):
                out[recipe, role] = {
                    name: ((a - b).abs().reshape(magnitude[name].shape)
                           / (slack * magnitude[name] + 1e-30)).max().item()
                    for name, a, b in zip(("y", "dx", "dw"), split, whole)}
    dist.destroy_process_group()
    return out


def collective_matmul_worker(recipes: tuple[str, ...]) -> dict:
    """Worker (2 ranks, gloo): per recipe, the largest |async - sync| of the outputs and
    gradients of the float8 collective matmuls (`ptc.ops.async_tp_fp8`) against the ops
    they stand for, each over its bound (`test_fp8_recipes`): two column-parallel linears
    reading an all_gather_seq, and a row-parallel linear whose output a reduce_scatter_seq
    sums, on a [2, 64, 64] input split along its 64 tokens."""
    import torch
    import torch.distributed as dist

    from ptc.ops.async_tp_fp8 import all_gather_fp8_linears, fp8_linear_reduce_scatter
    from ptc.ops.comm import bind_axes
    from ptc.ops.fp8_linear import COLUMN, ROW, Fp8Scaling, fp8_linear
    from ptc.ops.tp_ops import all_gather_seq, reduce_scatter_seq

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(5 + rank)  # each rank its own chunk and shards
    x = torch.randn(2, 64 // world, 64, generator=g) * torch.logspace(-2, 1, 64)
    ws = [torch.randn(64, 64, generator=g) * torch.logspace(0, -2, 64)[:, None] for _ in range(2)]
    dys = [torch.randn(2, 64, 64, generator=g) * torch.logspace(-3, 0, 64) for _ in range(2)]
    x_row = torch.randn(2, 64, 64, generator=g)
    w_row = torch.randn(64, 64, generator=g) * torch.logspace(0, -2, 64)[:, None]
    dy_row = torch.randn(2, 64 // world, 64, generator=g)

    def scaling(recipe, role):
        return Fp8Scaling(delayed=False, window=1, emulate=True, axis="tp", recipe=recipe,
                          role=role)

    def leaves(*tensors):
        return [t.clone().requires_grad_() for t in tensors]

    def entry(recipe, fused):
        xs, *wl = leaves(x, *ws)
        scales = [scaling(recipe, COLUMN) for _ in wl]
        if fused:
            ys = all_gather_fp8_linears(xs, tuple(wl), (None, None), tuple(scales))
        else:
            full = all_gather_seq(xs)
            ys = [fp8_linear(full, w, None, sc) for w, sc in zip(wl, scales)]
        torch.autograd.backward(list(ys), dys)
        return [*(y.detach() for y in ys), xs.grad, *(w.grad for w in wl)]

    def exit_(recipe, fused):
        xs, w = leaves(x_row, w_row)
        sc = scaling(recipe, ROW)
        y = fp8_linear_reduce_scatter(xs, w, sc) if fused else \
            reduce_scatter_seq(fp8_linear(xs, w, None, sc))
        y.backward(dy_row)
        return [y.detach(), xs.grad, w.grad]

    # The same float8 values summed in another order (chunk by chunk, over ranks): the
    # fp32 bound of split_gemm_worker's, on the magnitudes of the products summed.
    slack = 2 * (128 + 4) * 2.0**-24 * (1 + 2**-3) ** 2
    out = {}
    with bind_axes({"tp": dist.group.WORLD}):
        for recipe in recipes:
            worst = 0.0
            for run in (entry, exit_):
                for a, b in zip(run(recipe, True), run(recipe, False)):
                    worst = max(worst, ((a - b).abs() / (slack * (b.abs().max() + 1e-30)))
                                .max().item())
            out[recipe] = worst
    dist.destroy_process_group()
    return out


LR, STEPS = 3e-3, 5  # as dist_helpers.tiny_plan trains
"""The learning rate and steps of the fp8 plans (`tp_plan`'s)."""


def assert_trains_as_tp1(one: dict, two: dict) -> None:
    """tp 2 trained as tp 1: every step's loss within 2^-6 relative (float8 rounding of
    partial sums taken in another order), every weight within 2·lr per step (Adam moves a
    weight by at most about lr a step: two runs apart by more moved differently)."""
    import torch  # noqa: PLC0415 - the worker module imports no torch at load

    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]),
                               rtol=2**-6, atol=0)
    bound = 2 * LR * STEPS
    for name, value in one["state"].items():
        diff = (two["state"][name].float() - value.float()).abs()
        assert diff.max() <= bound, f"{name}: {diff.max():.3g} > {bound:.3g}"

