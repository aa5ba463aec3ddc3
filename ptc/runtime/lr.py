"""The learning-rate schedule: linear warm-up, then constant, cosine or linear decay.

Step t counts optimizer updates from 0. During warm-up (t < warmup) the rate
rises linearly, lr·(t+1)/warmup, so the first update is not wasted at 0.
After it, progress p = (t - warmup) / (decay_steps - warmup), clamped to
[0, 1], with decay_steps defaulting to the run's steps: "constant" stays at
lr, "cosine" follows min_lr + (lr - min_lr)·(1 + cos(pi·p))/2, "linear" goes
straight from lr to min_lr.
"""

from __future__ import annotations

import math

from ptc.plan import LRScheduleSpec


def learning_rate(step: int, peak: float, schedule: LRScheduleSpec, total_steps: int) -> float:
    """The learning rate of update `step` (0-based) of a run of `total_steps` updates."""
    warmup = schedule.warmup
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule.kind == "constant":
        return peak
    decay = schedule.decay_steps if schedule.decay_steps is not None else total_steps
    span = max(1, decay - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    if schedule.kind == "cosine":
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return schedule.min_lr + (peak - schedule.min_lr) * cosine
    return peak + (schedule.min_lr - peak) * progress
