"""Shared helpers of the multi-process tests: tiny plans, the eager reference, workers.

Workers run inside processes started by `ptc.runtime.run_local` (the elastic
launcher; each imports it afresh): they must live in an importable module, not a test file.
One launch runs many cases in a row so that process start-up (seconds on a
shared 2-core machine) is paid once per process count.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ptc.compiler.capture.call import call_rule  # noqa: E402
from ptc.plan import (  # noqa: E402
    DataSpec,
    HardwareSpec,
    InitSpec,
    LRScheduleSpec,
    ModelSpec,
    OptimizerSpec,
    ParallelSpec,
    Plan,
    RuntimeSpec,
    TrainSpec,
)
from ptc.worker import MODELS  # noqa: E402 - the built-in models, as the workers hand them in
from tests.tolerances import (  # noqa: E402
    Nudge,
    Reference,
    Run,
    Step,
    assert_losses_match,
    assert_params_match,
)

STEPS = 5
SEQ = 16
# Collectives give up after this long in tests: a bug fails the test instead of hanging it.
os.environ.setdefault("PTC_TIMEOUT", "60")


def tiny_model(family: str) -> ModelSpec:
    """A 2-layer model small enough for 4 processes on 2 cores (Llama with GQA)."""
    if family == "gpt":
        return ModelSpec(family="gpt", layers=2, hidden=32, heads=4, vocab=64, max_seq=SEQ)
    return ModelSpec(family="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64,
                     vocab=64, max_seq=SEQ)


def tiny_plan(family: str, *, zero: int, dp: int, accum: int, steps: int = STEPS,
              dtype: str = "fp32", data: DataSpec | None = None, init: InitSpec | None = None,
              metrics: str | None = None, overlap: bool = True) -> Plan:
    """A plan of the tiny model: `accum` micro-batches of one sample (two without accum)."""
    micro_batch = 1 if accum > 1 else 2
    return Plan(
        model=tiny_model(family),
        hardware=HardwareSpec.preset("cpu", gpus_per_node=dp),
        parallel=ParallelSpec(tp=1, pp=1, dp=dp, zero=zero, overlap=overlap),
        train=TrainSpec(seq_len=SEQ, global_batch=dp * accum * micro_batch,
                        micro_batch=micro_batch, dtype=dtype, steps=steps, grad_clip=1.0,
                        optimizer=OptimizerSpec(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
                        lr_schedule=LRScheduleSpec(kind="cosine", warmup=2, min_lr=3e-4),
                        data=data or DataSpec(kind="synthetic", seed=7),
                        init=init or InitSpec(kind="random", seed=3)),
        runtime=RuntimeSpec(backend="gloo", metrics=metrics),
    )


def reference_run(plan: Plan, dtype: torch.dtype = torch.float32,
                  nudge: Nudge | None = None, module: torch.nn.Module | None = None) -> Run:
    """Plain single-process PyTorch training of the plan's model on the full global batch.

    `module`: a user's module to train instead (a copy of it; its own weights),
    called as capture calls it (`ptc.compiler.capture.call`).

    torch.optim.AdamW on the eager model, the same initial weights and samples,
    `clip_grad_norm_`, the same learning-rate schedule, the same dropout masks
    (`keyed_dropout`: each sample's, whatever the layout): the ground truth. In
    float64 the weights are the fp32 ones converted (exactly): the same
    computation, rounded 2^29 times finer. In bfloat16, ptc's bf16 recipe: the
    model computes in bf16 and AdamW updates fp32 masters of its weights, which
    the run returns; with `train.grad_dtype = bf16` each micro-batch's bf16 gradients are
    summed into `.grad` in turn, as plain PyTorch accumulates them (ptc's 16-bit buffers round
    as many sums). Each step's learning rate and
    clipped gradients are kept, and `nudge` displaces the weights after each
    step, for the tolerances (`tests/tolerances.py`).
    """
    from ptc.models import build_model
    from ptc.runtime.data import TokenSource
    from ptc.runtime.lr import learning_rate

    train = plan.train
    model = copy.deepcopy(module) if module is not None else \
        build_model(plan.model, device="cpu", seed=train.init.seed)
    rule = call_rule(model)
    if train.init.kind == "state_dict":
        model.load_state_dict(torch.load(train.init.path, weights_only=True))
    # ptc's bf16 recipe: the model computes in bf16, AdamW updates fp32 masters of it.
    masters = {n: torch.nn.Parameter(p.detach().float().clone())
               for n, p in model.named_parameters()} if dtype == torch.bfloat16 else None
    model = model.to(dtype)
    trained = masters if masters is not None else dict(model.named_parameters())
    config = getattr(model, "config", None)
    if dtype == torch.float64 and getattr(config, "_experts_implementation", "eager") != "eager":
        config._experts_implementation = "eager"  # grouped_mm has no float64 kernel: the loop
    opt = torch.optim.AdamW(trained.values(), lr=train.optimizer.lr, betas=train.optimizer.betas,
                            eps=train.optimizer.eps, weight_decay=train.optimizer.weight_decay)
    # A plan without model.vocab (a transformers model's): the vocabulary its config names.
    vocab = plan.model.vocab if plan.model.vocab is not None else model.config.vocab_size
    source = TokenSource(train.data, vocab=vocab, seq_len=train.seq_len)
    losses, steps = [], []
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # tensors the model creates (masks) in the run's dtype too
    try:
        # bf16 gradient buffers: the gradients of each micro-batch summed into the model's
        # bf16 `.grad`, as plain PyTorch accumulates them; otherwise the whole batch at once.
        chunk = train.micro_batch if train.grad_dtype == "bf16" else train.global_batch
        for step in range(train.steps):
            opt.zero_grad()
            model.zero_grad()
            loss = 0.0
            for first in range(step * train.global_batch, (step + 1) * train.global_batch, chunk):
                part = _eager_loss(model, rule, source, plan, first, chunk) \
                    * (chunk / train.global_batch)
                part.backward()
                loss += part.detach()
            if masters is not None:  # the bf16 gradients into the fp32 masters
                for name, p in model.named_parameters():
                    masters[name].grad = p.grad.float() if p.grad is not None else None
            torch.nn.utils.clip_grad_norm_(trained.values(), train.grad_clip)
            lr = learning_rate(step, train.optimizer.lr, train.lr_schedule, train.steps)
            for group in opt.param_groups:
                group["lr"] = lr
            # A parameter the model does not train has no gradient: AdamW leaves it alone.
            steps.append(Step(lr, {n: p.grad.clone() if p.grad is not None else
                                   torch.zeros_like(p) for n, p in trained.items()}))
            opt.step()
            with torch.no_grad():
                if nudge is not None:
                    for name, delta in nudge(step).items():
                        trained[name].add_(delta)
                if masters is not None:  # the updated masters, rounded, are the next weights
                    for name, p in model.named_parameters():
                        p.copy_(masters[name])
            losses.append(loss.item())
    finally:
        torch.set_default_dtype(default)
    return Run(losses, {n: p.detach().clone() for n, p in trained.items()}, steps)


def _eager_loss(model, rule, source, plan: Plan, first: int, count: int) -> torch.Tensor:
    """The mean next-token loss of samples [first, first + count) in eager PyTorch, with
    ptc's dropout masks, called as capture calls the model (`rule`)."""
    tokens, targets = source.batch(first, count)
    with keyed_dropout(plan.runtime.seed, first, (count, plan.train.seq_len)):
        if rule.targets is not None:  # forward(idx, targets) -> (logits, loss) or .loss
            out = model(tokens, **{rule.targets: targets}, **rule.concrete)
            return out.loss if hasattr(out, "loss") else out[1]
        out = model(tokens, **rule.concrete)  # logits, or an output with .logits (labels None)
        logits = out.logits if hasattr(out, "logits") else out
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@contextlib.contextmanager
def keyed_dropout(seed: int, first: int, tokens: tuple[int, int] = (0, 0)):
    """Eager dropout with ptc's masks: every F.dropout and dropout inside
    scaled_dot_product_attention is a numbered site keyed by sample
    (`ptc.ops.dropout`), numbered in call order as capture numbers the graph's;
    flattened token rows [batch·seq, ...] (`tokens` = (batch, seq)) as [batch, seq, ...]."""
    from ptc.ops.dropout import Samples, dropout_samples, site_attention, site_dropout

    sites = itertools.count()
    plain_dropout, plain_sdpa = F.dropout, F.scaled_dot_product_attention

    def dropout(input, p=0.5, training=True, inplace=False):
        batch, seq = tokens
        if seq > 1 and input.shape[0] == batch * seq:
            rows = input.view(batch, seq, *input.shape[1:])
            return site_dropout(rows, p, training, next(sites)).view(input.shape)
        return site_dropout(input, p, training, next(sites))

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if not dropout_p:
            return plain_sdpa(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
        return site_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa, site=next(sites))

    F.dropout, F.scaled_dot_product_attention = dropout, sdpa
    try:
        with dropout_samples(Samples(seed=seed, first=first)):
            yield
    finally:
        F.dropout, F.scaled_dot_product_attention = plain_dropout, plain_sdpa


_references: dict[tuple[str, str, int], Reference] = {}


def reference(plan: Plan, module: torch.nn.Module | None = None) -> Reference:
    """The eager runs the tolerances of `plan` derive from, once per model and training spec
    (`module`: a user's module trained instead of the plan's model)."""
    key = repr(plan.model), repr(plan.train), id(module)  # all the eager run reads
    if key not in _references:
        optimizer = plan.train.optimizer
        _references[key] = Reference(
            lambda dtype, nudge: reference_run(plan, dtype, nudge, module), betas=optimizer.betas,
            adam_eps=optimizer.eps, tokens=plan.train.global_batch * plan.train.seq_len,
            dtype=torch.bfloat16 if plan.train.dtype == "bf16" else torch.float32)
    return _references[key]


def profile_ahead(plans: list[Plan]) -> None:
    """Worker: put the profile of every plan's model on disk, the ranks sharing the work.

    Compiling prices the plan from its model's profile (`ptc.compiler.profile.cache`),
    kept on disk under a lock: when every rank compiles the same case, one profiles and
    the others wait on the lock, and on a 2-core machine a core idles. Here rank r
    profiles every world-th model first, so the ranks profile different models at once;
    each case's compile then reads them. Only the time changes: a failure here is left
    for the compile to raise again, where the test sees it.
    """
    from ptc.compiler.profile.cache import plan_profile, with_model_shape

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # One plan per profile: the model, its compute dtype and the shard rules decide it.
    distinct: dict[str, Plan] = {}
    for plan in plans:
        distinct.setdefault(repr((plan.model, plan.train.dtype, plan.parallel.shards)), plan)
    for plan in list(distinct.values())[rank::world]:
        with contextlib.suppress(Exception):  # raised again, where it counts, by the compile
            plan_profile(with_model_shape(plan))


@contextlib.contextmanager
def case_groups(plan: Plan):
    """Worker: this case's process groups by axis (`axis_process_groups`), and every group
    made while the case runs (a Trainer's tied-weight groups) destroyed when it ends: a
    launch that trains a hundred cases would otherwise keep every case's gloo sockets open,
    past `ulimit -n` 1024."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from ptc.runtime.mesh import axis_process_groups, build_mesh

    before = set(distributed_c10d._world.pg_map)
    try:
        yield axis_process_groups(build_mesh(plan), plan.parallel.ep)
    finally:
        for group in set(distributed_c10d._world.pg_map) - before:
            dist.destroy_process_group(group)


def train_cases(cases: list, plan_of, module_of=None, gathered=None) -> dict:
    """Worker body: train every case in turn, each under its own plan's process groups.

    `plan_of(case)` gives the plan, `module_of(case)` (optional) the user's module to
    compile instead of the plan's model. Rank 0 returns, per case: losses, full
    weights after training, each step's gradient norm, held and predicted bytes, pass log; and, where `gathered`
    is given, "gathered": every rank's `gathered(trainer, program, groups)` after training.
    """
    import torch.distributed as dist

    from ptc.lower.driver import compile_plan
    from ptc.ops import weight_gathers
    from ptc.runtime.executor import Trainer
    from ptc.runtime.mesh import init_distributed

    results = {}
    profile_ahead([plan_of(case) for case in cases])
    for case in cases:
        plan = plan_of(case)
        init_distributed(plan)
        program = compile_plan(plan, model=module_of(case) if module_of else None)
        with case_groups(plan) as groups:
            trainer = Trainer(program, groups, models=MODELS)
            # As the training loop runs them: each step but the last leaves its ZeRO 1-2
            # weight all-gathers for the next forward to wait on (`ptc.ops.weight_gathers`).
            steps = plan.train.steps
            losses, norms, left = [], [], []
            for k in range(steps):
                stats = trainer.train_step(k, leave_weights=k + 1 < steps)
                losses.append(stats.loss)
                norms.append(stats.grad_norm)
                left.append(weight_gathers.pending())
            state = trainer.full_state_dict()
            held = trainer.held_bytes()
            extra = {}
            if gathered is not None:
                extra["gathered"] = [None] * dist.get_world_size()
                dist.all_gather_object(extra["gathered"], gathered(trainer, program, groups))
        if dist.get_rank() == 0:
            results[case] = {
                "losses": losses, "norms": norms, "left_in_flight": left, "state": state, "held": held,
                "predicted": program.state_bytes(), "log": program.pass_log, **extra}
    dist.destroy_process_group()
    return results


def run_cases(cases: list[tuple], dp: int) -> dict:
    """Worker: train every (family, zero, accum[, overlap]) case (`train_cases`)."""
    def plan_of(case: tuple) -> Plan:
        family, zero, accum, overlap = (*case, True)[:4]
        return tiny_plan(family, zero=zero, dp=dp, accum=accum, overlap=overlap)

    return train_cases(cases, plan_of)


def assert_same_training(got: dict, ref: Reference, what: str) -> None:
    """Losses of every step and every parameter within the derived bounds; name what does not."""
    assert_losses_match(got["losses"], ref, what)
    assert_params_match(got["state"], ref, what)


def fail_on_rank_1(how: str) -> int:
    """Worker: rank 1 raises a ValueError ("raise") or is killed by SIGKILL ("kill"); the
    others wait to be stopped."""
    import signal
    import time

    if int(os.environ["RANK"]) == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("rank 1 fails on purpose")
    time.sleep(60)
    return 0
