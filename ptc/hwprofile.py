"""Hardware profiles: the figures `ptc calibrate` measured, as a JSON file a plan can name.

`hardware { profile = "hw.json" }` reads the file (a path relative to the
plan file) and its figures replace the preset's; keys written in the
hardware section replace the profile's in turn. A profile holds:

- `gemm_flops`: FLOP/s of matrix products, per compute dtype it was measured in;
- `mem_bandwidth`: bytes/s memory-bound ops (element-wise, norms, softmax) move;
- `dispatch_overhead`: host seconds per op dispatched;
- `intra` / `inter`: latency and bandwidth of the links, fitted per mesh axis to
  the cost model's collectives (`ptc.compiler.cost.collectives`); a link no axis used is absent;
- `power`: the power limit the device ran under (watts, `limit`) and the SM clock it
  sustained in the GEMM probe (MHz, `sm_clock`), so the profile describes the part
  as capped; where they could not be read, `unmeasured` says why instead. A limit
  read becomes the plan's `power_limit`;
- `routing` (plans with expert parallelism): the routing's load imbalance measured on
  the run's data (`imbalance`: the rows the busiest ep rank's experts received in a layer
  over the mean, averaged over the layers' exchanges of `steps` training steps at `ep`),
  which a plan naming
  the profile prices unless its `moe.imbalance` says otherwise;
- `device` ("cpu" or "cuda"), which a plan's `gpu` must match ("cpu" with a
  CPU profile, any GPU with a CUDA one), and what it was measured with
  (`world_size`, `device_name`, `torch`, `created`, per axis `axes`, raw
  `probes`), for the record.

`load_profile` reads and checks a file and raises `ProfileError` with one
line saying what is wrong; `overrides` turns it into HardwareSpec fields.
Standard library only: the plan language reads profiles without torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptc.errors import PtcError

FORMAT = 1
"""Version of the file format, written as `"ptc_hardware_profile": 1`."""
DEVICES = ("cpu", "cuda")
COMPUTE_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
LINKS = ("intra", "inter")


class ProfileError(PtcError):
    """A hardware profile file is missing or malformed; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Link:
    """One link's fitted figures."""

    bandwidth: float
    """Bytes/s per rank and direction."""
    latency: float
    """Seconds per transfer."""


@dataclass(frozen=True, slots=True)
class Power:
    """The device's power limit and the clock it sustained, or why they are unknown."""

    limit: float | None = None
    """Watts the device was held to (its enforced power limit) while measured."""
    sm_clock: float | None = None
    """MHz the SMs ran at in the GEMM probe (the median of its rounds)."""
    unmeasured: str = ""
    """Why `limit` or `sm_clock` could not be read ("" when both were)."""

    def to_json(self) -> dict[str, Any]:
        """The file's `power` object."""
        data: dict[str, Any] = {"limit": self.limit, "sm_clock": self.sm_clock}
        if self.unmeasured:
            data["unmeasured"] = self.unmeasured
        return data


@dataclass(frozen=True, slots=True)
class Routing:
    """The routing's load imbalance one calibration measured on the run's data."""

    imbalance: float
    """Rows the busiest ep rank's experts received in a layer over the mean (>= 1)."""
    ep: int
    """The expert-parallel size it was measured at."""
    steps: int
    """Training steps of the run's data it was averaged over."""

    def to_json(self) -> dict[str, Any]:
        """The file's `routing` object."""
        return {"imbalance": self.imbalance, "ep": self.ep, "steps": self.steps}


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """The figures of one profile file (see the module docstring)."""

    device: str
    gemm_flops: dict[str, float]
    mem_bandwidth: float
    dispatch_overhead: float
    links: dict[str, Link] = field(default_factory=dict)
    power: Power | None = None
    """The power limit and sustained clock (None: a profile written before they were
    recorded)."""
    routing: Routing | None = None
    """The routing's measured imbalance (None: the plan has no expert parallelism, or a
    profile written before it was measured)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Everything else the file records (what it was measured with, per-axis fits, probes)."""

    def overrides(self) -> dict[str, Any]:
        """HardwareSpec fields (as plain values; links as (bandwidth, latency)) it sets."""
        values: dict[str, Any] = {"gemm_flops": dict(self.gemm_flops),
                                  "mem_bandwidth": self.mem_bandwidth,
                                  "dispatch_overhead": self.dispatch_overhead}
        for name, link in self.links.items():
            values[name] = (link.bandwidth, link.latency)
        if self.power is not None and self.power.limit is not None:
            values["power_limit"] = self.power.limit
        return values

    def to_json(self) -> dict[str, Any]:
        """The file's content."""
        data = {"ptc_hardware_profile": FORMAT, "device": self.device,
                "gemm_flops": dict(self.gemm_flops), "mem_bandwidth": self.mem_bandwidth,
                "dispatch_overhead": self.dispatch_overhead}
        for name, link in self.links.items():
            data[name] = {"bandwidth": link.bandwidth, "latency": link.latency}
        if self.power is not None:
            data["power"] = self.power.to_json()
        if self.routing is not None:
            data["routing"] = self.routing.to_json()
        data.update(self.info)
        return data


def write_profile(profile: HardwareProfile, path: str | Path) -> None:
    """Write `profile` to `path` as indented JSON."""
    Path(path).write_text(json.dumps(profile.to_json(), indent=2) + "\n", encoding="utf-8")


def load_profile(path: str | Path) -> HardwareProfile:
    """Read and check the profile at `path`; ProfileError (one line) when it cannot."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError("no such file (write one with `ptc calibrate PLAN -o FILE`)") \
            from None
    except (OSError, ValueError) as exc:  # ValueError: undecodable bytes, a NUL in the path
        raise ProfileError(f"cannot be read: {getattr(exc, 'strerror', None) or exc}") \
            from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") \
            from None
    return parse_profile(data)


def parse_profile(data: Any) -> HardwareProfile:
    """A HardwareProfile from decoded JSON; ProfileError naming the first bad field."""
    if not isinstance(data, dict):
        raise ProfileError(f"must hold a JSON object, found {type(data).__name__}")
    if data.get("ptc_hardware_profile") != FORMAT:
        raise ProfileError(f'not a ptc hardware profile: "ptc_hardware_profile" must be '
                           f"{FORMAT}, found {data.get('ptc_hardware_profile')!r}")
    device = data.get("device")
    if device not in DEVICES:
        raise ProfileError(f'"device" must be one of {", ".join(DEVICES)}, found {device!r}')
    gemm = data.get("gemm_flops")
    if not isinstance(gemm, dict) or not gemm:
        raise ProfileError('"gemm_flops" must be an object of FLOP/s per compute dtype, '
                           f'e.g. {{"bf16": 7.0e14}}, found {gemm!r}')
    for dtype, value in gemm.items():
        if dtype not in COMPUTE_DTYPES:
            raise ProfileError(f'"gemm_flops" names unknown compute dtype {dtype!r} '
                               f"(valid: {', '.join(COMPUTE_DTYPES)})")
        _positive(value, f'"gemm_flops.{dtype}"')
    links = {}
    for name in LINKS:
        if name not in data:
            continue
        link = data[name]
        if not isinstance(link, dict):
            raise ProfileError(f'"{name}" must be an object with bandwidth and latency')
        links[name] = Link(bandwidth=_positive(link.get("bandwidth"), f'"{name}.bandwidth"'),
                           latency=_positive(link.get("latency"), f'"{name}.latency"',
                                             zero=True))
    known = {"ptc_hardware_profile", "device", "gemm_flops", "mem_bandwidth",
             "dispatch_overhead", "power", "routing", *LINKS}
    return HardwareProfile(
        device=device, gemm_flops={d: float(v) for d, v in gemm.items()},
        mem_bandwidth=_positive(data.get("mem_bandwidth"), '"mem_bandwidth"'),
        dispatch_overhead=_positive(data.get("dispatch_overhead"), '"dispatch_overhead"',
                                    zero=True),
        links=links, power=_power(data.get("power")), routing=_routing(data.get("routing")),
        info={k: v for k, v in data.items() if k not in known})


def _power(data: Any) -> Power | None:
    """The `power` object of a profile (None where the file has none)."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ProfileError('"power" must be an object with limit and sm_clock')
    limit, clock = data.get("limit"), data.get("sm_clock")
    unmeasured = data.get("unmeasured", "")
    if not isinstance(unmeasured, str):
        raise ProfileError(f'"power.unmeasured" must be a string, found {unmeasured!r}')
    if (limit is None or clock is None) and not unmeasured:
        raise ProfileError('"power" without limit or sm_clock must say why in "unmeasured"')
    return Power(limit=None if limit is None else _positive(limit, '"power.limit"'),
                 sm_clock=None if clock is None else _positive(clock, '"power.sm_clock"'),
                 unmeasured=unmeasured)


def _routing(data: Any) -> Routing | None:
    """The `routing` object of a profile (None where the file has none)."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ProfileError('"routing" must be an object with imbalance, ep and steps')
    imbalance = _positive(data.get("imbalance"), '"routing.imbalance"')
    if imbalance < 1:
        raise ProfileError(f'"routing.imbalance" must be >= 1, found {imbalance!r}')
    ep, steps = data.get("ep"), data.get("steps")
    for name, value in (("ep", ep), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ProfileError(f'"routing.{name}" must be a positive integer, found {value!r}')
    return Routing(imbalance=imbalance, ep=ep, steps=steps)


def _positive(value: Any, name: str, *, zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{name} must be a finite number, found {value!r}")
    if value < 0 or (value == 0 and not zero):
        raise ProfileError(f"{name} must be {'>= 0' if zero else '> 0'}, found {value!r}")
    return float(value)
