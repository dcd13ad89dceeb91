"""Helpers for tests whose elastic nodes are child processes printing one JSON line per
round (``{"round", "rank", "world", ...}``)."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import time
from typing import Dict, List, Tuple


def read_line(proc: subprocess.Popen, timeout: float) -> Dict:
    """The next JSON line of ``proc``; fails naming the process if none comes within
    ``timeout`` seconds or it exits."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"nothing from node process {proc.pid} within {timeout}s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"node process {proc.pid} exited: {proc.stderr.read()}")
    return json.loads(line)


def kill_the_top_rank(
    procs: List[subprocess.Popen], timeout: float
) -> Tuple[List[Dict], List[Dict], float]:
    """Reads every node's first round (one round, ranks ``0..N``), SIGKILLs the node with
    the top rank (so that every survivor can keep its rank), reads the survivors' next
    round and checks it: one round, later than the first, world ``N - 1``, and each
    survivor's rank kept. Returns both rounds and the seconds from the kill to the last
    survivor's next round."""
    first = [read_line(p, timeout) for p in procs]
    n = len(procs)
    assert len({f["round"] for f in first}) == 1, first
    assert sorted(f["rank"] for f in first) == list(range(n)), first
    assert all(f["world"] == n for f in first), first

    top = max(range(n), key=lambda i: first[i]["rank"])
    procs[top].send_signal(signal.SIGKILL)
    procs[top].wait()
    started = time.monotonic()
    survivors = [i for i in range(n) if i != top]
    second = [read_line(procs[i], timeout) for i in survivors]
    elapsed = time.monotonic() - started
    assert len({s["round"] for s in second}) == 1, second
    assert second[0]["round"] > first[0]["round"], (first, second)
    assert all(s["world"] == n - 1 for s in second), second
    # Stable ranks: the survivors keep theirs.
    assert [s["rank"] for s in second] == [first[i]["rank"] for i in survivors]
    return first, second, elapsed
