"""Whether in-memory snapshots have room on a node: the one rule a run applies to the
tmpfs space its node has and `ptc explain` to a node's default tmpfs. Kept apart from
`ptc.runtime.snapshot`, whose imports (checkpointing, safetensors) a plan's explanation
does not need."""

from __future__ import annotations


def snapshots_fit(need: int, free: int) -> bool:
    """Whether `runtime.snapshot_every = auto` keeps snapshots: they need at most half the
    free space (tmpfs is host memory; the rest is left to the processes)."""
    return 2 * need <= free


def default_tmpfs(host_memory: int) -> int:
    """The size Linux gives /dev/shm by default: half the host memory."""
    return host_memory // 2
