"""The trainer settles the garbage collector once what lives for the whole run exists."""

from __future__ import annotations

import gc
import weakref

from sharded_trainer.train import settle_garbage_collector


class Node:
    def __init__(self):
        self.peer = self


def test_settling_collects_garbage_first_then_freezes_what_lives_and_later_garbage_is_still_collected():
    gc.unfreeze()
    try:
        kept = [Node() for _ in range(100)]  # lives for the run, like compiled graphs and their guards
        dropped = Node()  # a cycle already garbage: must be collected, not frozen for the run
        gone = weakref.ref(dropped)
        del dropped
        settle_garbage_collector()
        assert gone() is None
        assert gc.get_freeze_count() >= len(kept)  # out of every later collection's scan
        later = Node()  # garbage made after settling is collected as usual
        later_ref = weakref.ref(later)
        del later
        gc.collect()
        assert later_ref() is None
    finally:
        gc.unfreeze()
