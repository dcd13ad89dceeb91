"""A waiting node's progress in the log: the torchrun handlers' (``rdzv.torchrun`` and
``rdzv._etcd``) way of saying where a rendezvous stands while ``next_rendezvous``
blocks."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

__all__ = ["wait_with_progress", "PROGRESS_EVERY_S", "STILL_WAITING_AFTER_S"]

log = logging.getLogger("rdzv.torchrun")

#: How often a waiting node logs where its round stands (at INFO).
PROGRESS_EVERY_S = 5.0
#: After this long without a round, the progress line is logged once at WARNING, so a
#: job stuck at rendezvous says why under torchrun's default log level.
STILL_WAITING_AFTER_S = 30.0


def wait_with_progress(
    node: Any,
    run_id: str,
    every: float = PROGRESS_EVERY_S,
    warn_after: float = STILL_WAITING_AFTER_S,
) -> Any:
    """``node.next_rendezvous()``, logging the node's progress line (``node.progress()``:
    "round 2: 1 of min 2 nodes; waiting for 1 more") every ``every`` seconds while it
    waits, when the line changed, and once at WARNING after ``warn_after`` seconds."""
    done = threading.Event()
    started = time.monotonic()

    def report() -> None:
        said: Optional[str] = None
        warned = False
        while not done.wait(every):
            line = node.progress()
            if line is None:
                continue
            waited = time.monotonic() - started
            if not warned and waited >= warn_after:
                warned = True
                log.warning("rdzv: run %s: no round after %.0f s: %s", run_id, waited, line)
            elif line != said:
                log.info("rdzv: run %s: %s", run_id, line)
            said = line

    reporter = threading.Thread(target=report, name="rdzv-progress", daemon=True)
    reporter.start()
    try:
        return node.next_rendezvous()
    finally:
        done.set()
        reporter.join()
