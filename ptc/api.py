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
