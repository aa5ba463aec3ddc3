"""Copies between the device and host memory that run beside the device's computation.

Terms: a *lane* carries the copies of one direction (device to host, or
host to device) in the order they are queued; a *landing* is one copy in
flight. Whoever reads or overwrites what a copy touches waits for its
landing first, in one of two ways:

- `wait_host`: the Python thread blocks until the copy is done (the CPU is
  about to read its destination or overwrite its source);
- `wait_device`: work queued on the device from now on runs after the copy
  (the device is about to read its destination); the thread goes on.

On a GPU a lane is a CUDA stream of its own, so its copies (from or into
pinned memory) run while the compute stream and the CPU work; a landing
is a CUDA event. A lane's copies start after what the compute stream had
been given when the copy was queued, and after the landing named as
`after` (a copy into a buffer another copy still reads).

On a CPU device a copy runs when its landing is first waited for, by
either wait: the latest moment an asynchronous copy may land. The arithmetic
is the GPU's, and a reader that forgot to wait sees the old values — in
tests, on any machine, instead of as a rare race on a GPU.
"""

from __future__ import annotations

import torch


class Landing:
    """One copy queued on a lane (see the module docstring)."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, *,
                 event: torch.cuda.Event | None = None, device: torch.device | None = None):
        """A copy on a GPU lane that recorded `event` after it, on `device`; without an
        event, a CPU device's copy of `src` into `dst`, not yet run."""
        self._pending = (dst, src) if event is None else None
        self._event, self._device = event, device

    def wait_host(self) -> None:
        """Block until the copy is done."""
        if self._event is not None:
            self._event.synchronize()
        self._run()

    def wait_device(self) -> None:
        """Make work queued on the device's current stream from now on run after the copy."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        self._run()

    def _run(self) -> None:
        if self._pending is not None:
            dst, src = self._pending
            self._pending = None
            with torch.no_grad():
                dst.copy_(src)


class Lane:
    """Copies in one direction between `device` and host memory, in queue order."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: Landing | None = None
             ) -> Landing:
        """Queue `dst.copy_(src)` between a device tensor and a pinned host tensor of the
        same dtype (a cast would stage through pageable memory and block); it starts after
        the work queued on the device so far and after the landing `after`."""
        if self._stream is None:
            if after is not None:
                after.wait_host()
            return Landing(dst, src)
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        if after is not None and after._event is not None:
            self._stream.wait_event(after._event)
        with torch.cuda.stream(self._stream), torch.no_grad():
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        for tensor in (dst, src):  # the allocator must not reuse it before the copy is done
            if tensor.is_cuda:
                tensor.record_stream(self._stream)
        return Landing(dst, src, event=event, device=self.device)
