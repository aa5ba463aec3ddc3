"""Python's cyclic garbage collector, paused: `collector_off()`, the one place that turns it
off and gives it back as it was.

Its users: compiling (`ptc.lower.driver`: capture and the passes make and drop hundreds of
thousands of short-lived objects, and every full collection walks the whole heap, torch
included, about a second of the 80-layer 70B compile), the CLI's short commands, and the
training loop, which collects at steps of its own choosing (`runtime.gc_every`). Torch-free:
the CLI enters it before torch is imported.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_off():
    """Within: the cyclic garbage collector is off; after, it is as it was (a caller that had
    turned it off keeps it off). Also a decorator (`@collector_off()`)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
