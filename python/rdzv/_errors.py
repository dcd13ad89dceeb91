"""The exception classes of rdzv.

Every error the extension raises is one of these. Where a standard class fits, it is a
base too, so that ``except TimeoutError`` and ``except ConnectionError`` catch rdzv's
timeouts and lost connections. The rendezvous classes carry torch's names; the torchrun
handler (:mod:`rdzv.torchrun`) turns them into torch's own classes.
"""

from __future__ import annotations

__all__ = [
    "RdzvError",
    "StoreError",
    "StoreTimeoutError",
    "StoreConnectionError",
    "StoreQueueEmptyError",
    "StoreServerError",
    "RendezvousError",
    "RendezvousClosedError",
    "RendezvousTimeoutError",
    "RendezvousConnectionError",
    "RendezvousStateError",
    "RendezvousGracefulExitError",
]


class RdzvError(Exception):
    """The base class of every rdzv error."""


class StoreError(RdzvError):
    """A store operation failed (the message names the operation, key and server)."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A ``get``, ``wait``, ``barrier`` or blocking ``queue_pop`` ran out of time."""


class StoreConnectionError(StoreError, ConnectionError):
    """The store server could not be reached, or the connection to it broke."""


class StoreQueueEmptyError(StoreError):
    """A non-blocking ``queue_pop`` found the queue empty."""


class StoreServerError(RdzvError, OSError):
    """A store server could not start (the port is taken, the host does not resolve...)."""


class RendezvousError(RdzvError):
    """A rendezvous failed."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed: a node shut the run down; start again with a new run id."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """The rendezvous did not complete in time (too few nodes joined)."""


class RendezvousConnectionError(RendezvousError, ConnectionError):
    """The store the rendezvous runs on could not be reached."""


class RendezvousStateError(RendezvousError):
    """The rendezvous keys hold what this protocol never writes (another job, same run id)."""


class RendezvousGracefulExitError(RendezvousError):
    """This node has left the rendezvous (``leave()`` or ``shutdown()``)."""


# The public names: tracebacks print ``rdzv.StoreTimeoutError``, not ``rdzv._errors.…``.
for _name in __all__:
    globals()[_name].__module__ = "rdzv"
del _name


def first_line(error: BaseException) -> str:
    """An exception's text up to its first line break, without a closing period, to quote
    inside a message of ours (torch's store errors go on with C++ frames)."""
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__).rstrip(".")
