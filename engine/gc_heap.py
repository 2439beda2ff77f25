"""Keep Python's cyclic garbage collector off a long-running process's startup heap."""
from __future__ import annotations

import atexit
import gc

# Frozen cycles are never collected, not even at exit, where extension modules (Triton's nanobind) would then
# report them as leaks.
atexit.register(gc.unfreeze)


def freeze_gc_heap() -> None:
    """Move every object alive now (imports, model, tokenizer: ~200k objects) into the permanent generation.

    The collector then only walks what serving allocates. Without this, each full collection re-walks the whole
    startup heap, CPU taken from the engine where they share cores. The engine core calls this once built, the
    gateway once ready.
    """
    gc.collect()
    gc.freeze()
