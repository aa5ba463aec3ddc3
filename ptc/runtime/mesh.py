"""The process group of the run and a DeviceMesh over the plan's axes.

The mesh's dimensions are the plan's axes from outermost to innermost:
`parallel.order` lists them innermost first (tp, dp, pp by default), so tp
ranks are adjacent (inside a node) and pp ranks farthest apart. Each mesh
dimension's process group is what `bind_axes` gives the graphs under the
axis name.

Every group gets a finite timeout (`PTC_TIMEOUT` seconds, default 300): a
rank that waits for a dead peer raises instead of hanging.
"""

from __future__ import annotations

import datetime
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ptc.errors import PtcError
from ptc.plan import Plan

DEFAULT_TIMEOUT_S = 300.0


def timeout() -> datetime.timedelta:
    """The collective timeout: `PTC_TIMEOUT` seconds, or 300."""
    return datetime.timedelta(seconds=float(os.environ.get("PTC_TIMEOUT", DEFAULT_TIMEOUT_S)))


def backend_for(plan: Plan) -> str:
    """"nccl" or "gloo": the plan's choice, or NCCL when CUDA is available ("auto")."""
    if plan.runtime.backend != "auto":
        return plan.runtime.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def world_size(plan: Plan) -> int:
    """Processes the plan runs on: tp * cp * pp * dp."""
    p = plan.parallel
    return p.tp * p.cp * p.pp * p.dp


def init_distributed(plan: Plan) -> bool:
    """Join (or create) the default process group; True when this call created it.

    Inside a launched worker the launcher's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, ...) says where the others are; a single-process run gets a
    private in-memory store.
    """
    if dist.is_initialized():
        return False
    backend = backend_for(plan)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        device = None
        if backend == "nccl":  # the rank's GPU, set before any CUDA work or NCCL communicator
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        # device_id binds the group to that GPU: NCCL initialises at once (a bad GPU or
        # network fails here, not in the first collective) and never guesses the device.
        dist.init_process_group(backend, timeout=timeout(), device_id=device)
    elif world_size(plan) == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout())
    else:
        raise PtcError(f"the plan needs {world_size(plan)} processes; start them with "
                       f"`ptc run` or torchrun")
    if dist.get_world_size() != world_size(plan):
        raise PtcError(f"the plan needs tp*cp*pp*dp = {world_size(plan)} processes, "
                       f"but {dist.get_world_size()} were started")
    return True


def build_mesh(plan: Plan) -> DeviceMesh:
    """A DeviceMesh over the plan's axes, outermost first, with timeouts on every group."""
    names = tuple(reversed(plan.parallel.order))
    shape = tuple(plan.parallel.degree(a) for a in names)
    backend = backend_for(plan)
    return init_device_mesh("cuda" if backend == "nccl" else "cpu", shape, mesh_dim_names=names,
                            backend_override={n: (backend, _options(backend)) for n in names})


def _options(backend: str):
    options = (dist.ProcessGroupNCCL.Options() if backend == "nccl"
               else dist.ProcessGroupGloo._Options())
    options._timeout = timeout()
    return options


def axis_process_groups(mesh: DeviceMesh, ep: int = 1) -> dict[str, dist.ProcessGroup]:
    """Axis name -> this rank's process group along that mesh dimension.

    With context parallelism (cp > 1) "dp" is the group gradients are
    averaged and ZeRO shards over, the dp·cp ranks that hold other tokens of
    the same weights (as Megatron-LM's data-parallel group with cp), and
    "batch" the dp axis alone, whose coordinate says which samples a rank reads.
    With expert parallelism (`ep` > 1) also "ep" and "edp" (`expert_groups`).
    """
    names = mesh.mesh_dim_names
    groups = {name: mesh.get_group(name) for name in names}
    if "cp" in names and mesh["cp"].size() > 1:
        joint = tuple(n for n in names if n in ("dp", "cp"))
        backend = dist.get_backend(groups["cp"])
        flat = mesh[joint]._flatten("dp_cp", backend_override=(backend, _options(backend)))
        groups["batch"], groups["dp"] = groups["dp"], flat.get_group()
    if ep > 1:
        groups.update(expert_groups(mesh, ep))
    return groups


def expert_groups(mesh: DeviceMesh, ep: int) -> dict[str, dist.ProcessGroup]:
    """This rank's expert-parallel groups, folded from its dp·cp group (Megatron-Core's
    parallel folding): "ep", the ep consecutive ranks of it that share out the routed
    experts (and exchange tokens), and "edp", the dp·cp/ep ranks of it at the same place in
    their ep groups, which hold the same experts (their gradients are averaged, and ZeRO
    shards them, over it). Every rank creates every group, in the same order."""
    names = mesh.mesh_dim_names
    joint = [names.index(n) for n in names if n in ("dp", "cp")]
    others = [i for i in range(len(names)) if i not in joint]
    rows = mesh.mesh.permute(*others, *joint).reshape(-1, math.prod(
        mesh.mesh.shape[i] for i in joint)).tolist()
    backend = dist.get_backend()
    me, out = dist.get_rank(), {}
    for row in rows:  # each dp·cp group, its ranks in the order of the flattened "dp" group
        blocks = [row[k:k + ep] for k in range(0, len(row), ep)]
        for axis, members in (("ep", blocks), ("edp", [row[j::ep] for j in range(ep)])):
            for ranks in members:
                group = dist.new_group(ranks, timeout=timeout(), backend=backend,
                                       pg_options=_options(backend))
                if me in ranks:
                    out[axis] = group
    return out


def device_for(plan: Plan) -> torch.device:
    """The device this rank computes on: its GPU under NCCL, else the CPU."""
    if backend_for(plan) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
