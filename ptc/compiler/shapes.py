"""`plan_from_shape`: a Plan for a built-in family from shape numbers alone.

For scoring tables of published runs and for notebooks: no plan file, only
the numbers a paper states. Everything not given takes the plan defaults.
"""

from __future__ import annotations

from typing import Any

from ptc.plan import (
    HardwareSpec,
    ModelSpec,
    OptimizerSpec,
    ParallelSpec,
    Plan,
    TrainSpec,
)


def plan_from_shape(*, family: str, layers: int, hidden: int, heads: int, vocab: int,
                    seq_len: int, global_batch: int, gpu: str | HardwareSpec, num_gpus: int,
                    ffn: int | None = None, kv_heads: int | None = None,
                    tied_embeddings: bool | None = None, dropout: float = 0.0,
                    tp: int | str = 1, pp: int | str = 1, dp: int | str = "auto",
                    micro_batch: int = 1, dtype: str = "bf16", gpus_per_node: int | None = None,
                    optimizer: str = "adamw", **parallel: Any) -> Plan:
    """A Plan of a `family` ("gpt", "llama") model of the given shape on `num_gpus` GPUs.

    `gpu` is a preset name or a HardwareSpec (its node count is recomputed
    from `num_gpus`). `dp = "auto"` takes what tp·pp leaves; other keyword
    arguments (zero, sequence_parallel, schedule, virtual_stages, checkpoint,
    overlap, order, microbatches) go to ParallelSpec. `num_gpus` must fill whole
    nodes of `gpus_per_node` (the preset's, or fewer when `num_gpus` is fewer): a
    256-GPU run on 72-GPU NVL72 racks says the 64 per rack it uses.
    """
    model = ModelSpec(family=family, layers=layers, hidden=hidden, heads=heads, vocab=vocab,
                      ffn=ffn, kv_heads=kv_heads, max_seq=seq_len, tied_embeddings=tied_embeddings,
                      dropout=dropout)
    hardware = hardware_for(gpu, num_gpus, gpus_per_node)
    if dp == "auto" and tp != "auto" and pp != "auto":
        dp = num_gpus // (tp * pp)
    return Plan(model=model, hardware=hardware,
                parallel=ParallelSpec(tp=tp, pp=pp, dp=dp, **parallel),
                train=TrainSpec(seq_len=seq_len, global_batch=global_batch,
                                micro_batch=micro_batch, dtype=dtype,
                                optimizer=OptimizerSpec(name=optimizer)))


def hardware_for(gpu: str | HardwareSpec, num_gpus: int,
                 gpus_per_node: int | None = None) -> HardwareSpec:
    """`num_gpus` GPUs of a preset (or of a HardwareSpec, its node count recomputed), in whole
    nodes of `gpus_per_node` (the preset's, or fewer when `num_gpus` is fewer): a 256-GPU run
    on 72-GPU NVL72 racks says the 64 per rack it uses."""
    if isinstance(gpu, HardwareSpec):
        per_node = gpus_per_node or gpu.gpus_per_node
        hardware = HardwareSpec(**{**{f: getattr(gpu, f) for f in gpu.__dataclass_fields__},
                                   "gpus_per_node": min(per_node, num_gpus),
                                   "nodes": max(1, num_gpus // per_node)})
    else:
        probe = HardwareSpec.preset(gpu)
        per_node = min(gpus_per_node or probe.gpus_per_node, num_gpus)
        hardware = HardwareSpec.preset(gpu, nodes=num_gpus // per_node, gpus_per_node=per_node)
    if num_gpus % hardware.gpus_per_node:
        raise ValueError(f"num_gpus({num_gpus}) is not a multiple of gpus_per_node"
                         f"({hardware.gpus_per_node}); pass the gpus_per_node the run uses")
    return hardware


def even_cut(layers: int, pp: int) -> dict[str, int]:
    """The plan fields that pin the even pipeline cut of `layers` over `pp` ranks ({} for no
    pipeline or layers pp does not divide): a published run's cut, where ptc would otherwise
    price the cut its cost model balances."""
    if pp == 1 or layers % pp:
        return {}
    ends = dict(first_stage_layers=layers // pp)
    return ends if pp == 2 else {**ends, "last_stage_layers": layers // pp}
