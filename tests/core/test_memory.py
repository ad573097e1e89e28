"""appliance/core/memory.py: rare garbage collections, and an unload that still collects cycles."""

from __future__ import annotations

import gc
import weakref

from appliance.core import memory


def test_tuned_gc_is_rare_but_an_unload_collects_reference_cycles() -> None:
    before = gc.get_threshold()
    try:
        memory.tune_gc()
        assert gc.get_threshold() == memory.GC_THRESHOLDS
        assert gc.get_freeze_count() > 0  # what was imported is out of every later scan

        class Node:
            pass

        node = Node()
        node.self = node  # a reference cycle: only the collector frees it
        ref = weakref.ref(node)
        del node
        memory.release_freed_memory()  # what the manager calls after a version unloads
        assert ref() is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
