"""rdzv: PyTorch-compatible rendezvous and key-value store, in Rust.

- :class:`StoreServer`: a TCPStore server (rdzv's Rust server) running in this process.
- :class:`Store`: a client of any TCPStore server, with torch's ``Store`` method names.
- :func:`rendezvous`: ``tcp://``, ``env://``, ``file://``, ``elastic://`` and ``etcd://``
  URLs.
- :class:`ElasticRendezvous`: one node of an elastic rendezvous (on an rdzv store server,
  or in etcd with :meth:`ElasticRendezvous.etcd`).
- ``torchrun --rdzv-backend=rdzv``: the handler in :mod:`rdzv.torchrun` (needs torch).

Blocking calls release the GIL. Errors are the classes below (see :mod:`rdzv._errors`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Iterator, Optional, Union

from . import _errors
from ._errors import *  # noqa: F403 (the list is _errors.__all__, kept in one place)
from ._rdzv import ElasticRendezvous, Round, Store, StoreServer, __version__
from ._rdzv import rendezvous as _rendezvous

__all__ = [
    "__version__",
    "StoreServer",
    "Store",
    "ElasticRendezvous",
    "Round",
    "Rendezvous",
    "rendezvous",
    *_errors.__all__,
]


class Rendezvous:
    """What :func:`rendezvous` returns: ``store``, ``rank``, ``world_size`` (``None``
    when not fixed) and, for ``elastic://``, ``elastic``, the node's
    :class:`ElasticRendezvous` handle. Unpacks as torch's ``(store, rank, world_size)``."""

    __slots__ = ("store", "rank", "world_size", "elastic")

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: Optional[int],
        elastic: Optional[ElasticRendezvous] = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.elastic = elastic

    def __iter__(self) -> Iterator[object]:
        return iter((self.store, self.rank, self.world_size))

    def __repr__(self) -> str:
        return (
            f"Rendezvous(store={self.store!r}, rank={self.rank}, "
            f"world_size={self.world_size}, elastic={self.elastic!r})"
        )


def rendezvous(
    url: str,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    timeout: Union[float, timedelta, None] = None,
) -> Rendezvous:
    """torch's ``rendezvous(url)``: the store every rank shares, this rank and the world
    size, for ``tcp://``, ``env://``, ``file://``, ``elastic://`` and ``etcd://`` URLs.

    ``store, rank, world_size = rdzv.rendezvous("tcp://10.0.0.1:29500?rank=0&world_size=2")``

    ``rank`` and ``world_size`` are added to the URL as torch adds them (``None``: not
    given). ``timeout`` (seconds or ``timedelta``, default 30 minutes) bounds connecting
    and waiting for every rank. For ``elastic://host:port/run_id?nodes=MIN:MAX`` and
    ``etcd://H1:P1,H2:P2,.../run_id?nodes=MIN:MAX`` (the same rendezvous kept in an etcd
    cluster; its round store is etcd's), the result's ``elastic`` is the node's
    :class:`ElasticRendezvous`, to follow later rounds.

    Raises :class:`RendezvousError` (and its subclasses) when it fails.
    """
    store, rank_, world, elastic = _rendezvous(url, rank, world_size, timeout)
    return Rendezvous(store, rank_, world, elastic)
