"""How much of a long run trains: the checkpoint interval that loses least, and goodput.

Terms: δ is the pause a checkpoint save costs training (the copy of the
rank's state to host memory when saves are asynchronous), M the job's mean
time between failures, R the time a failure costs besides lost work (the
group restarting, compiling and reading the checkpoint back), τ the time
between saves.

- M: the plan's `runtime.mtbf`, else a per-GPU failure rate scaled to the
  job: Llama 3's pre-training saw 466 interruptions in 54 days on 16,384
  GPUs (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4),
  a job MTBF of 2.8 h, so one GPU's share of failures comes every
  2.8 h × 16,384 and a job of n GPUs fails every 2.8 h × 16,384 / n.
- τ: Young's first-order optimum sqrt(2δM) with Daly's higher-order terms
  (Daly 2006, "A higher order estimate of the optimum checkpoint interval
  for restart dumps"): τ = sqrt(2δM)·(1 + √(δ/2M)/3 + (δ/2M)/9) − δ for
  δ < 2M, else M.
- goodput: the share of wall time that trains. Each τ of training costs δ
  more; each failure (every M on average) costs R and half a period of
  work: G = τ/(τ + δ) · (1 − (R + (τ + δ)/2)/M), at least 0.
- with in-memory snapshots (`runtime.snapshot_every`), t seconds of
  training apart: each costs the snapshot's pause σ more, and a failure
  loses half of t rather than half a save period: G = τ/(τ + δ) · t/(t + σ) ·
  (1 − (R + (t + σ)/2)/M). σ is three passes over the rank's weights and
  optimizer state: on a GPU node the copy off the GPU, the checksum's read
  and the write into tmpfs, each at the host link's rate (the node's GPUs
  share its host memory); on a CPU the checksum's read and the write's read
  and write, at the memory bandwidth.
"""

from __future__ import annotations

import math

from ptc.compiler.memory.model import (MASTER_BYTES, Precision, stage_host_memory,
                                       stage_memory, stage_params)
from ptc.compiler.profile.types import ModelProfile
from ptc.compiler.records.layout import Layout
from ptc.plan import HardwareSpec

HOUR = 3600.0
LLAMA3_JOB_MTBF_S = 54 * 24 * HOUR / 466
"""Llama 3's pre-training: 466 interruptions in 54 days (module docstring)."""
LLAMA3_GPUS = 16384
"""The GPUs of that job."""
PER_GPU_MTBF_S = LLAMA3_JOB_MTBF_S * LLAMA3_GPUS
"""One GPU's mean time between the job failures it causes (about 5.2 years)."""
RESTART_S = 60.0
"""R, besides reading the checkpoint back: the group noticing the failure, starting again
and compiling (an assumption: a few seconds on one node, minutes on thousands of GPUs)."""


def job_mtbf(gpus: int, mtbf_s: float | None = None) -> float:
    """M of a job of `gpus` GPUs: `mtbf_s` when the plan states it, else the per-GPU rate's."""
    return mtbf_s if mtbf_s is not None else PER_GPU_MTBF_S / max(1, gpus)


def checkpoint_interval(pause_s: float, mtbf_s: float) -> float:
    """τ: seconds of training between saves that lose least (Young/Daly)."""
    if pause_s <= 0:
        return 0.0
    if pause_s >= 2 * mtbf_s:
        return mtbf_s
    x = pause_s / (2 * mtbf_s)
    return math.sqrt(2 * pause_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - pause_s


def goodput(interval_s: float, pause_s: float, mtbf_s: float,
            restart_s: float = RESTART_S) -> float:
    """G: the share of wall time that trains, saving every `interval_s` seconds."""
    period = interval_s + pause_s
    if period <= 0:
        return 0.0
    return max(0.0, interval_s / period * (1 - (restart_s + period / 2) / mtbf_s))


def save_pause(profile: ModelProfile, layout: Layout, hw: HardwareSpec, prec: Precision
               ) -> float:
    """δ predicted for an asynchronous save: the rank holding most copies its share (1/dp, as
    the ranks split the writing) of the fp32 masters and the optimizer's moments to host
    memory, over the host link on a GPU, at half the memory bandwidth (a read and a write)
    on a CPU. The rank then goes on while the copy is written."""
    elements = max(split / layout.tp + whole
                   for split, whole, _ in (stage_params(profile, layout, stage)
                                           for stage in range(layout.pp)))
    per_element = prec.optimizer + (MASTER_BYTES if prec.weight >= MASTER_BYTES else 0)
    rate = hw.mem_bandwidth / 2 if hw.synchronous else hw.host_bandwidth
    return elements * per_element / layout.grad_ranks / rate


def snapshot_bytes(profile: ModelProfile, layout: Layout, prec: Precision, seq_len: int
                   ) -> float:
    """What one rank's in-memory snapshot holds, on the largest stage: its weights and its
    optimizer state, on the device or offloaded to the host."""
    device = (t["weights"] + t["optimizer"] for t in stage_memory(profile, layout, prec, seq_len))
    return max(d + h for d, h in zip(device, stage_host_memory(profile, layout, prec)))


def snapshot_pause(state_bytes: float, hw: HardwareSpec) -> float:
    """σ: the pause one snapshot of `state_bytes` costs training (module docstring)."""
    if hw.synchronous:
        return 3 * state_bytes / hw.mem_bandwidth
    return 3 * state_bytes / hw.host_bandwidth


def snapshot_goodput(interval_s: float, pause_s: float, snapshot_pause_s: float, step_s: float,
                     mtbf_s: float, every: int = 1, restart_s: float = RESTART_S) -> float:
    """G with a snapshot every `every` steps besides a save every `interval_s` (module
    docstring, t there the `every` steps' time)."""
    period, span = interval_s + pause_s, every * step_s
    if period <= 0 or span <= 0:
        return 0.0
    kept = span + snapshot_pause_s
    return max(0.0, interval_s / period * span / kept * (1 - (restart_s + kept / 2) / mtbf_s))
