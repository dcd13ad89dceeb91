"""RRefs: ``remote()``'s result, a reference to a value on its owner.

The agent counts the references (users, forks passed to other workers, the owner's
confirmation: core's RRef machine, as torch's protocol has it). The value itself lives in
Python on its owner, in :data:`OWNED`, under the key its ``remote()`` request carried
(``R`` + key in the request's metadata), so that methods called through the proxies
(``rref.rpc_sync().method()``) act on the one object, as torch's do. When the agent lets
go of the owner's value (the last reference is gone), it tells :func:`released`, which
drops the object.

``to_here`` asks the owner for the object as it is now (one call, which waits on the owner
until the ``remote()`` function has finished). An RRef passed in a call's arguments, or
returned, is forked to the worker the call goes to; the receiver gets an RRef of its own.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Dict, Generic, Optional, Tuple, TypeVar

from .._rdzv import RRef as _RustRRef

T = TypeVar("T")

#: The metadata tag of a ``remote()`` request (then the key), and of the owner's value.
REMOTE_TAG = b"R"
OWNED_TAG = b"O"

_keys = itertools.count()


def new_key(me: str) -> str:
    """A key no other ``remote()`` of the group uses: this worker's name and a count."""
    return f"{me}#{next(_keys)}"


class _Owned:
    """The owner's values: key → the function's result or exception."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._values: Dict[str, Tuple[bool, Any]] = {}

    def put(self, key: str, ok: bool, value: Any) -> None:
        with self._cond:
            self._values[key] = (ok, value)
            self._cond.notify_all()

    def get(self, key: str, timeout: Optional[float]) -> Any:
        """The value of ``key`` (raises its exception), waiting up to ``timeout``
        seconds (``None``: no limit) for the function to finish."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while key not in self._values:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"RRef value {key} is not ready on its owner after {timeout}s: its "
                        "remote() function is still running, or its call never arrived"
                    )
                self._cond.wait(left)
            ok, value = self._values[key]
        if not ok:
            raise value
        return value

    def release(self, key: str) -> None:
        with self._cond:
            self._values.pop(key, None)

    def __len__(self) -> int:
        with self._cond:
            return len(self._values)


OWNED = _Owned()


def released(error: Optional[BaseException], value: Any) -> None:
    """The agent let go of an owner value (the completing thread calls this)."""
    if error is None and value is not None:
        metadata = value[0]
        if metadata[:1] == OWNED_TAG:
            OWNED.release(metadata[1:].decode())


def owned_value(key: str, timeout: Optional[float]) -> Any:
    """On the owner: the value of ``key`` (``to_here``'s call)."""
    return OWNED.get(key, timeout)


def invoke_owned(key: str, method: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """On the owner: calls ``method`` of the value of ``key`` (the proxies' call),
    waiting for the value at most the agent's default timeout."""
    from . import get_rpc_timeout

    return getattr(OWNED.get(key, get_rpc_timeout() or None), method)(*args, **kwargs)


class _Fork:
    """Where RRefs being pickled go: the worker the call is for (per thread)."""

    local = threading.local()

    @classmethod
    def target(cls) -> Optional[str]:
        return getattr(cls.local, "to", None)


def pickling_for(to: str, dump: Callable[[], T]) -> T:
    """Runs ``dump()`` with RRefs in it forked to worker ``to``."""
    previous = _Fork.target()
    _Fork.local.to = to
    try:
        return dump()
    finally:
        _Fork.local.to = previous


#: Values ``RRef(value)`` is handing to its own ``remote()`` (key → value).
_LENT: Dict[str, Any] = {}
_LENT_LOCK = threading.Lock()


def take_lent(key: str) -> Any:
    """On this worker: the value ``RRef(value)`` lent under ``key`` (the function of the
    ``remote()`` to itself that makes this worker its owner), the object itself."""
    with _LENT_LOCK:
        return _LENT.pop(key)


class RRef(Generic[T]):
    """A reference to a value on its owner (torch's ``RRef``): ``to_here``,
    ``local_value``, ``owner``, ``owner_name``, ``is_owner``, ``confirmed_by_owner``, and
    the proxies ``rpc_sync()``, ``rpc_async()`` and ``remote()``.

    ``RRef(value)`` makes this worker the owner of ``value`` (the object itself, not a
    copy), as torch's does; ``remote()`` returns the RRefs of other workers' values."""

    __slots__ = ("_rref", "_key", "__weakref__")
    _rref: _RustRRef
    _key: str

    def __init__(self, value: T, type_hint: Any = None) -> None:
        from . import _agent, remote

        me = _agent().me()[0]
        lent = new_key(me)
        with _LENT_LOCK:
            _LENT[lent] = value
        made = remote(me, take_lent, args=(lent,))
        self._rref = made._rref
        self._key = made._key
        # The owner's own remote() runs here: wait until the value is in place.
        OWNED.get(self._key, None)

    @classmethod
    def _of(cls, rref: _RustRRef, key: str) -> "RRef[Any]":
        """The RRef of the agent's ``rref``, whose value is under ``key`` on its owner."""
        made: RRef[Any] = cls.__new__(cls)
        made._rref = rref
        made._key = key
        return made

    def owner(self) -> Any:
        """The owner's :class:`WorkerInfo`."""
        from . import WorkerInfo

        return WorkerInfo(*self._rref.owner())

    def owner_name(self) -> str:
        """The owner's worker name."""
        return self._rref.owner()[0]

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._rref.is_owner()

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows of this reference (always true on the owner)."""
        return self._rref.confirmed_by_owner()

    def local_value(self) -> T:
        """The value, on its owner (waits until the ``remote()`` function has finished;
        raises what it raised). ``RuntimeError`` on any other worker."""
        if not self.is_owner():
            raise RuntimeError(
                f"Call it on {self.owner_name()} to get the local value of RRef "
                f"{self._rref.id()}: only its owner holds it"
            )
        return OWNED.get(self._key, None)

    def to_here(self, timeout: float = -1.0) -> T:
        """The value, fetched from the owner (a copy, as it is now), waiting up to
        ``timeout`` seconds (negative: the agent's default; 0: no limit)."""
        if self.is_owner():
            return OWNED.get(self._key, None if timeout <= 0 else timeout)
        from . import get_rpc_timeout, rpc_sync

        wait = get_rpc_timeout() if timeout < 0 else timeout
        return rpc_sync(
            self.owner_name(), owned_value, args=(self._key, wait or None), timeout=timeout
        )

    def rpc_sync(self, timeout: float = -1.0) -> Any:
        """A proxy: ``rref.rpc_sync().method(*args)`` runs the method of the value on the
        owner and returns its result."""
        from . import rpc_sync

        return _Proxy(self, rpc_sync, timeout)

    def rpc_async(self, timeout: float = -1.0) -> Any:
        """A proxy whose method calls return futures."""
        from . import rpc_async

        return _Proxy(self, rpc_async, timeout)

    def remote(self, timeout: float = -1.0) -> Any:
        """A proxy whose method calls return RRefs to their results (on the owner)."""
        from . import remote

        return _Proxy(self, remote, timeout)

    def __reduce__(self) -> Any:
        to = _Fork.target()
        if to is None:
            raise RuntimeError(
                "an RRef can be pickled only as an argument or result of an RPC "
                "(rpc_sync, rpc_async, remote)"
            )
        return (_from_fork, (self._rref.fork_to(to), self._key))

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}(RRefId = {self._rref.id()}, owner = {self.owner_name()})"


def _from_fork(fork: bytes, key: str) -> RRef:
    from . import _agent

    return RRef._of(_agent().rref_from_fork(fork), key)


class _Proxy:
    """``rref.rpc_sync()`` and its kin: attributes are methods called on the owner."""

    __slots__ = ("_rref", "_call", "_timeout")

    def __init__(self, rref: RRef, call: Callable[..., Any], timeout: float) -> None:
        self._rref = rref
        self._call = call
        self._timeout = timeout

    def __getattr__(self, method: str) -> Callable[..., Any]:
        rref, call, timeout = self._rref, self._call, self._timeout

        def invoke(*args: Any, **kwargs: Any) -> Any:
            return call(
                rref.owner_name(),
                invoke_owned,
                args=(rref._key, method, args, kwargs),
                timeout=timeout,
            )

        return invoke
