"""What each section of a plan file may contain: its keys, their kinds, defaults.

One table per section maps a key as written in the file to the plan field
it sets and the converter that reads it. The semantic step is driven by
these tables, so adding a key is one line here (and one in
docs/plan-language.md, which a test keeps in step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ptc.dsl import calls
from ptc.dsl.values import (
    Converter,
    boolean,
    int_or_auto,
    integer,
    number,
    optional,
    quantity,
    quantity_or_auto,
    string,
    string_list,
    word,
    word_tuple,
)
from ptc.plan import (
    ACTIVATIONS,
    BACKENDS,
    DROP_POLICIES,
    DTYPES,
    FP8_RECIPES,
    FP8_SCALINGS,
    GRAD_COMMS,
    NAN_POLICIES,
    NORMS,
    OFFLOADS,
    TP_COMMS,
    LinkSpec,
)
from ptc.presets import PRESETS


@dataclass(frozen=True, slots=True)
class Key:
    """One key of a section."""

    field: str
    """The plan dataclass field it sets."""
    convert: Converter
    """Reads the value."""
    required: bool = False
    """Whether the section is invalid without it."""
    example: str = ""
    """`key = value` example for messages about a missing key."""
    placeholder: Any = None
    """Stand-in when the key is missing or wrong, so the rest can still be checked."""


def _req(field: str, convert: Converter, example: str, placeholder: Any = 1) -> Key:
    return Key(field, convert, required=True, example=example, placeholder=placeholder)


GPU_CHOICES = (*PRESETS, "custom")

MODEL_KEYS: dict[str, Key] = {
    "layers": _req("layers", integer, "layers = 32"),
    "hidden": _req("hidden", integer, "hidden = 4096"),
    "heads": _req("heads", integer, "heads = 32"),
    "kv_heads": Key("kv_heads", optional(integer)),
    "ffn": Key("ffn", optional(integer), example="ffn = 11008"),
    "vocab": _req("vocab", integer, "vocab = 32000"),
    "max_seq": _req("max_seq", integer, "max_seq = 4096"),
    "norm": Key("norm", optional(word(NORMS))),
    "activation": Key("activation", optional(word(ACTIVATIONS))),
    "tied_embeddings": Key("tied_embeddings", optional(boolean)),
    "bias": Key("bias", optional(boolean)),
    "dropout": Key("dropout", number),
    "rope_theta": Key("rope_theta", number),
    "norm_eps": Key("norm_eps", number),
}
"""model gpt|llama { ... }. llama also requires ffn."""

MODEL_FAMILIES = ("gpt", "llama")
"""Built-in families, written as `model gpt { ... }`."""

HARDWARE_KEYS: dict[str, Key] = {
    "gpu": _req("gpu", word(GPU_CHOICES), 'gpu = "H100-SXM"', placeholder="custom"),
    "nodes": Key("nodes", integer),
    "gpus_per_node": Key("gpus_per_node", integer),
    "hbm": Key("hbm_bytes", quantity("bytes"), example="hbm = 80 GiB", placeholder=1.0),
    "peak": Key("peak_flops", calls.flops, example="peak = flops(bf16 = 989 TFLOP/s)",
                placeholder={"bf16": 1.0, "fp32": 1.0, "fp16": 1.0}),
    "mem_bandwidth": Key("mem_bandwidth", quantity("bandwidth"),
                         example="mem_bandwidth = 3350 GB/s", placeholder=1.0),
    "intra": Key("intra", calls.link, example="intra = link(bandwidth = 450 GB/s, latency = 2 us)",
                 placeholder=LinkSpec(bandwidth=1.0, latency=0.0)),
    "inter": Key("inter", calls.link, example="inter = link(bandwidth = 50 GB/s, latency = 5 us)",
                 placeholder=LinkSpec(bandwidth=1.0, latency=0.0)),
    "nvlink_sharp": Key("nvlink_sharp", boolean),
    "achievable_fraction": Key("achievable_fraction", number),
    "attention_fraction": Key("attention_fraction", optional(number),
                              example="attention_fraction = 0.3"),
    "memory_margin": Key("memory_margin", quantity("bytes"), example="memory_margin = 4 GiB"),
    "host_bandwidth": Key("host_bandwidth", quantity("bandwidth"),
                          example="host_bandwidth = 64 GB/s"),
    "host_memory": Key("host_memory_bytes", quantity("bytes"), example="host_memory = 2 TB"),
    "gemm": Key("gemm_flops", calls.flops, example="gemm = flops(bf16 = 700 TFLOP/s)"),
    "dispatch_overhead": Key("dispatch_overhead", quantity("time"),
                             example="dispatch_overhead = 8 us"),
    "multiprocessors": Key("multiprocessors", integer),
    "comm_multiprocessors": Key("comm_multiprocessors", integer),
    "board_power": Key("board_power", quantity("power"), example="board_power = 700 W"),
    "min_power_limit": Key("min_power_limit", quantity("power"),
                           example="min_power_limit = 200 W"),
    "power_limit": Key("power_limit", optional(quantity("power")),
                       example="power_limit = 500 W"),
    "profile": Key("profile", optional(string), example='profile = "hw.json"'),
}
"""hardware { ... }. Fields of a preset gpu may be overridden."""

CUSTOM_GPU_KEYS = ("hbm", "peak", "mem_bandwidth", "intra", "inter")
"""Keys `gpu = custom` requires (a preset supplies them otherwise)."""

PARALLEL_KEYS: dict[str, Key] = {
    "tp": Key("tp", int_or_auto),
    "pp": Key("pp", int_or_auto),
    "dp": Key("dp", int_or_auto),
    "cp": Key("cp", int_or_auto),
    "ep": Key("ep", int_or_auto),
    "zero": Key("zero", integer),
    "sequence_parallel": Key("sequence_parallel", boolean),
    "tp_comm": Key("tp_comm", word(TP_COMMS)),
    "schedule": Key("schedule", calls.schedule),
    "virtual_stages": Key("virtual_stages", integer),
    "microbatches": Key("microbatches", optional(integer)),
    # Replaced per plan by calls.checkpoint(layers), which needs the model.
    "checkpoint": Key("checkpoint", calls.checkpoint(None)),
    "overlap": Key("overlap", boolean),
    "grad_comm": Key("grad_comm", word(GRAD_COMMS)),
    "offload": Key("offload", word(OFFLOADS)),
    "bucket_size": Key("bucket_size", quantity_or_auto("bytes"), example="bucket_size = 25 MB"),
    "order": Key("order", word_tuple),
    "stage_boundaries": Key("stage_boundaries", string_list),
    "first_stage_layers": Key("first_stage_layers", optional(integer)),
    "last_stage_layers": Key("last_stage_layers", optional(integer)),
}
"""parallel { ... }, plus `shard "glob" style` lines."""

TRAIN_KEYS: dict[str, Key] = {
    "seq_len": _req("seq_len", integer, "seq_len = 4096"),
    "global_batch": _req("global_batch", integer, "global_batch = 256"),
    "micro_batch": Key("micro_batch", integer),
    "dtype": Key("dtype", word(DTYPES)),
    "grad_dtype": Key("grad_dtype", word(DTYPES)),
    "fp8_scaling": Key("fp8_scaling", word(FP8_SCALINGS)),
    "fp8_recipe": Key("fp8_recipe", word(FP8_RECIPES)),
    "fp8_amax_history": Key("fp8_amax_history", integer),
    "fp8_emulate": Key("fp8_emulate", boolean),
    "steps": Key("steps", integer),
    "grad_clip": Key("grad_clip", optional(number)),
    "optimizer": Key("optimizer", calls.optimizer),
    "lr_schedule": Key("lr_schedule", calls.lr_schedule),
    "data": Key("data", calls.data),
    "init": Key("init", calls.init),
}
"""train { ... }."""

RUNTIME_KEYS: dict[str, Key] = {
    "backend": Key("backend", word(BACKENDS)),
    "checkpoint_dir": Key("checkpoint_dir", optional(string)),
    "checkpoint_every": Key("checkpoint_every", optional(int_or_auto)),
    "checkpoint_interval": Key("checkpoint_interval", optional(quantity("time"))),
    "mtbf": Key("mtbf", optional(quantity("time")), example="mtbf = 3 h"),
    "keep": Key("keep", integer),
    "snapshot_every": Key("snapshot_every", optional(int_or_auto)),
    "hang_timeout": Key("hang_timeout", optional(quantity_or_auto("time")),
                        example="hang_timeout = 2 min"),
    "async_save": Key("async_save", boolean),
    "nan_policy": Key("nan_policy", word(NAN_POLICIES)),
    "metrics": Key("metrics", optional(string)),
    "tensorboard": Key("tensorboard", optional(string)),
    "wandb": Key("wandb", optional(string)),
    "seed": Key("seed", integer),
    "log_every": Key("log_every", integer),
    "gc_every": Key("gc_every", optional(integer)),
    "compile": Key("compile", boolean),
}
"""runtime { ... }."""

MOE_KEYS: dict[str, Key] = {
    "capacity_factor": Key("capacity_factor", optional(number), example="capacity_factor = 1.25"),
    "drop_policy": Key("drop_policy", word(DROP_POLICIES)),
    "imbalance": Key("imbalance", optional(number), example="imbalance = 1.3"),
}
"""moe { ... }."""

SECTIONS: dict[str, dict[str, Key]] = {
    "model": MODEL_KEYS, "hardware": HARDWARE_KEYS, "parallel": PARALLEL_KEYS,
    "train": TRAIN_KEYS, "runtime": RUNTIME_KEYS, "moe": MOE_KEYS,
}
"""Section name -> its keys, in the order sections are written."""

REQUIRED_SECTIONS = ("model", "hardware", "train")
"""Sections every plan must have; parallel, runtime and moe have defaults."""

DIRECTIVES = {"parallel": ("shard",)}
"""Section -> the `keyword "string" word` lines it accepts."""
