"""A service freezes what its startup made, so that a full collection while serving scans only what
serving made; the garbage startup left behind is collected first, not frozen. Run in a child
process: freezing the test process would keep its fixtures' garbage for good."""
from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc, weakref
from tandem.grpc_server import freeze_startup_heap

class Node:
    pass

def garbage_cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

live = [Node() for _ in range(1000)]
gc.disable()  # so that only freeze_startup_heap collects the cycle
dead = garbage_cycle()
assert dead() is not None
freeze_startup_heap()
gc.enable()
print(dead() is None, len(live), sum(isinstance(o, Node) for o in gc.get_objects()), gc.get_freeze_count() >= 1000)
"""


def test_startup_objects_are_frozen_and_startup_garbage_is_collected_first():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    collected, alive, scanned, frozen = result.stdout.split()
    assert collected == "True"  # the cycle startup dropped was collected, not frozen
    assert alive == "1000"  # the objects still in use are untouched
    assert scanned == "0"  # and no later collection scans them
    assert frozen == "True"
