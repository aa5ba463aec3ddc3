"""Worker of test_context_attention: one rank's context-parallel attention against the whole
sequence's causal attention, computed by every rank from the same seed in float64."""

from __future__ import annotations

import torch


def _whole(case: dict) -> dict[str, torch.Tensor]:
    """The whole sequence's q [b, h, S, d], k and v [b, kv, S, d] and the upstream gradient."""
    gen = torch.Generator().manual_seed(case["seed"])
    b, h, kv, s, d = case["batch"], case["heads"], case["kv_heads"], case["seq"], case["dim"]

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {"q": draw(b, h, s, d), "k": draw(b, kv, s, d), "v": draw(b, kv, s, d),
            "grad": draw(b, h, s, d)}


def _reference(case: dict, whole: dict) -> dict[str, torch.Tensor]:
    """The whole sequence's output and q, k, v gradients (keyed dropout when the case has it)."""
    from ptc.ops.dropout import site_attention  # noqa: PLC0415

    leaves = {n: whole[n].clone().requires_grad_() for n in ("q", "k", "v")}
    out = site_attention(leaves["q"], leaves["k"], leaves["v"], is_causal=True,
                         dropout_p=case["dropout"], scale=case["scale"],
                         enable_gqa=case["heads"] != case["kv_heads"], site=3)
    (out * whole["grad"]).sum().backward()
    return {"out": out.detach(), **{n: t.grad for n, t in leaves.items()}}


def _gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude of `want`."""
    return float((got - want).abs().max() / want.abs().max())


def _products(flops: int, sdpa: list[tuple], dim: int) -> float:
    """Query-key products the forward computed: the written-out matrix products' FLOPs
    (q·kᵀ and p·v, 2·d each per product), plus each fused kernel's batch × heads × queries ×
    keys (half where it ran causal: it skips the tiles above the diagonal)."""
    fused = sum(b * h * q * k / (2 if causal else 1) for b, h, q, k, causal in sdpa)
    return flops / (4 * dim) + fused


def _sdpa_recorder():
    """A dispatch mode recording each fused attention kernel's (batch, heads, queries, keys,
    causal) as it runs."""
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: list[tuple] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if "scaled_dot_product" in func.__name__:
                q, k = args[0], args[1]
                causal = bool(kwargs.get("is_causal", args[4] if len(args) > 4 else False))
                self.calls.append((q.shape[0], q.shape[1], q.shape[-2], k.shape[-2], causal))
            return func(*args, **kwargs)

    return Recorder()


def run_cases(cases: list[dict]) -> list[dict]:
    """Worker: for each case, this rank's context_attention (output, gradients, the query-key
    products its forward computed) against its positions of the whole sequence's."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.utils.flop_counter import FlopCounterMode  # noqa: PLC0415

    from ptc.ops.comm import bind_axes  # noqa: PLC0415
    from ptc.ops.context import context_attention  # noqa: PLC0415
    from ptc.ops.dropout import Samples, dropout_samples  # noqa: PLC0415
    from ptc.ops.positions import chunk_positions  # noqa: PLC0415

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {cp: [dist.new_group(list(range(g, g + cp))) for g in range(0, world, cp)]
              for cp in (2, world)}
    results = []
    for case in cases:
        cp = case["cp"]
        group = groups[cp][rank // cp]
        samples = Samples(seed=11, first=0) if case["dropout"] else None
        whole = _whole(case)
        with dropout_samples(samples):
            want = _reference(case, whole)
        mine = chunk_positions(case["seq"], rank % cp, cp)
        local = {n: whole[n][:, :, mine].clone().requires_grad_() for n in ("q", "k", "v")}
        recorder = _sdpa_recorder()
        with bind_axes({"cp": group}), dropout_samples(samples), \
                FlopCounterMode(display=False) as flops, recorder:
            out = context_attention(local["q"], local["k"], local["v"], scale=case["scale"],
                                    dropout_p=case["dropout"], fused=case["fused"],
                                    enable_gqa=case["heads"] != case["kv_heads"], site=3,
                                    full=(case["heads"], case["seq"], case["seq"]))
        products = _products(flops.get_total_flops(), recorder.calls, case["dim"])
        with bind_axes({"cp": group}):
            (out * whole["grad"][:, :, mine]).sum().backward()
        results.append({"out": _gap(out.detach(), want["out"][:, :, mine]),
                        **{n: _gap(local[n].grad, want[n][:, :, mine]) for n in local},
                        "products": products})
    return results
