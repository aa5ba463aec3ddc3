"""The Python entry points: the same operations the CLI offers.

`ptc.compile`, `ptc.run`, `ptc.estimate` and `ptc.search` are thin: each
delegates to the room that owns the work (compiler, runtime), so that a
notebook user and the `ptc` command get identical results.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.fx
    from torch import nn

    from ptc.compiler.estimate import Estimate
    from ptc.plan import Plan


def capture_plan(plan: Plan, model: nn.Module | None = None) -> torch.fx.GraphModule:
    """Capture the plan's model (or `model`) on the meta device at the plan's batch shape."""
    import torch  # noqa: PLC0415 - torch loads only when a command needs it

    from ptc.compiler.capture import capture  # noqa: PLC0415
    from ptc.models import build_model  # noqa: PLC0415

    if model is None:
        model = build_model(plan.model, device="meta")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[plan.train.dtype]
    return capture(model, micro_batch=plan.train.micro_batch, seq_len=plan.train.seq_len,
                   dtype=dtype)


def estimate(plan: Plan) -> Estimate:
    """Predict step time, throughput, MFU and per-stage peak memory of a resolved plan."""
    from ptc.compiler.estimate import estimate as _estimate  # noqa: PLC0415

    return _estimate(plan)


def search(plan: Plan, top: int = 5) -> list[tuple[Plan, Estimate]]:
    """The `top` fastest layouts of `plan` that fit memory, fastest first."""
    from ptc.compiler.search import search as _search  # noqa: PLC0415

    return _search(plan, top=top)
