"""Fixtures of the rdzv pytest suite: a server per test, on a free port.

The suite tests the installed package (``pip install .`` or the wheel): ``python/`` is
never put on ``sys.path``, so ``import rdzv`` finds the installed extension.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Iterator, List

import pytest

import rdzv


@pytest.fixture
def server() -> Iterator[rdzv.StoreServer]:
    with rdzv.StoreServer(host="127.0.0.1", port=0) as srv:
        yield srv


@pytest.fixture
def store(server: rdzv.StoreServer) -> rdzv.Store:
    return rdzv.Store("127.0.0.1", server.port, timeout=10)


# Children die with the test process (PR_SET_PDEATHSIG), so a crashed test leaves no
# node behind; the fixture kills any still running at the end.
CHILD_PRELUDE = """
import ctypes, faulthandler, signal
ctypes.CDLL(None).prctl(1, signal.SIGKILL)
faulthandler.register(signal.SIGUSR1, all_threads=True)
"""


class Children:
    def __init__(self) -> None:
        self.procs: List[subprocess.Popen] = []

    def spawn(self, code: str, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD_PRELUDE + code, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.procs.append(proc)
        return proc

    def stacks_and_kill(self, proc: subprocess.Popen) -> str:
        """A stuck child's Python stacks (every thread's, from ``faulthandler``) and
        what it wrote to stderr, after which it is killed."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
            proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        return (err or "")[-6000:]

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture
def children() -> Iterator[Children]:
    kids = Children()
    try:
        yield kids
    finally:
        kids.kill_all()
