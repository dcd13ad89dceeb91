"""``RpcBackendOptions``: the options of :func:`rdzv.rpc.init_rpc`, under torch's
``TensorPipeRpcBackendOptions`` names (that name is accepted too, so existing programs
build their options unchanged).

Transports and channels take torch's names or rdzv's: transports ``shm``, ``uv`` (rdzv's
``tcp``), ``ibv``; channels ``basic``, ``cma``, ``mpt_uv`` (``mpt``), ``xth``,
``cuda_basic``, ``cuda_ipc``, ``cuda_gdr``, ``cuda_xth``. ``None`` offers every one this
build runs here. Devices are ``torch.device``\\ s, device strings (``"cuda:0"``) or CUDA
indices.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

__all__ = [
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_INIT_METHOD",
    "DEFAULT_NUM_WORKER_THREADS",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
]

DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_INIT_METHOD = "env://"
DEFAULT_NUM_WORKER_THREADS = 16

DeviceLike = Any
DeviceMap = Dict[DeviceLike, DeviceLike]


def _device(device: DeviceLike) -> str:
    """A device as its name: ``cuda:N`` for an index, ``str()`` of a ``torch.device``."""
    if isinstance(device, bool):
        raise TypeError(f"a device must be a torch.device, a str or an int, not {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"a CUDA device index must be >= 0, got {device}")
        return f"cuda:{device}"
    if isinstance(device, str) or type(device).__name__ == "device":
        return str(device)
    raise TypeError(f"a device must be a torch.device, a str or an int, not {device!r}")


def _device_map(device_map: DeviceMap) -> Dict[str, str]:
    """torch's ``_to_device_map``: names both sides, refusing two sources for one target."""
    full: Dict[str, str] = {}
    reverse: Dict[str, str] = {}
    for k, v in device_map.items():
        k, v = _device(k), _device(v)
        if v in reverse:
            raise ValueError(
                "`device_maps` only supports 1-to-1 mapping, "
                f"trying to map {k} and {reverse[v]} to {v}"
            )
        full[k] = v
        reverse[v] = k
    return full


def _secret_repr(secret: Union[bytes, None, bool]) -> str:
    if secret is None:
        return "shared"
    if not isinstance(secret, bytes):  # False (True is refused when options are made)
        return "none"
    return f"<{len(secret)} bytes>"


class RpcBackendOptions:
    """What :func:`rdzv.rpc.init_rpc` starts the agent with.

    ``rpc_timeout`` (seconds, default 60; 0: calls never expire) is the default timeout
    of calls; ``init_method`` any rdzv rendezvous URL (``tcp://``, ``env://``,
    ``file://``, ``elastic://``, ``etcd://``; default ``env://``); ``num_worker_threads``
    (default 16) how many threads run remote functions; ``device_maps`` and ``devices``
    as torch has them; ``transports`` and ``channels`` (also as ``_transports`` and
    ``_channels``) the lists to offer, highest priority first.

    ``secret`` is the group secret peers prove in the handshake before any call of theirs
    is read (docs/rpc-security.md): ``None`` (the default) takes ``RDZV_RPC_SECRET``, else
    the file ``RDZV_RPC_SECRET_FILE``, else one the group's first worker makes and shares
    through the rendezvous store; ``bytes`` or ``str`` (at least 16 bytes, the same on
    every worker) is that secret; ``False`` runs without one, as torch does.

    ``restricted`` (default False): restricted mode, in which this worker serves only
    functions registered by name with plain data, and never unpickles
    (:mod:`rdzv.rpc._restricted`; ``init_rpc(restricted=...)`` and
    ``RDZV_RPC_RESTRICTED=1`` also set it).
    """

    def __init__(
        self,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        device_maps: Optional[Dict[str, DeviceMap]] = None,
        devices: Optional[List[DeviceLike]] = None,
        transports: Optional[List[str]] = None,
        channels: Optional[List[str]] = None,
        _transports: Optional[List[str]] = None,
        _channels: Optional[List[str]] = None,
        secret: Union[bytes, str, None, bool] = None,
        restricted: bool = False,
    ) -> None:
        if num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be at least 1, got {num_worker_threads}")
        if rpc_timeout < 0:
            raise ValueError(f"rpc_timeout must be >= 0 seconds, got {rpc_timeout}")
        if transports is not None and _transports is not None:
            raise ValueError("give transports or _transports, not both")
        if channels is not None and _channels is not None:
            raise ValueError("give channels or _channels, not both")
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method
        self.num_worker_threads = int(num_worker_threads)
        self.device_maps: Dict[str, Dict[str, str]] = {}
        for to, device_map in (device_maps or {}).items():
            self.set_device_map(to, device_map)
        self.devices: List[str] = [_device(d) for d in (devices or [])]
        self.transports = list(transports if transports is not None else _transports or []) or None
        self.channels = list(channels if channels is not None else _channels or []) or None
        if secret is True or not (secret is None or secret is False or isinstance(secret, (bytes, str))):
            raise TypeError(
                f"secret must be bytes, a str, None (shared through the store) or False "
                f"(none), not {secret!r}"
            )
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.restricted = bool(restricted)

    @property
    def _transports(self) -> Optional[List[str]]:
        return self.transports

    @_transports.setter
    def _transports(self, value: Optional[List[str]]) -> None:
        self.transports = value

    @property
    def _channels(self) -> Optional[List[str]]:
        return self.channels

    @_channels.setter
    def _channels(self, value: Optional[List[str]]) -> None:
        self.channels = value

    def set_device_map(self, to: str, device_map: DeviceMap) -> None:
        """Where this worker's tensors land on worker ``to`` (merged with the map set
        already; one local device maps to one remote device)."""
        full = _device_map(device_map)
        current = self.device_maps.setdefault(to, {})
        for k, v in full.items():
            if k in current and current[k] != v:
                raise ValueError(
                    "`set_device_map` only supports 1-to-1 mapping, "
                    f"trying to map {k} to {v} and {current[k]}"
                )
        current.update(full)

    def set_devices(self, devices: List[DeviceLike]) -> None:
        """The devices this worker uses (empty: those of its device maps)."""
        self.devices = [_device(d) for d in devices]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rpc_timeout={self.rpc_timeout}, "
            f"init_method={self.init_method!r}, num_worker_threads={self.num_worker_threads}, "
            f"device_maps={self.device_maps}, devices={self.devices}, "
            f"transports={self.transports}, channels={self.channels}, "
            f"secret={_secret_repr(self.secret)})"
        )


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """torch's name for :class:`RpcBackendOptions`; the same options."""
