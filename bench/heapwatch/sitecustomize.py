"""What a shardflow orchestrator holds as a run grows: put this folder on PYTHONPATH and every
`shardflow orchestrator` started with it traces its allocations (tracemalloc) and writes, each
time its traced memory reaches a new high, what grew since it settled, by line and by
traceback, to $HEAPWATCH_DIR/heap-<pid>.txt (default /tmp/heapwatch). Other processes are
left alone. Tracing makes an owner several times slower: use it to attribute, never to time.

    PYTHONPATH=bench/heapwatch .venv/bin/python bench/growth.py --sizes 30000 --iterations 0

HEAPWATCH_SETTLE_S (6): seconds after start of the first snapshot, once imports are done;
HEAPWATCH_EVERY_S (5): between checks; HEAPWATCH_FRAMES (6): frames kept per allocation.
"""

import linecache
import os
import sys
import threading
import time
import tracemalloc

OUT = os.environ.get("HEAPWATCH_DIR", "/tmp/heapwatch")
_OWN = [tracemalloc.Filter(False, __file__), tracemalloc.Filter(False, linecache.__file__)]


def _snapshot() -> tracemalloc.Snapshot:
    return tracemalloc.take_snapshot().filter_traces(_OWN)


def _write(snap: tracemalloc.Snapshot, first: tracemalloc.Snapshot, header: str) -> None:
    lines = [header]
    lines += [str(stat) for stat in snap.compare_to(first, "lineno")[:40]]
    lines.append("\n# by traceback")
    for stat in snap.compare_to(first, "traceback")[:12]:
        lines.append(str(stat))
        lines.extend("    " + line for line in stat.traceback.format())
    os.makedirs(OUT, exist_ok=True)
    with open(f"{OUT}/heap-{os.getpid()}.txt", "w") as out:
        out.write("\n".join(lines) + "\n")


def _watch() -> None:
    time.sleep(float(os.environ.get("HEAPWATCH_SETTLE_S", "6")))
    first = _snapshot()
    start = best = tracemalloc.get_traced_memory()[0]
    while True:  # a daemon thread: it ends with the process
        time.sleep(float(os.environ.get("HEAPWATCH_EVERY_S", "5")))
        current = tracemalloc.get_traced_memory()[0]
        if current > best + (1 << 20):  # a new high, by 1 MiB at least
            best = current
            header = f"traced {start / 1e6:.1f} -> {current / 1e6:.1f} MB at {time.time():.0f}"
            _write(_snapshot(), first, header)


if "orchestrator" in sys.orig_argv:
    tracemalloc.start(int(os.environ.get("HEAPWATCH_FRAMES", "6")))
    threading.Thread(target=_watch, daemon=True, name="heapwatch").start()
