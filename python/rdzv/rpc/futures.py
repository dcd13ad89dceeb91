"""Futures of :func:`rdzv.rpc.rpc_async`, as ``torch.futures`` has them.

When torch can be imported, :func:`new_future` makes real ``torch.futures.Future``
objects, so that ``torch.futures.wait_all``, ``collect_all`` and ``then`` work on them
unchanged. Without torch, :class:`Future` here has the same methods (``wait``, ``value``,
``done``, ``then``, ``add_done_callback``, ``set_result``, ``set_exception``), and
:func:`wait_all` and :func:`collect_all` take either kind.

Callbacks (``then``, ``add_done_callback``) run on the thread that completes the future:
for an RPC, the agent's one completing thread, so they should be short and must not wait
for another RPC future (``wait`` there would wait for the thread itself); at once on the
calling thread if the future is complete already.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from typing import Any, Callable, Generic, List, Optional, TypeVar

__all__ = ["Future", "new_future", "wait_all", "collect_all", "torch_futures"]

T = TypeVar("T")
S = TypeVar("S")

_log = logging.getLogger(__name__)

_TORCH_FINDABLE = importlib.util.find_spec("torch") is not None


def torch_futures() -> Optional[Any]:
    """``torch.futures`` when torch can be imported, else ``None``."""
    if not _TORCH_FINDABLE:
        return None
    import torch.futures

    return torch.futures


class Future(Generic[T]):
    """A result that arrives later; thread-safe, completed once."""

    __slots__ = ("_lock", "_done_event", "_value", "_error", "_callbacks")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done_event = threading.Event()
        self._value: Optional[T] = None
        self._error: Optional[BaseException] = None
        self._callbacks: List[Callable[["Future[T]"], None]] = []

    def done(self) -> bool:
        """Whether the future has a result or an exception."""
        return self._done_event.is_set()

    def wait(self) -> T:
        """Blocks until the future completes; its value, or raises its exception."""
        self._done_event.wait()
        return self.value()

    def value(self) -> T:
        """The value of a completed future (raises its exception); ``RuntimeError`` if
        it has not completed."""
        if not self._done_event.is_set():
            raise RuntimeError("Future.value() called before the future completed; call wait()")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def _complete(self, value: Optional[T], error: Optional[BaseException]) -> None:
        with self._lock:
            if self._done_event.is_set():
                raise RuntimeError("Future can only be marked completed once")
            self._value, self._error = value, error
            callbacks, self._callbacks = self._callbacks, []
            self._done_event.set()
        for callback in callbacks:
            self._run(callback)

    def set_result(self, result: T) -> None:
        """Completes the future with ``result``; runs its callbacks."""
        self._complete(result, None)

    def set_exception(self, result: BaseException) -> None:
        """Completes the future with the exception ``result`` (``wait`` raises it)."""
        if not isinstance(result, BaseException):
            raise TypeError(f"set_exception takes an exception, not {type(result).__name__}")
        self._complete(None, result)

    def _run(self, callback: Callable[["Future[T]"], None]) -> None:
        try:
            callback(self)
        except Exception:
            _log.exception("a Future callback raised; the exception is ignored")

    def add_done_callback(self, callback: Callable[["Future[T]"], None]) -> None:
        """Runs ``callback(self)`` when the future completes (at once if it has). Its
        return value and exceptions are ignored (exceptions are logged)."""
        with self._lock:
            if not self._done_event.is_set():
                self._callbacks.append(callback)
                return
        self._run(callback)

    def then(self, callback: Callable[["Future[T]"], S]) -> "Future[S]":
        """A future of ``callback(self)``, run when this one completes; if the callback
        raises, the new future fails with that exception."""
        chained: Future[S] = Future()

        def run(done: "Future[T]") -> None:
            try:
                result = callback(done)
            except BaseException as e:
                chained.set_exception(e)
            else:
                chained.set_result(result)

        self.add_done_callback(run)
        return chained

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "done")
        return f"<rdzv.rpc.Future {state}>"


def new_future() -> Any:
    """A new, pending future: a ``torch.futures.Future`` when torch can be imported,
    else :class:`Future`."""
    futures = torch_futures()
    return Future() if futures is None else futures.Future()


def collect_all(futures: List[Any]) -> Any:
    """A future completed once every one of ``futures`` has, whose value is the list of
    them (``torch.futures.collect_all``)."""
    torch = torch_futures()
    if torch is not None and all(isinstance(f, torch.Future) for f in futures):
        return torch.collect_all(futures)
    everything: Any = new_future()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            everything.set_result(list(futures))

    if not futures:
        everything.set_result([])
    for future in futures:
        future.add_done_callback(one_done)
    return everything


def wait_all(futures: List[Any]) -> List[Any]:
    """Waits for every one of ``futures``; their values in order, or raises the
    exception of the first (in order) that failed (``torch.futures.wait_all``)."""
    return [f.wait() for f in collect_all(futures).wait()]
