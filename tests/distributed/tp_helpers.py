"""Helpers of the tensor-parallel tests: plans of the tiny models with tp, and the worker.

Workers run inside processes started by `ptc.runtime.run_local`, which import
this module afresh: they live here, importable, not in a test file. One launch trains every case
of one process count in a row: process start-up is paid once per count.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from dist_helpers import (MODELS, SEQ, STEPS, case_groups, profile_ahead, tiny_model, tiny_plan,
                          train_cases)

from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, ShardRule

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the shared measurement helpers: tests/memory/measure.py
    sys.path.insert(0, str(ROOT))

NANOGPT = "tests.user_models.nanogpt:nanogpt"


@dataclasses.dataclass(frozen=True)
class TPCase:
    """One tensor-parallel layout of one tiny model."""

    family: str
    """"gpt", "llama" or "nanogpt" (the user model of tests/user_models); "+dropout" adds
    dropout 0.1 (attention probabilities, residual, embedding); "llama+kvN" has N key/value
    heads (8 query heads at tp 4), fewer than tp: replicated."""
    tp: int
    sp: bool = False
    dp: int = 1
    zero: int = 0
    shards: tuple[tuple[str, str], ...] = ()
    """(glob, style) shard rules, e.g. a replicated embedding."""
    tp_comm: str = "sync"
    """parallel.tp_comm: "async" runs sequence parallelism's collectives as collective
    matmuls (`ptc.ops.async_tp`)."""
    dtype: str = "fp32"
    checkpoint: str = "none"

    @property
    def world(self) -> int:
        """Processes the case runs on."""
        return self.tp * self.dp

    def __str__(self) -> str:
        dp = f" dp{self.dp} zero{self.zero}" if self.dp > 1 else ""
        rules = "".join(f" {glob}={style}" for glob, style in self.shards)
        extra = "".join(f" {v}" for v, default in ((self.tp_comm, "sync"), (self.dtype, "fp32"),
                                                    (self.checkpoint, "none")) if v != default)
        return f"{self.family} tp{self.tp}{' sp' if self.sp else ''}{extra}{dp}{rules}"


def tp_model(family: str, tp: int) -> ModelSpec:
    """The tiny model of `family`, with head counts tp divides (Llama keeps grouped-query attention)."""
    family, dropout = family.removesuffix("+dropout"), 0.1 if family.endswith("+dropout") else 0.0
    if family.startswith("llama+kv"):  # fewer key/value heads than tp: replicated
        heads = 4 if tp <= 2 else 8
        return dataclasses.replace(tiny_model("llama"), heads=heads,
                                   kv_heads=int(family.removeprefix("llama+kv")))
    if family == "nanogpt":
        return ModelSpec(family="custom", factory=NANOGPT, vocab=64, max_seq=SEQ,
                         kwargs=dict(n_layer=2, n_head=4, n_embd=32, vocab_size=64,
                                     block_size=SEQ, dropout=dropout, bias=True))
    if dropout:
        return dataclasses.replace(tiny_model(family), dropout=dropout)
    if family == "llama" and tp > 2:  # 2 kv heads cannot be split 4 ways: 8 q over 4 kv heads
        return dataclasses.replace(tiny_model("llama"), heads=8, kv_heads=4)
    return tiny_model(family)


def tp_plan(case: TPCase, steps: int = STEPS) -> Plan:
    """The tiny model of `case`, two samples per micro-batch, one micro-batch per dp rank."""
    base = tiny_plan("gpt", zero=case.zero, dp=case.dp, accum=1, steps=steps, dtype=case.dtype)
    return dataclasses.replace(
        base, model=tp_model(case.family, case.tp),
        hardware=HardwareSpec.preset("cpu", gpus_per_node=case.world),
        parallel=ParallelSpec(tp=case.tp, dp=case.dp, zero=case.zero,
                              sequence_parallel=case.sp, tp_comm=case.tp_comm,
                              checkpoint=case.checkpoint,
                              shards=tuple(ShardRule(pattern=glob, style=style)
                                           for glob, style in case.shards)))


def run_tp_cases(cases: list[TPCase]) -> dict:
    """Worker: train every case (`dist_helpers.train_cases`)."""
    return train_cases(cases, tp_plan)


@dataclasses.dataclass(frozen=True)
class MemoryCase:
    """One tp layout of one model whose saved activations a rank measures."""

    spec: ModelSpec
    sp: bool
    dtype: str = "fp32"
    checkpoint: str | tuple[str, ...] = "none"
    """A recompute policy, or one per layer."""
    budget: float | None = None
    """Bytes per GPU "auto" fits in (through memory_margin); None: the whole HBM."""
    shards: tuple[tuple[str, str], ...] = ()
    """(pattern, style) of the plan's shard rules: modules kept whole or split by hand."""
    recipe: str = "tensorwise"
    """train.fp8_recipe of an fp8 case (rowwise and mxfp8 with current scaling)."""

    def __str__(self) -> str:
        ckpt = self.checkpoint if isinstance(self.checkpoint, str) else ",".join(self.checkpoint)
        rules = "".join(f"-{pattern}={style}" for pattern, style in self.shards)
        dtype = self.dtype if self.recipe == "tensorwise" else f"{self.dtype}:{self.recipe}"
        model = self.spec.factory.rpartition(":")[2] if self.spec.factory else \
            f"{self.spec.family}-kv{self.spec.num_kv_heads}"
        return f"{model}{'-sp' if self.sp else ''}-{dtype}-{ckpt}{rules}"


def memory_plan(case: MemoryCase, tp: int) -> Plan:
    """The plan a `MemoryCase` is measured under: one micro-batch of two samples (fp8
    emulated)."""
    fp8 = case.dtype == "fp8"
    base = tiny_plan("gpt", zero=0, dp=1, accum=1, dtype="bf16" if fp8 else case.dtype)
    if fp8:
        base = dataclasses.replace(base, train=dataclasses.replace(
            base.train, dtype="fp8", fp8_emulate=True, fp8_recipe=case.recipe,
            fp8_scaling="delayed" if case.recipe == "tensorwise" else "current"))
    hw = HardwareSpec.preset("cpu", gpus_per_node=tp)
    if case.budget is not None:
        hw = dataclasses.replace(hw, memory_margin=hw.hbm_bytes - case.budget)
    return dataclasses.replace(
        base, model=case.spec, hardware=hw,
        parallel=ParallelSpec(tp=tp, sequence_parallel=case.sp and tp > 1,
                              checkpoint=case.checkpoint,
                              shards=tuple(ShardRule(pattern=pattern, style=style)
                                           for pattern, style in case.shards)))


def resolved_policies(case: MemoryCase, tp: int) -> str | tuple[str, ...]:
    """The case's policy; for an "auto" one, the estimate's per-layer choice."""
    from ptc.compiler.search.estimate import estimate
    from ptc.plan import is_auto_checkpoint

    if not is_auto_checkpoint(case.checkpoint):
        return case.checkpoint
    return estimate(memory_plan(case, tp)).layout.checkpoint


def predicted_activations(case: MemoryCase, tp: int) -> float:
    """The memory model's activation bytes of one rank for `case` at tensor parallelism `tp`."""
    from ptc.compiler.records.layout import Layout
    from ptc.compiler.memory.model import precision, stage_memory
    from ptc.compiler.profile.types import DTYPES
    from ptc.compiler.profile.cache import plan_profile

    plan = memory_plan(case, tp)
    layout = Layout(tp=tp, pp=1, dp=1, vstages=1, micro_batch=plan.train.micro_batch,
                    microbatches=1, zero=0, sp=case.sp and tp > 1, schedule="1f1b",
                    layers=case.spec.layers, checkpoint=resolved_policies(case, tp),
                    overlap=True)
    prec = precision(DTYPES[case.dtype].itemsize, "adamw")
    return stage_memory(plan_profile(plan), layout, prec,
                        plan.train.seq_len)[0]["activations"]


def measure_activations(cases: list[MemoryCase], tp: int) -> list[list[tuple]]:
    """Worker: per case, per rank, (bytes its forward keeps for backward, the CPU LayerNorm
    gap of `cpu_statistics_gap`, the per-layer policies its program applies).

    Counted as `tests/memory/test_measured_activations.py` does — distinct
    storages of what autograd saves, parameters and buffers left out — on
    what the runtime really keeps: under sequence parallelism the saved
    gathered activations are their local chunks (`SeqRegather`), a
    checkpoint region's inputs among them (torch's checkpoint saves them
    through the same hooks); what a saving region caches
    (`tests/memory/measure.py`) and the chunks a session holds count too.
    Every rank's figure comes back.
    """
    import torch.distributed as dist

    from ptc.runtime.mesh import init_distributed

    results = []
    profile_ahead([memory_plan(case, tp) for case in cases])
    for case in cases:
        plan = memory_plan(case, tp)
        init_distributed(plan)
        with case_groups(plan) as groups:
            results.append(_measure_case(case, plan, groups))
    dist.destroy_process_group()
    return results


def _measure_case(case: MemoryCase, plan, groups) -> list:
    """Worker: every rank's (saved bytes, CPU LayerNorm gap, per-layer policies) of one case
    (`measure_activations`), run under `groups`."""
    import math

    import torch
    import torch.distributed as dist

    from ptc.compiler.graph.meta import get_info
    from ptc.compiler.profile.types import DTYPES
    from ptc.lower.driver import compile_plan
    from ptc.ops.comm import bind_axes
    from ptc.ops.seq_regather import SeqRegather, _SeqRef
    from ptc.runtime.executor import Trainer
    from recompute_worker import program_policies
    from tests.memory.measure import cached_by_regions, kept_norm_nodes
    from tests.memory.test_measured_activations import cpu_statistics_gap

    program = compile_plan(plan)
    trainer = Trainer(program, groups, models=MODELS)
    gm = trainer.chunks[0].gm
    state = {t.untyped_storage().data_ptr() for t in (*gm.parameters(), *gm.buffers())}
    saved: dict[int, int] = {}
    regather = SeqRegather()

    def note(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in state:
            saved[storage.data_ptr()] = storage.nbytes()

    def pack(t: torch.Tensor):
        kept = regather.pack(t)
        note(kept.chunk if isinstance(kept, _SeqRef) else t)
        return kept

    tokens, targets = trainer.data.batch(0, plan.train.micro_batch)
    with bind_axes(groups), regather, cached_by_regions(note), \
            torch.autograd.graph.saved_tensors_hooks(pack, regather.unpack):
        loss = trainer.chunks[0].runner.run(tokens, targets)
    for chunk in regather.chunks():  # the chunks the session holds
        note(chunk)
    with bind_axes(groups):
        loss.backward()  # the graph (and every saved storage) lived until here
    gap = sum(cpu_statistics_gap(1, math.prod(get_info(n).shapes[0][:-1]),
                                 DTYPES[case.dtype]) for n in kept_norm_nodes(gm))
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (sum(saved.values()), gap, program_policies(program)))
    return per_rank
