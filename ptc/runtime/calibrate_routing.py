"""The routing's load imbalance on the run's data, for `ptc calibrate` of an ep plan.

Under expert parallelism every rank waits, at each layer's exchange, for the
rank whose experts received the most rows. How uneven that is depends on the
router's weights and on the tokens: the cost model prices it as
`moe.imbalance` (`ptc.compiler.cost.step.expert_wait`). Here the plan's own
program trains a few steps on the run's data, from the run's initial weights
(an `init = hf(...)` checkpoint's routers route as they will in the run; a
fresh init routes as a fresh run starts), and each dispatch counts the rows
each ep rank's experts received (`ptc.ops.expert_parallel.RoutedTokens`):
the imbalance is the busiest rank's rows over the mean, averaged over the
layers, micro-batches and steps of every ep group.
"""

from __future__ import annotations

import torch.distributed as dist

from ptc.hwprofile import Routing
from ptc.plan import Plan
from ptc.runtime.executor import Trainer
from ptc.runtime.init import ModelFactory
from ptc.runtime.train import Compiler


def measure_routing(plan: Plan, groups, *, compiler: Compiler, models: ModelFactory,
                    device, steps: int) -> Routing | None:
    """Train `steps` steps of `plan` (collective over its ranks) and return the routing's
    mean imbalance over every rank's dispatches; None where nothing was dispatched (ep 1,
    or no routed experts)."""
    trainer = Trainer(compiler(plan), groups, models=models, device=device)
    seen = [stats.expert_imbalance for stats in (trainer.train_step(i) for i in range(steps))]
    mine = [x for x in seen if x is not None]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    values = [x for rank in every for x in rank]
    if not values:
        return None
    return Routing(imbalance=max(1.0, sum(values) / len(values)), ep=plan.parallel.ep,
                   steps=steps)
