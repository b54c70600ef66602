"""The data dump's tensor files of CUDA tensors: copied into pinned memory as the op returns, written off-thread.

:meth:`PinnedFiles.add` starts a ``non_blocking`` copy of the tensor into pinned host memory (its values as the op
left them: the copy is queued on the device before anything that could change them) and keeps the file's path.
:meth:`PinnedFiles.send` (the step's end, or every :data:`BATCH_BYTES` copied) records a marker per device and hands
the files to the poller, which writes them once the copies are done.  The training thread waits only where more
than :data:`MAX_IN_FLIGHT` bytes are still unwritten (a dump of more than that per step, faster than a disk
takes it): then for the poller to catch up.
"""

from __future__ import annotations

import threading

import torch

from obs._core import safe_files
from obs._core.internal import suppressed
from obs.features.dump._npy import npy_bytes
from obs.features.dump._tensors import host_array, read_after_the_step
from obs.runtime.device_readback import Poller, marker, pinned_copy

__all__ = ["BATCH_BYTES", "MAX_IN_FLIGHT", "PinnedFiles"]

BATCH_BYTES = 256 << 20  #: copied bytes handed to the poller without waiting for the step's end
MAX_IN_FLIGHT = 4 << 30  #: pinned bytes not written yet beyond which the training thread waits


class PinnedFiles:
    """``.npy`` files of device tensors, written by ``poller``'s thread."""

    def __init__(self, poller: Poller, *, cpu: bool = False) -> None:
        self.poller = poller
        self._cpu = cpu
        self._lock = threading.Lock()
        self._files: list[tuple[str, torch.Tensor]] = []
        self._devices: set[torch.device] = set()
        self._batch_bytes = 0
        self._in_flight = 0  # bytes sent and not written

    def takes(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`add` takes ``tensor`` (a plain strided CUDA tensor)."""
        return read_after_the_step(tensor, self._cpu)

    def add(self, path: str, tensor: torch.Tensor) -> None:
        """Write ``tensor``'s values as they are now to ``path`` (a new file in a folder that exists), later."""
        with suppressed():
            host = pinned_copy(tensor.detach())
        size = host.numel() * host.element_size()
        with self._lock:
            self._files.append((path, host))
            self._devices.add(tensor.device)
            self._batch_bytes += size
            full = self._batch_bytes >= BATCH_BYTES
        if full:
            self.send()

    def send(self) -> None:
        """Hand the files added so far to the poller."""
        with self._lock:
            files, devices, size = self._files, self._devices, self._batch_bytes
            self._files, self._devices, self._batch_bytes = [], set(), 0
            self._in_flight += size
            wait = self._in_flight > MAX_IN_FLIGHT
        if not files:
            return
        markers = [marker(device) for device in devices]
        self.poller.submit(markers, lambda: self._write(files, size))
        if wait:
            self.poller.drain()

    def _write(self, files: list[tuple[str, torch.Tensor]], size: int) -> None:
        try:
            for path, host in files:
                header, data = npy_bytes(host_array(host))
                safe_files.write_new(path, header, data, folder_ready=True)
        finally:
            with self._lock:
                self._in_flight -= size
