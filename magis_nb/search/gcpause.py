"""Python's cyclic garbage collector, paused while a plan is made.

Planning builds graphs of Python objects: a state of paper BTLM split in 16 is
a graph of 106K nodes, about a million new objects. With the collector on, a
full collection over the whole heap starts each time the old generation has
grown by a quarter, so building one such state ran several of them: 19.5 s a
state with it on, 13.2 s with it off (build and evaluate of plan ((238, 16),),
this CPU). Capture and analysis run paused too; their garbage waits for the
search's first collection (paper BTLM: 573 -> 630 MiB of process peak). Off,
the objects a state leaves in reference cycles (one per node, about 0.1M a
state) are collected here instead, once a million objects have been allocated
since the last collection: 0.7 s each on that heap.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager

EVERY = 1_000_000           # objects allocated between two collections while paused


@contextmanager
def paused_gc():
    """Automatic collection off inside (as it was, after); `collect_due`
    collects where a caller knows a batch of objects has just been made."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def collect_due() -> None:
    """A full collection when EVERY objects have been allocated since the last
    one (never reached while the collector runs on its own: it collects
    the youngest generation every 700)."""
    if gc.get_count()[0] >= EVERY:
        gc.collect()
