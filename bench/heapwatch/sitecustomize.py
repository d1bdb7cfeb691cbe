"""What a shardflow orchestrator holds as a run grows: put this folder on PYTHONPATH and every
`shardflow orchestrator` started with it traces its allocations (tracemalloc) and writes, each
time its traced memory reaches a new high, what grew since it settled, by line and by
traceback, to $HEAPWATCH_DIR/heap-<pid>.txt (default /tmp/heapwatch). Other processes are
left alone. Tracing makes an owner several times slower: use it to attribute, never to time.

    PYTHONPATH=bench/heapwatch .venv/bin/python bench/growth.py --sizes 30000 --iterations 0

HEAPWATCH_SETTLE_S (6): seconds after start of the first snapshot, once imports are done;
HEAPWATCH_EVERY_S (5): between checks; HEAPWATCH_FRAMES (6): frames kept per allocation.

HEAPWATCH_MODE=census traces nothing, so the owner runs at its own speed: at each new high of
its RSS it writes the RSS, pymalloc's arenas and blocks in use (small objects) and the
gc-tracked objects that grew since it settled, counted by type. RSS that grows with neither
the blocks nor the objects is memory outside pymalloc: buffers, C libraries, fragmentation.
"""

import collections
import gc
import linecache
import os
import re
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


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGESIZE") / 2**20


def _pymalloc() -> dict[str, int]:
    """Arenas and blocks in use, from sys._debugmallocstats (it writes to the C stderr)."""
    saved = os.dup(2)
    with open(f"{OUT}/.mallocstats-{os.getpid()}", "w+") as out:
        os.dup2(out.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read()
    found = {}
    for name in ("arenas allocated current", "bytes in allocated blocks",
                 "bytes in available blocks"):  # fmt: skip
        match = re.search(rf"# {name}\s*=\s*([\d,]+)", text)
        found[name] = int(match.group(1).replace(",", "")) if match else -1
    return found


def _census() -> collections.Counter[str]:
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def _count() -> None:
    os.makedirs(OUT, exist_ok=True)
    time.sleep(float(os.environ.get("HEAPWATCH_SETTLE_S", "6")))
    first, start, first_malloc = _census(), _rss_mb(), _pymalloc()
    best = start
    while True:
        time.sleep(float(os.environ.get("HEAPWATCH_EVERY_S", "5")))
        rss = _rss_mb()
        if rss > best + 1:  # a new high, by 1 MiB at least
            best = rss
            now, malloc = _census(), _pymalloc()
            lines = [f"rss {start:.1f} -> {rss:.1f} MB at {time.time():.0f}"]
            lines += [f"{k}: {first_malloc[k]:,} -> {v:,}" for k, v in malloc.items()]
            grown = now.copy()
            grown.subtract(first)
            lines += [f"{n:+,} {name} (now {now[name]:,})" for name, n in grown.most_common(30)]
            with open(f"{OUT}/census-{os.getpid()}.txt", "w") as out:
                out.write("\n".join(lines) + "\n")


if "orchestrator" in sys.orig_argv:
    if os.environ.get("HEAPWATCH_MODE") == "census":
        threading.Thread(target=_count, daemon=True, name="heapwatch").start()
    else:
        tracemalloc.start(int(os.environ.get("HEAPWATCH_FRAMES", "6")))
        threading.Thread(target=_watch, daemon=True, name="heapwatch").start()
