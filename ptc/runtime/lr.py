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



def schedule_record(peak: float, schedule: LRScheduleSpec, total_steps: int) -> dict:
    """The schedule as a checkpoint's manifest records it."""
    return {"kind": schedule.kind, "peak": peak, "warmup": schedule.warmup,
            "min_lr": schedule.min_lr, "decay_steps": schedule.decay_steps,
            "total_steps": total_steps}


def schedule_change(saved: dict, now: dict, next_step: int) -> str | None:
    """What changes for a run resumed at update `next_step` (0-based) whose schedule record
    was `saved` and is `now`: None when every learning rate from there on is the same, else
    one line naming the plan fields that differ and the next rate under each."""
    def rate(record: dict, step: int) -> float:
        spec = LRScheduleSpec(kind=record["kind"], warmup=record["warmup"],
                              min_lr=record["min_lr"], decay_steps=record["decay_steps"])
        return learning_rate(step, record["peak"], spec, record["total_steps"])

    end = max(now["total_steps"], saved["total_steps"])
    first = next((t for t in range(next_step, end) if rate(saved, t) != rate(now, t)), None)
    if first is None:
        return None
    changed = ", ".join(f"{_FIELD[key]} {saved[key]} -> {value}" for key, value in now.items()
                        if saved[key] != value)
    return (f"the learning-rate schedule differs from the checkpoint's ({changed}): from step "
            f"{first + 1} the rate is {rate(now, first):.3g} where the checkpoint's schedule "
            f"gives {rate(saved, first):.3g}")


_FIELD = {"kind": "train.lr_schedule", "peak": "train.optimizer.lr",
          "warmup": "lr_schedule.warmup", "min_lr": "lr_schedule.min_lr",
          "decay_steps": "lr_schedule.decay_steps", "total_steps": "train.steps"}
"""Where each key of a schedule record is set in a plan."""
