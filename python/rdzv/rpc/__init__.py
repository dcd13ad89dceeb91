"""``rdzv.rpc``: torch.distributed.rpc's API on rdzv's RPC agent.

``import rdzv.rpc as rpc`` and a torch RPC program that uses the API below runs
unchanged::

    rpc.init_rpc("worker0", rank=0, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                     init_method="tcp://10.0.0.1:29500"))
    total = rpc.rpc_sync("worker1", operator.add, args=(1, 2))
    future = rpc.rpc_async("worker1", numpy.sum, args=(array,))
    rpc.shutdown()

Functions and arguments are pickled (protocol 5); numpy arrays, CPU torch tensors and
large ``bytes`` travel out of band, beside the pickle, over the agent's channels
(:mod:`rdzv.rpc._serialize`). A remote function runs on one of ``num_worker_threads``
threads of the callee, and every wait on the network releases the GIL. An exception it
raises fails that call only and is re-raised at the caller as its own type, with the
remote worker and traceback in its text. Failures of the RPC itself are the classes of
:mod:`rdzv.rpc._errors` (all ``RuntimeError``\\ s, as torch's are).

Futures are ``torch.futures.Future`` when torch can be imported, else
:class:`rdzv.rpc.futures.Future` (:mod:`rdzv.rpc.futures`).

Unpickling is code execution: unlike torch's, a worker reads nothing from a peer that
has not proved it holds the group secret (docs/rpc-security.md). To run no code even for
a member, use restricted mode (``RpcBackendOptions(restricted=True)``,
``init_rpc(..., restricted=True)`` or ``RDZV_RPC_RESTRICTED=1``): then this worker runs
only functions registered by name (:func:`register`), with plain data and arrays as
arguments, and never unpickles (:mod:`rdzv.rpc._restricted`).

Out of scope: TorchScript functions, distributed autograd and distributed optimizers.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .._rdzv import RpcAgent as _RpcAgent
from .._rdzv import check_worker_name as _check_worker_name
from . import _restricted, _rref, _serialize, backend_registry, functions
from ._restricted import register, registered, unregister
from .backend_registry import BackendType
from ._rref import RRef
from ._errors import *  # noqa: F403 (the list is _errors.__all__)
from ._errors import RpcUsageError
from . import _errors
from .futures import Future, collect_all, new_future, torch_futures, wait_all
from .options import (
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
)

__all__ = [
    "init_rpc",
    "is_restricted",
    "register",
    "registered",
    "unregister",
    "shutdown",
    "rpc_sync",
    "rpc_async",
    "remote",
    "RRef",
    "functions",
    "backend_registry",
    "BackendType",
    "get_worker_info",
    "get_rpc_timeout",
    "is_available",
    "WorkerInfo",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "Future",
    "wait_all",
    "collect_all",
    "UNSET_RPC_TIMEOUT",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_INIT_METHOD",
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    *_errors.__all__,
]

#: A call's ``timeout`` when it takes the agent's default (torch's value).
UNSET_RPC_TIMEOUT = -1.0
#: ``shutdown``'s default timeout: none.
DEFAULT_SHUTDOWN_TIMEOUT = 0.0

_NOT_INITIALIZED = "RPC has not been initialized. Call rdzv.rpc.init_rpc first."

To = Union[str, int, "WorkerInfo"]


class WorkerInfo:
    """A worker of the group: its unique ``name`` and its ``id`` (its rank)."""

    __slots__ = ("name", "id")

    def __init__(self, name: str, id: int) -> None:
        _check_worker_name(name)
        self.name = name
        self.id = id

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, WorkerInfo) and self.name == other.name and self.id == other.id
        )

    def __hash__(self) -> int:
        return hash((self.name, self.id))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    def __reduce__(self) -> Any:
        return (WorkerInfo, (self.name, self.id))


class _State:
    """The process's agent (one at a time, as torch has)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.agent: Optional[_RpcAgent] = None
        # This worker's WorkerInfo text, for remote exceptions; set before the agent
        # listens, since a peer may call in before init_rpc returns.
        self.me = "WorkerInfo(unknown)"
        # Set once init_rpc has the agent: a peer's call may arrive before it returns
        # (a static group's last barrier lets the others go first), and its function may
        # use the agent.
        self.ready = threading.Event()
        # Futures being completed on the agent's threads: their callbacks run user code
        # (torch's Future runs them inside set_result, in C++), which exit waits for.
        self.completing = 0
        self.completed = threading.Condition(self.lock)
        # Restricted mode (rdzv.rpc._restricted): refuse every request that is not a
        # restricted call, and send restricted calls only. `requested_restricted` is
        # init_rpc's keyword, read when the agent starts.
        self.restricted = False
        self.requested_restricted: Optional[bool] = None


_state = _State()

#: How long interpreter exit waits for futures still being completed on the agent's
#: threads (their callbacks may be inside torch's C++, which cannot outlive its statics).
EXIT_WAITS_FOR_CALLBACKS_S = 10.0


def _agent() -> _RpcAgent:
    agent = _state.agent
    if agent is None:
        raise RpcUsageError(_NOT_INITIALIZED)
    return agent


def is_available() -> bool:
    """Whether RPC can be used here (always, as torch's ``rpc.is_available``)."""
    return True


def _serve(caller: str, request: Tuple[bytes, bytes, List[Any]]) -> Any:
    """Runs one call on this worker (the agent's ``PYTHON_CALL`` handler): the reply's
    ``(metadata, payload, buffers)``, an exception as a reply of its own."""
    metadata, payload, buffers = request
    if not _state.ready.is_set():
        _state.ready.wait()
    # Restricted mode decides on the first bytes alone, before anything is unpickled.
    if _restricted.is_restricted(payload):
        return _restricted.serve(_state.me, payload, buffers)
    if _state.restricted:
        return _restricted.refuse_unrestricted(_state.me)
    if metadata[:1] == _rref.REMOTE_TAG:
        return _serve_remote(metadata[1:].decode(), payload, buffers)
    try:
        func, args, kwargs = _serialize.loads(payload, buffers)
        run_later = functions.async_function(func)
        if run_later is not None:
            return _answer_later(caller, run_later(*args, **kwargs))
        result = func(*args, **kwargs)
    except BaseException as exc:  # the caller re-raises it; the worker goes on
        return _exception_reply(exc)
    return _value_reply(caller, result)


def _exception_reply(exc: BaseException) -> Tuple[Any, Any, Any]:
    return (b"E", *_serialize.dumps_exception(exc, _state.me))


def _value_reply(caller: str, result: Any) -> Tuple[Any, Any, Any]:
    try:
        return (b"", *_rref.pickling_for(caller, lambda: _serialize.dumps(_serialize.lift(result))))
    except BaseException as exc:
        return _exception_reply(exc)


def _answer_later(caller: str, future: Any) -> Callable[[Callable[[Any], None]], None]:
    """An ``async_execution`` function's future, as the agent's handler takes it:
    ``attach(on_reply)`` calls ``on_reply`` with the reply once the future completes."""
    if not hasattr(future, "add_done_callback"):
        raise TypeError(
            f"an async_execution function must return a future, not {type(future).__name__}"
        )

    def attach(on_reply: Callable[[Any], None]) -> None:
        def done(completed: Any) -> None:
            try:
                value = completed.value()
            except BaseException as exc:
                on_reply(_exception_reply(exc))
                return
            on_reply(_value_reply(caller, value))

        future.add_done_callback(done)

    return attach


def _serve_remote(key: str, payload: bytes, buffers: List[Any]) -> Tuple[Any, Any, Any]:
    """Runs a ``remote()`` call: the owner keeps the result (or the exception) as the
    live object of ``key``; the agent's value is only the key."""
    try:
        func, args, kwargs = _serialize.loads(payload, buffers)
        run_later = functions.async_function(func)
        if run_later is not None:
            value = run_later(*args, **kwargs).wait()
        else:
            value = func(*args, **kwargs)
        _rref.OWNED.put(key, True, value)
    except BaseException as exc:
        text = _serialize.dumps_exception(exc, _state.me)
        _rref.OWNED.put(key, False, _serialize.loads(*text).to_exception())
    return (_rref.OWNED_TAG + key.encode(), b"", [])


def _reply_value(reply: Tuple[bytes, bytes, List[Any]]) -> Any:
    """A reply's value, or raises the remote exception."""
    metadata, payload, buffers = reply
    if _restricted.is_restricted(payload):
        return _restricted.reply_value(payload, buffers)
    if _state.restricted:
        raise RpcError(
            "restricted-mode RPC: the reply is not in the restricted format; it was not "
            "unpickled"
        )
    value = _serialize.loads(payload, buffers)
    if metadata == b"E":
        raise value.to_exception()
    return value


def _rank(rank: int) -> int:
    if rank >= 0:
        return rank
    env = os.environ.get("RANK")
    if env is not None and env.strip().isdigit():
        return int(env)
    raise ValueError(
        f"rank {rank}: init_rpc needs this worker's rank >= 0 (or RANK in the environment)"
    )


def init_rpc(
    name: str,
    backend: Any = None,
    rank: int = -1,
    world_size: Optional[int] = None,
    rpc_backend_options: Optional[RpcBackendOptions] = None,
    *,
    restricted: Optional[bool] = None,
) -> None:
    """Joins the RPC group as worker ``name`` with id ``rank``, through the options'
    ``init_method``, and starts this worker's agent. With ``world_size`` the group is
    static and this blocks until all of its workers have started; without, this worker
    joins a dynamic group. ``backend``: ``None`` or ``BackendType.TENSORPIPE`` run rdzv's
    agent; a backend registered with :mod:`rdzv.rpc.backend_registry` runs its own init
    handler.

    ``restricted``: run in restricted mode (:mod:`rdzv.rpc._restricted`): serve only
    registered functions, called by name, never unpickle. ``None`` (the default): the
    options' ``restricted`` if they have one and it is set, else ``RDZV_RPC_RESTRICTED=1``
    in the environment.

    Raises :class:`RpcInitError` if the rendezvous, the store or the options fail, and
    :class:`RpcUsageError` if RPC is initialised already.
    """
    _state.requested_restricted = restricted
    backend = BackendType.TENSORPIPE if backend is None else backend
    options = rpc_backend_options
    if options is None:
        options = backend_registry.construct_rpc_backend_options(backend)
    backend_registry.init_backend(backend, name, _rank(rank), world_size, options)


def _start_agent(
    name: str, rank: int, world_size: Optional[int], options: RpcBackendOptions
) -> None:
    """Starts rdzv's agent as this process's (``BackendType.TENSORPIPE``'s init)."""
    if not isinstance(options, RpcBackendOptions):
        raise TypeError(
            f"rpc_backend_options must be an RpcBackendOptions, not {type(options).__name__}"
        )
    # Futures are torch's when torch can be imported: import it now, not inside the first
    # rpc_async or async_execution call (an import of torch takes seconds).
    torch_futures()
    with _state.lock:
        if _state.agent is not None:
            raise RpcUsageError("RPC is already initialized")
        _state.me = repr(WorkerInfo(name, rank))
        _state.restricted = _restricted_mode(options)
        _state.ready.clear()
        try:
            _state.agent = _RpcAgent.start(
                name,
                rank,
                world_size,
                options.init_method,
                options.rpc_timeout,
                options.num_worker_threads,
                options.transports,
                options.channels,
                [(peer, list(m.items())) for peer, m in options.device_maps.items()],
                options.devices,
                _serve,
                _rref.released,
                None if options.secret is False else options.secret,
                options.secret is False,
            )
        finally:
            _state.ready.set()


def _restricted_mode(options: RpcBackendOptions) -> bool:
    """Whether the agent starting now runs in restricted mode: ``init_rpc``'s keyword,
    else the options' ``restricted``, else ``RDZV_RPC_RESTRICTED``."""
    requested = _state.requested_restricted
    _state.requested_restricted = None
    if requested is not None:
        return bool(requested)
    if getattr(options, "restricted", False):
        return True
    return os.environ.get(_restricted.ENV, "").strip() == "1"


def is_restricted() -> bool:
    """Whether this worker's agent runs in restricted mode."""
    return _state.restricted


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Shuts this worker's agent down. Graceful (the default): waits until no worker of
    the group has a call in flight (every worker must call ``shutdown``), at most
    ``timeout`` seconds if it is above 0, then closes. Not graceful: closes now. Pending
    futures fail with :class:`RpcShutdownError` either way, and the agent is closed even
    if the graceful protocol fails (:class:`RpcTimeoutError` names the workers that never
    joined)."""
    agent = _agent()
    try:
        # The agent stays reachable while the group settles: calls still arrive, and
        # their functions may call on.
        agent.shutdown(graceful, timeout if timeout and timeout > 0 else None)
    finally:
        with _state.lock:
            if _state.agent is agent:
                _state.agent = None


def _at_exit() -> None:
    _RpcAgent.interpreter_exiting()
    agent = _state.agent
    if agent is not None:
        agent.interpreter_exit()
    # A callback that ran shutdown() (or anything the main thread waited for) may still be
    # returning through torch's Future on an agent thread: exiting under it aborts the
    # process ("terminate called without an active exception").
    with _state.lock:
        _state.completed.wait_for(
            lambda: _state.completing == 0, timeout=EXIT_WAITS_FOR_CALLBACKS_S
        )


atexit.register(_at_exit)


def _to_name(to: To) -> str:
    if isinstance(to, WorkerInfo):
        return to.name
    if isinstance(to, str):
        return to
    if isinstance(to, int) and not isinstance(to, bool):
        return _agent().worker_info_by_id(to)[0]
    raise ValueError(f"Cannot get WorkerInfo from name {to}")


def get_worker_info(worker_name: Optional[str] = None) -> WorkerInfo:
    """The :class:`WorkerInfo` of ``worker_name``, or of this worker when ``None``."""
    agent = _agent()
    name, id = agent.me() if worker_name is None else agent.worker_info(worker_name)
    return WorkerInfo(name, id)


def _get_worker_infos() -> List[WorkerInfo]:
    return [WorkerInfo(n, i) for n, i in _agent().worker_infos()]


def get_rpc_timeout() -> float:
    """The default timeout of calls, in seconds (the options' ``rpc_timeout``)."""
    return _agent().rpc_timeout


def _request(
    to: To,
    func: Union[str, Callable[..., Any]],
    args: Optional[Sequence[Any]],
    kwargs: Optional[Dict[str, Any]],
) -> Tuple[_RpcAgent, str, bytes, List[memoryview]]:
    """The agent, the callee's name, and the call pickled for it."""
    agent = _agent()
    name = _to_name(to)
    if _state.restricted or isinstance(func, str):
        payload, buffers = _restricted.dumps_call(_restricted.name_of(func), args, kwargs)
        return agent, name, payload, buffers
    if not callable(func):
        raise TypeError(f"func must be callable, not {type(func).__name__}")
    args, kwargs = _serialize.lift_call(args, kwargs)
    payload, buffers = _rref.pickling_for(name, lambda: _serialize.dumps((func, args, kwargs)))
    return agent, name, payload, buffers


def rpc_sync(
    to: To,
    func: Union[str, Callable[..., Any]],
    args: Optional[Sequence[Any]] = None,
    kwargs: Optional[Dict[str, Any]] = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Runs ``func(*args, **kwargs)`` on worker ``to`` and returns its result.
    ``timeout`` in seconds: 0 for none, negative for :func:`get_rpc_timeout`'s.

    Raises what ``func`` raised (its type, with the remote traceback in the text), or
    :class:`RpcTimeoutError`, :class:`RpcConnectionError`, :class:`RpcError`.
    """
    agent, name, payload, buffers = _request(to, func, args, kwargs)
    return _reply_value(agent.call(name, b"", payload, buffers, timeout))


def rpc_async(
    to: To,
    func: Union[str, Callable[..., Any]],
    args: Optional[Sequence[Any]] = None,
    kwargs: Optional[Dict[str, Any]] = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Starts ``func(*args, **kwargs)`` on worker ``to`` and returns a future of its
    result at once (a ``torch.futures.Future`` when torch can be imported); ``wait()``
    returns the result or raises what :func:`rpc_sync` would."""
    agent, name, payload, buffers = _request(to, func, args, kwargs)
    future = new_future()

    def on_done(error: Optional[BaseException], reply: Any) -> None:
        with _state.lock:
            _state.completing += 1
        try:
            if error is None:
                try:
                    value = _reply_value(reply)
                except BaseException as e:
                    error = e
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)
        finally:
            with _state.lock:
                _state.completing -= 1
                _state.completed.notify_all()

    agent.call_async(name, b"", payload, buffers, timeout, on_done)
    return future


def remote(
    to: To,
    func: Union[str, Callable[..., Any]],
    args: Optional[Sequence[Any]] = None,
    kwargs: Optional[Dict[str, Any]] = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef:
    """Runs ``func(*args, **kwargs)`` on worker ``to``, which keeps the result, and
    returns an :class:`RRef` to it at once. ``to_here()`` fetches the value (raising what
    ``func`` raised); its proxies call the value's methods on the owner."""
    if _state.restricted or isinstance(func, str):
        raise RpcUsageError(
            "remote() is not available in restricted mode: its value lives on the owner as "
            "a Python object, which only pickling can reach; use rpc_sync or rpc_async"
        )
    agent, name, payload, buffers = _request(to, func, args, kwargs)
    key = _rref.new_key(agent.me()[0])
    metadata = _rref.REMOTE_TAG + key.encode()
    return RRef._of(agent.remote(name, metadata, payload, buffers, timeout), key)
