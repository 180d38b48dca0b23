"""Work buffers a backend reuses from one collective to the next."""

from __future__ import annotations

import numpy as np

__all__ = ["ScratchPool"]


class ScratchPool:
    """Work buffers reused across one backend's collectives (which run one at a time).

    Reuse matters: a freshly allocated large buffer is returned to the OS when freed and
    page-faulted in again on the next call, which costs more than moving the data.
    """

    #: buffers above this many bytes are not kept between collectives
    KEEP_MAX = 256 * 1024 * 1024

    def __init__(self) -> None:
        self._buffers: dict[int, np.ndarray] = {}

    def get(self, slot: int, count: int, dtype: np.dtype) -> np.ndarray:
        """A writable 1-D array of `count` `dtype` elements; one buffer per `slot`."""
        nbytes = count * np.dtype(dtype).itemsize
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = np.empty(nbytes, dtype=np.uint8)
            if nbytes <= self.KEEP_MAX:
                self._buffers[slot] = buffer
        return buffer[:nbytes].view(dtype)

    def clear(self) -> None:
        self._buffers.clear()
