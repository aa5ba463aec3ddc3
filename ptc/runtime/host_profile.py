"""The hardware profile of the CPU host a `gpu = cpu` plan runs on, measured once and kept.

The cpu preset's rates are a guess at some x86 server: the machine in front
of you may be several times slower or faster, and its ranks may outnumber
its cores (8 processes on 2 cores take turns on them, each step about four
times a rank's own work). `ptc run` of a CPU plan that names no hardware
profile therefore prices it with this host's: `ptc calibrate` run with the
plan's processes the first time (about 20 s on 2 cores), the profile kept
in the profile cache (`$PTC_CACHE_DIR/hosts`, else ~/.cache/ptc/profiles/hosts)
under the host's fingerprint (its CPU model, its core count, the torch
version) and the ranks a node runs, which share its cores; every later run
on that host with as many ranks a node reads it. `PTC_HOST_PROFILE=off`
keeps the preset's guesses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from ptc.compiler.profile.cache import cache_dir
from ptc.hwprofile import write_profile
from ptc.plan import HardwareSpec, Plan

SWITCH = "PTC_HOST_PROFILE"
"""Environment variable: "off" prices CPU plans with the preset's guesses."""


def applies(plan: Plan) -> bool:
    """Whether `plan` is priced with the host's profile: a CPU plan naming no profile of
    its own, unless PTC_HOST_PROFILE=off."""
    hw = plan.hardware
    return hw.synchronous and hw.profile is None and os.environ.get(SWITCH, "") != "off"


def host_profile_path(plan: Plan) -> Path:
    """Where this host's profile for `plan`'s ranks per node is kept (see module docstring)."""
    fingerprint = "|".join((_cpu_model(), str(os.cpu_count()), torch.__version__,
                            str(plan.hardware.gpus_per_node)))
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    return cache_dir() / "hosts" / f"{digest}.json"


def with_host_profile(plan: Plan, path: Path) -> Plan:
    """`plan` priced with the profile at `path`: its hardware section as if it said
    `profile = "<path>"`, the keys the plan writes itself still over the profile's."""
    hw = plan.hardware
    written = {name: getattr(hw, name) for name in hw.spans
               if name not in ("gpu", "nodes", "gpus_per_node", "profile")
               and name in {f.name for f in dataclasses.fields(HardwareSpec)}}
    hardware = HardwareSpec.preset(hw.gpu, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                                   profile=str(path), **written, spans=hw.spans)
    return dataclasses.replace(plan, hardware=hardware)


def priced_on_this_host(plan: Plan, *, measure: bool, build: Callable,
                        say: Callable[[str], None]) -> Plan:
    """`plan` priced with this host's profile where it `applies`: read from the cache, or,
    with `measure` (`ptc run`), measured first by `ptc calibrate` with the plan's processes
    (`build`: the probe model's builder, `ptc.models.build_model`) and kept, written whole
    so that another run never reads half of it; `say` gets the one line that says so.
    Without `measure` (ptc explain, plan, report) and nothing kept, the plan as it is."""
    from ptc.runtime.calibrate import calibrate  # noqa: PLC0415 - starts processes

    if not applies(plan):
        return plan
    path = host_profile_path(plan)
    if not path.exists():
        if not measure:
            return plan
        say(f"ptc run: measuring this machine once for the predictions (ptc calibrate with "
            f"the plan's {plan.num_gpus} processes); kept in {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        write_profile(calibrate(plan, build=build), partial)
        os.replace(partial, path)
    return with_host_profile(plan, path)


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
