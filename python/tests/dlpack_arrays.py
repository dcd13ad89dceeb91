"""A stand-in array library that speaks only DLPack, for test_rpc_payload: its arrays
have no buffer protocol and refuse to pickle, so they can travel only by their
``__dlpack__``; the module's ``from_dlpack`` makes one back (as torch's, jax's and cupy's
do)."""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np


class DLPackOnly:
    """Memory exposed only through DLPack (the array it wraps is kept private)."""

    def __init__(self, data: np.ndarray) -> None:
        self._data = data

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self._data.__dlpack_device__()


class DLArray(DLPackOnly):
    """The library's array: it refuses to pickle, so it travels only by DLPack."""

    def __reduce__(self) -> Any:
        raise TypeError("a DLArray travels only by DLPack")

    def numpy(self) -> np.ndarray:
        return self._data


def from_dlpack(x: Any) -> DLArray:
    return DLArray(np.from_dlpack(x))
