"""Test helpers of torch's ``dist_utils`` (``torch/testing/_internal/dist_utils.py``),
for programs and tests written against them.

``dist_init`` decorates a test method of a class with ``rank``, ``world_size`` and
``init_method`` attributes: it runs ``init_rpc`` (worker ``worker{rank}``), the test, and
a graceful ``shutdown``. The waits poll this worker's agent (RRef counts, calls in flight)
or probe a peer until it fails.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional, Tuple, TypeVar

from . import _agent, init_rpc, shutdown
from .options import RpcBackendOptions

__all__ = [
    "dist_init",
    "worker_name",
    "initialize_pg",
    "wait_until_node_failure",
    "wait_until_pending_futures_and_users_flushed",
    "get_num_owners_and_forks",
    "wait_until_owners_and_forks_on_rank",
]

F = TypeVar("F", bound=Callable[..., Any])

#: How long the waits wait by default (torch's helpers wait for ever or 20 s).
DEFAULT_WAIT_SECONDS = 20.0


def worker_name(rank: int) -> str:
    """``worker{rank}``, the name ``dist_init`` gives each rank."""
    return f"worker{rank}"


def dist_init(
    old_test_method: Optional[F] = None,
    setup_rpc: bool = True,
    clean_shutdown: bool = True,
    faulty_messages: Any = None,
    messages_to_delay: Any = None,
) -> Any:
    """torch's ``dist_init``: wraps a test method so that it runs between ``init_rpc``
    (on ``self.rank`` of ``self.world_size`` through ``self.init_method``) and
    ``shutdown(graceful=clean_shutdown)``. ``faulty_messages`` and
    ``messages_to_delay`` (the faulty agent's) are not supported and must be ``None``."""
    if faulty_messages is not None or messages_to_delay is not None:
        raise NotImplementedError(
            "rdzv.rpc.testing.dist_init: faulty_messages and messages_to_delay (torch's "
            "faulty agent) are not supported"
        )
    if old_test_method is None:
        return functools.partial(dist_init, setup_rpc=setup_rpc, clean_shutdown=clean_shutdown)

    @functools.wraps(old_test_method)
    def new_test_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if setup_rpc:
            options = getattr(self, "rpc_backend_options", None) or RpcBackendOptions(
                init_method=self.init_method
            )
            init_rpc(
                worker_name(self.rank),
                rank=self.rank,
                world_size=self.world_size,
                rpc_backend_options=options,
            )
        result = old_test_method(self, *args, **kwargs)
        if setup_rpc:
            shutdown(graceful=clean_shutdown)
        return result

    return new_test_method


def initialize_pg(init_method: str, rank: int, world_size: int) -> None:
    """torch's ``initialize_pg``: a gloo process group through ``init_method`` (needs
    torch)."""
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise RuntimeError("initialize_pg needs torch (torch.distributed)") from e
    if not dist.is_initialized():
        dist.init_process_group(
            backend="gloo", init_method=init_method, rank=rank, world_size=world_size
        )


def wait_until_node_failure(
    rank: int, expected_error_regex: str = ".*", timeout: float = DEFAULT_WAIT_SECONDS
) -> str:
    """Probes worker ``rank`` until a call to it fails with an error matching
    ``expected_error_regex``; that error's text. ``TimeoutError`` if none does within
    ``timeout`` seconds."""
    import re

    agent = _agent()
    name = agent.worker_info_by_id(rank)[0]
    pattern = re.compile(expected_error_regex)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        failure = agent.wait_until_node_failure(name, max(left, 0.0)) if left > 0 else None
        if failure is None:
            raise TimeoutError(f"worker {name} (rank {rank}) still answers after {timeout}s")
        if pattern.search(failure):
            return failure
        time.sleep(0.1)


def wait_until_pending_futures_and_users_flushed(timeout: float = DEFAULT_WAIT_SECONDS) -> None:
    """Waits until no RRef message of this worker is unanswered, no user RRef
    unconfirmed and no call in flight (``RpcTimeoutError`` after ``timeout``)."""
    _agent().wait_until_pending_futures_and_users_flushed(timeout)


def get_num_owners_and_forks(rank: Optional[int] = None) -> Tuple[int, int]:
    """``(owner RRefs, forks)`` on worker ``rank`` (this worker when ``None``)."""
    agent = _agent()
    return agent.get_num_owners_and_forks(agent.me()[1] if rank is None else rank)


def wait_until_owners_and_forks_on_rank(
    num_owners: int, num_forks: int, rank: int, timeout: float = DEFAULT_WAIT_SECONDS
) -> None:
    """Waits until worker ``rank`` has ``num_owners`` owner RRefs and ``num_forks``
    forks (``RpcTimeoutError`` naming what it had, after ``timeout``)."""
    _agent().wait_until_owners_and_forks_on_rank(num_owners, num_forks, rank, timeout)
