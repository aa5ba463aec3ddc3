"""Helpers of the Hugging Face model tests: plans, seeded modules, and the worker.

Workers run inside processes started by `ptc.runtime.run_local`, which import
this module afresh: they live here, importable. Every rank builds the module from the same
factory under the same seed, so all start from one set of weights, the ones
the eager reference starts from.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch
from dist_helpers import SEQ, STEPS, train_cases

from ptc.plan import (DataSpec, HardwareSpec, LRScheduleSpec, ModelSpec, MoESpec,
                      OptimizerSpec, ParallelSpec, Plan, ShardRule, TrainSpec)

MODELS = "tests.user_models.transformers_models"
SEED = 13


@dataclasses.dataclass(frozen=True)
class HFCase:
    """One layout of one tiny transformers model, on 2 processes."""

    model: str
    """A factory of tests/user_models/transformers_models ("llama", "gpt2")."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert parallelism, folded from dp·cp (not a factor of the world size)."""
    zero: int = 0
    sp: bool = False
    checkpoint: str = "none"
    config: tuple[tuple[str, object], ...] = ()
    """Overrides of the factory's config, e.g. (("pad_token_id", 1),)."""
    shards: tuple[tuple[str, str], ...] = ()
    """The plan's shard rules: (glob, style) pairs."""
    dtype: str = "fp32"
    """The plan's compute dtype."""
    schedule: str = "1f1b"
    """The pipeline schedule (pp > 1)."""
    capacity: float | None = None
    """moe.capacity_factor (None: dropless)."""
    drop_policy: str = "probs"
    """moe.drop_policy."""

    def __str__(self) -> str:
        parts = [self.model] + [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp),
                                                       ("dp", self.dp), ("cp", self.cp),
                                                       ("ep", self.ep)) if v > 1]
        parts += [f"zero{self.zero}"] if self.zero else []
        parts += ["sp"] if self.sp else []
        parts += [self.checkpoint] if self.checkpoint != "none" else []
        parts += [f"{key}={value}" for key, value in self.config]
        parts += [f"shard {glob} {style}" for glob, style in self.shards]
        parts += [self.dtype] if self.dtype != "fp32" else []
        parts += [self.schedule] if self.schedule != "1f1b" else []
        parts += [f"capacity={self.capacity}:{self.drop_policy}"] if self.capacity else []
        return " ".join(parts)


def hf_module(case: HFCase) -> torch.nn.Module:
    """The case's module with the weights of its own init under SEED."""
    torch.manual_seed(SEED)
    return getattr(importlib.import_module(MODELS), case.model)(**dict(case.config))


def hf_plan(case: HFCase) -> Plan:
    """A plan around the module: one sample per micro-batch, 4 per step, fp32, AdamW."""
    world = case.tp * case.pp * case.dp * case.cp
    return Plan(
        # max_seq as the profile resolves it (the configs' max_position_embeddings = SEQ):
        # without it the model is profiled twice, once per spelling of its spec.
        model=ModelSpec(family="custom", factory=f"{MODELS}:{case.model}", kwargs=dict(case.config),
                        max_seq=SEQ),
        hardware=HardwareSpec.preset("cpu", gpus_per_node=world),
        parallel=ParallelSpec(tp=case.tp, pp=case.pp, dp=case.dp, cp=case.cp, ep=case.ep,
                              zero=case.zero,
                              sequence_parallel=case.sp, checkpoint=case.checkpoint,
                              schedule=case.schedule,
                              shards=tuple(ShardRule(pattern=glob, style=style)
                                           for glob, style in case.shards)),
        train=TrainSpec(seq_len=SEQ, global_batch=4, micro_batch=1, dtype=case.dtype, steps=STEPS,
                        grad_clip=1.0,
                        optimizer=OptimizerSpec(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
                        lr_schedule=LRScheduleSpec(kind="cosine", warmup=2, min_lr=3e-4),
                        data=DataSpec(kind="synthetic", seed=7)),
        moe=MoESpec(capacity_factor=case.capacity, drop_policy=case.drop_policy))


def run_hf_cases(cases: list[HFCase]) -> dict:
    """Worker: train every case from its seeded module (`dist_helpers.train_cases`)."""
    return train_cases(cases, hf_plan, hf_module)


def record_ep_step(cases: list[HFCase]) -> dict:
    """Worker: per case, one training step's bytes each rank handed expert parallelism's
    all-to-alls (`ptc.ops.comm.record_collectives`), every rank's ("sent"); rank 0's
    bytes handed all-reduces over its tp group ("tp_sent"); and the step's spread of rows
    per expert (`StepStats.expert_tokens`, rank 0's)."""
    import torch.distributed as dist
    from dist_helpers import MODELS, case_groups  # noqa: PLC0415 - a worker imports its own

    from ptc.lower.driver import compile_plan
    from ptc.ops.comm import record_collectives
    from ptc.runtime.executor import Trainer
    from ptc.runtime.mesh import init_distributed

    out = {}
    for case in cases:
        plan = hf_plan(case)
        init_distributed(plan)
        program = compile_plan(plan, model=hf_module(case))
        with case_groups(plan) as groups:
            trainer = Trainer(program, groups, models=MODELS)
            with record_collectives() as log:
                stats = trainer.train_step(0)
            sent = sum(nbytes for op, _, _, nbytes in log if op == "all_to_all")
            tp_ranks = tuple(dist.get_process_group_ranks(groups["tp"])) \
                if groups.get("tp") is not None else ()
            tp_sent = sum(nbytes for op, ranks, _, nbytes in log
                          if op == "all_reduce" and tp_ranks and ranks == tp_ranks)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, sent)
        dropped = [None] * dist.get_world_size()
        dist.all_gather_object(dropped, stats.expert_dropped)
        out[case] = {"sent": every, "tp_sent": tp_sent, "expert_tokens": stats.expert_tokens,
                     "dropped": dropped}
    dist.destroy_process_group()
    return out
