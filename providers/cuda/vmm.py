"""A VMM arena: a fixed virtual address range whose physical pages are mapped on demand.

Through the CUDA driver's virtual memory management API (cuda-bindings):
cuMemAddressReserve reserves the range once; cuMemCreate + cuMemMap + cuMemSetAccess back
pages of it as sequences grow (:meth:`VmmArena.commit`). The address never changes, so a
captured decode step that baked the pointer keeps working across KV growth: no recapture, no
copy (docs/cuda.md "Stream capture", VMM). Newly mapped pages are zeroed.

Never managed memory: these are plain device allocations.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

try:  # cuda-bindings >= 12.6 / 13
    from cuda.bindings import driver
except ImportError:  # older cuda-python layout
    from cuda import cuda as driver  # type: ignore[no-redef, unused-ignore]


class VmmError(RuntimeError):
    """A CUDA driver VMM call failed; the message names the call and the error."""


def _check(result):
    err, *rest = result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise VmmError(f"CUDA driver error {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else (rest or None)


def _prop(device_id: int):
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_id
    return prop


def granularity(device_id: int | None = None) -> int:
    """The VMM page size in bytes (2 MiB on the H200)."""
    device_id = cp.cuda.Device().id if device_id is None else device_id
    flag = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(_check(driver.cuMemGetAllocationGranularity(_prop(device_id), flag)))


def available() -> bool:
    """True when the driver supports VMM on the current device."""
    try:
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        dev = _check(driver.cuDeviceGet(cp.cuda.Device().id))
        return bool(_check(driver.cuDeviceGetAttribute(attr, dev)))
    except Exception:  # noqa: BLE001 - any failure means "use plain allocations"
        return False


class VmmArena:
    """A reserved device address range of ``nbytes`` (rounded up to the page size).

    Attributes:
        ptr: the base device address (never changes; the range is freed once, by :meth:`close`).
        size: reserved bytes.
        page: page size in bytes.
        committed: bytes currently backed by physical memory.
    """

    def __init__(self, nbytes: int):
        cp.cuda.Device().use()
        cp.cuda.runtime.free(cp.cuda.runtime.malloc(1))  # make the primary context current
        self.device_id = cp.cuda.Device().id
        self.page = granularity(self.device_id)
        self.size = -(-int(nbytes) // self.page) * self.page
        self.ptr = int(_check(driver.cuMemAddressReserve(self.size, 0, 0, 0)))
        self._closed = False
        self._handles: dict[int, object] = {}  # page index -> physical allocation handle
        self._desc = driver.CUmemAccessDesc()
        self._desc.location = _prop(self.device_id).location
        self._desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    @property
    def committed(self) -> int:
        return len(self._handles) * self.page

    def commit(self, offset: int, nbytes: int) -> int:
        """Back the pages covering ``[offset, offset + nbytes)``; returns bytes newly backed.

        Raises:
            VmmError: the range leaves the arena, or a driver call failed (out of memory).
        """
        if offset < 0 or offset + nbytes > self.size:
            raise VmmError(f"commit [{offset}, {offset + nbytes}) outside the arena of {self.size} bytes")
        first, last = offset // self.page, -(-(offset + nbytes) // self.page)
        added = 0
        prop = _prop(self.device_id)
        for page in range(first, last):
            if page in self._handles:
                continue
            addr = self.ptr + page * self.page
            handle = _check(driver.cuMemCreate(self.page, prop, 0))
            _check(driver.cuMemMap(addr, self.page, 0, handle, 0))
            _check(driver.cuMemSetAccess(addr, self.page, [self._desc], 1))
            self._handles[page] = handle
            cp.cuda.runtime.memsetAsync(addr, 0, self.page, cp.cuda.get_current_stream().ptr)
            added += self.page
        return added

    def array(self, shape, dtype, offset: int = 0) -> cp.ndarray:
        """A CuPy array over the arena (it keeps the arena alive)."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if offset + nbytes > self.size:
            raise VmmError(f"array of {nbytes} bytes at {offset} exceeds the arena ({self.size})")
        mem = cp.cuda.UnownedMemory(self.ptr + offset, nbytes, self, self.device_id)
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))

    def close(self) -> None:
        """Unmap and release every page, then free the range (synchronises the device)."""
        if self._closed:
            return
        cp.cuda.Device(self.device_id).synchronize()
        for page, handle in self._handles.items():
            _check(driver.cuMemUnmap(self.ptr + page * self.page, self.page))
            _check(driver.cuMemRelease(handle))
        self._handles.clear()
        _check(driver.cuMemAddressFree(self.ptr, self.size))
        self._closed = True

    def __del__(self):
        # not contextlib.suppress: at interpreter shutdown the contextlib global may be gone already
        try:  # noqa: SIM105
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
