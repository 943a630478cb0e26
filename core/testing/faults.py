"""Fault injection: a provider wrapper that raises at a chosen kernel, allocation or copy.

Wrap any provider, plan a Runner on the wrapper, then arm one fault at a time::

    faulty = FaultyProvider(get_provider("cpu_reference"))
    runner = Runner(model_dir, faulty)                # kernels are wrapped as the plan is made
    faulty.arm("kernel", match="GroupQueryAttention", after=2)
    with pytest.raises(InjectedFault):
        session.step()                                # the third GQA kernel call raises
    assert faulty.fired == 1                          # the fault ran (the test's path ran)
    session.step()                                    # disarmed after firing: runs clean

Sites (:data:`SITES`):

- ``kernel``: a node's kernel (``match``: the node's op type, e.g. "GroupQueryAttention",
  "MatMulNBits"; None: any node);
- ``allocate``: :meth:`allocate` and ``reserve`` (VMM), the KV cache's and step buffers';
- ``copy``: ``copy_bytes`` (KV growth moves the live prefixes with it; a grouped prefill
  copies its rows);
- ``write``: a host-to-device write into an existing tensor (``write``);
- ``download``: a device-to-host copy (``download``, ``download_async`` as it starts);
- ``read``: the wait for a ``download_async`` copy (where an asynchronous copy's failure shows);
- ``commit``: ``kv_commit`` (VMM pages; counted bytes elsewhere).

A fault fires once (after ``after`` matching calls pass) and then disarms itself; it raises
``error`` (default :class:`InjectedFault`; pass ``MemoryError``, ``KeyboardInterrupt`` or a
:class:`~core.runtime.residency.BudgetError` instance to act as what a real device gives).
Every other member is the wrapped provider's own, so the wrapper runs on any provider
(cpu_reference in CI, cuda on a GPU machine); graph capture is left to the wrapped provider,
but a kernel replayed from a captured graph does not pass through the wrapper, so tests that
aim a kernel fault at decode steps make their sessions with ``capture=False``.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs

#: Where a fault can be armed.
SITES = ("kernel", "allocate", "copy", "write", "download", "read", "commit")


class InjectedFault(RuntimeError):
    """The error an armed :class:`FaultyProvider` raises by default (names the site and call)."""


@attrs.define
class Fault:
    """One armed fault.

    Attributes:
        site: one of :data:`SITES`.
        match: for ``kernel``, the op type that counts (None: every node).
        after: matching calls that pass before the one that raises.
        error: the exception (class or instance) raised.
        seen: matching calls so far.
    """

    site: str
    match: str | None = None
    after: int = 0
    error: Any = InjectedFault
    seen: int = 0


class FaultyProvider:
    """A provider wrapper that raises at an armed site (module docstring).

    Args:
        inner: the provider to wrap (an object with the provider protocol's members).

    Attributes:
        inner: the wrapped provider.
        fired: how many faults have fired so far.
        calls: per site, every call the wrapper has seen, armed or not (for asserting that
            a path ran: e.g. ``calls["copy"]`` grows when KV growth copies).
    """

    def __init__(self, inner: Any):
        self.inner = inner
        self.fired = 0
        self.calls = dict.fromkeys(SITES, 0)
        self._fault: Fault | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    # -- arming --------------------------------------------------------------------------------
    def arm(self, site: str, match: str | None = None, after: int = 0, error: Any = InjectedFault) -> Fault:
        """Arm one fault (replacing any armed one); returns it.

        Raises:
            ValueError: an unknown site, or a negative ``after``.
        """
        if site not in SITES:
            raise ValueError(f"fault site must be one of {SITES}, got {site!r}")
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        self._fault = Fault(site, match, after, error)
        return self._fault

    def disarm(self) -> None:
        """Remove the armed fault, if any (a fault that fired is already removed)."""
        self._fault = None

    @property
    def armed(self) -> bool:
        """Whether a fault is armed and has not fired yet."""
        return self._fault is not None

    def _check(self, site: str, what: str = "") -> None:
        self.calls[site] += 1
        f = self._fault
        if f is None or f.site != site or (f.match is not None and f.match != what):
            return
        f.seen += 1
        if f.seen <= f.after:
            return
        self._fault = None
        self.fired += 1
        err = f.error
        if isinstance(err, type) and issubclass(err, BaseException):
            err = err(f"injected fault at {site}{' ' + what if what else ''} (call {f.seen})")
        raise err

    # -- the wrapped sites -----------------------------------------------------------------------
    def kernel(self, node: Any) -> Any:
        """The wrapped provider's kernel for ``node``, checked at every call."""
        inner = self.inner.kernel(node)
        op = node.op_type

        @functools.wraps(inner)
        def run(*args: Any, **kwargs: Any) -> Any:
            self._check("kernel", op)
            return inner(*args, **kwargs)

        return run

    def allocate(self, shape: Any, dtype: Any, zero: bool = False) -> Any:
        self._check("allocate")
        return self.inner.allocate(shape, dtype, zero)

    def reserve(self, shape: Any, dtype: Any) -> Any:
        self._check("allocate")
        return self.inner.reserve(shape, dtype)

    def copy_bytes(self, dst: Any, src: Any, copies: Any) -> int:
        self._check("copy")
        return self.inner.copy_bytes(dst, src, copies)

    def write(self, tensor: Any, array: Any) -> None:
        self._check("write")
        self.inner.write(tensor, array)

    def download(self, tensor: Any) -> Any:
        self._check("download")
        return self.inner.download(tensor)

    def download_async(self, tensor: Any) -> Any:
        self._check("download")
        return _CheckedRead(self, self.inner.download_async(tensor))

    def kv_commit(self, arena: Any, requests: Any) -> int:
        self._check("commit")
        return self.inner.kv_commit(arena, requests)


class _CheckedRead:
    """A ``download_async`` handle whose ``wait`` passes the ``read`` site first."""

    def __init__(self, provider: FaultyProvider, handle: Any):
        self._provider, self._handle = provider, handle

    def wait(self) -> Any:
        self._provider._check("read")
        return self._handle.wait()
