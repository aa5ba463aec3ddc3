"""Worker of test_expert_parallel: expert-parallel dispatch/compute/combine against a reference.

Every rank builds every rank's tokens from per-rank seeds, so each can compute
the single-process reference itself: all ranks' rows of expert e concatenated,
times W[e], split back per rank. It then runs the expert-parallel path on its
own tokens, holding only its local experts' slice of W, and reports how far
its outputs and gradients are from the reference's. Everything is float64.
"""

from __future__ import annotations

import torch


def _tokens(case: dict, rank: int) -> dict:
    """Rank `rank`'s tokens for `case`, sorted by expert, and its upstream gradient."""
    experts, d, f = case["experts"], case["d"], case["f"]
    n = case["rows"][rank]
    gen = torch.Generator().manual_seed(1000 * case["seed"] + rank)
    routing = case.get("routing", "random")
    if routing == "one_expert":
        ids = torch.zeros(n, dtype=torch.int64)
    else:
        ids = torch.randint(0, experts, (n,), generator=gen)
    ids = ids.sort().values
    counts = torch.bincount(ids, minlength=experts)
    offs = torch.cumsum(counts, 0).to(case.get("offs_dtype", torch.int32))
    return {"x": torch.randn(n, d, generator=gen, dtype=torch.float64), "ids": ids,
            "offs": offs, "bias": torch.randn(n, f, generator=gen, dtype=torch.float64),
            "scale": torch.rand(n, generator=gen, dtype=torch.float64) + 0.5,
            "grad": torch.randn(n, f, generator=gen, dtype=torch.float64)}


def _expert(x, w, bias=None, scale=None):
    """One expert's rows: x @ w (+ bias, * scale, row by row, when given)."""
    y = x @ w
    if bias is not None:
        y = (y + bias) * scale.unsqueeze(-1)
    return y


def _reference(case: dict, world: int, weight: torch.Tensor) -> tuple[list, dict]:
    """Outputs of every rank and float64 gradients of sum_r <y_r, grad_r>."""
    extra = case.get("extra_rows", False)
    data = [_tokens(case, r) for r in range(world)]
    leaves = {name: [data[r][name].clone().requires_grad_() for r in range(world)]
              for name in ("x", "bias", "scale")}
    w = weight.clone().requires_grad_()
    outs = [torch.zeros(data[r]["x"].shape[0], case["f"], dtype=torch.float64)
            for r in range(world)]
    for e in range(case["experts"]):
        picks = [data[r]["ids"] == e for r in range(world)]
        rows = {name: torch.cat([leaves[name][r][picks[r]] for r in range(world)])
                for name in leaves}
        y = _expert(rows["x"], w[e], rows["bias"] if extra else None, rows["scale"])
        sizes = [int(p.sum()) for p in picks]
        for r, part in enumerate(y.split(sizes)):
            outs[r] = outs[r].index_put((picks[r],), part)
    loss = sum((outs[r] * data[r]["grad"]).sum() for r in range(world))
    loss.backward()
    grads = {name: [t.grad for t in ts] for name, ts in leaves.items()}
    grads["w"] = w.grad
    return [o.detach() for o in outs], grads


def _gap(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """max |a - b| relative to max |b| (1 when b is all zero); None counts as zeros."""
    if a is None and b is None:
        return 0.0
    a = torch.zeros_like(b) if a is None else a
    b = torch.zeros_like(a) if b is None else b
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / max(float(b.abs().max()), 1.0))


def run_cases(cases: list[dict]) -> list[dict]:
    """Worker: for each case, expert-parallel forward and backward vs the reference."""
    import torch.distributed as dist

    from ptc.ops.comm import bind_axes, record_collectives
    from ptc.ops.expert_parallel import ep_combine, ep_dispatch

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    results = []
    for case in cases:
        experts, extra = case["experts"], case.get("extra_rows", False)
        local = experts // world
        weight = torch.randn(experts, case["d"], case["f"], dtype=torch.float64,
                             generator=torch.Generator().manual_seed(case["seed"]))
        ref_out, ref_grads = _reference(case, world, weight)
        mine = _tokens(case, rank)
        x = mine["x"].clone().requires_grad_()
        bias = mine["bias"].clone().requires_grad_()
        scale = mine["scale"].clone().requires_grad_()
        w_local = weight[rank * local:(rank + 1) * local].clone().requires_grad_()
        rows = (bias, scale, mine["ids"]) if extra else (mine["ids"],)
        with bind_axes({"ep": group}), record_collectives() as log:
            x_l, offs_l, route, *rows_l = ep_dispatch(x, mine["offs"], *rows, experts=experts)
            ends = [0, *offs_l.tolist()]
            parts, ids_ok = [], True
            for e in range(local):
                a, b = int(ends[e]), int(ends[e + 1])
                ids_ok &= bool((rows_l[-1][a:b] == rank * local + e).all())
                parts.append(_expert(x_l[a:b], w_local[e], rows_l[0][a:b] if extra else None,
                                     rows_l[1][a:b] if extra else None))
            y = ep_combine(torch.cat(parts), route)
            (y * mine["grad"]).sum().backward()
        got = {
            "forward": _gap(y.detach(), ref_out[rank]),
            "x": _gap(x.grad, ref_grads["x"][rank]),
            "w": _gap(w_local.grad, ref_grads["w"][rank * local:(rank + 1) * local]),
            "ids_grouped": ids_ok,
            "offs_dtype": str(offs_l.dtype),
            "offs_local_len": offs_l.numel(),
            "received": int(ends[-1]),
            "x_local_rows": x_l.shape[0],
            "route": route.tolist(),
            "grad_shape_ok": x.grad is not None and x.grad.shape == x.shape,
            "ops": [op for op, *_ in log],
        }
        if extra:
            got["bias"] = _gap(bias.grad, ref_grads["bias"][rank])
            got["scale"] = _gap(scale.grad, ref_grads["scale"][rank])
        results.append(got)
    dist.destroy_process_group()
    return results
