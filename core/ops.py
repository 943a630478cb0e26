"""Op tables: a provider's kernels as one module per op in a package.

Each op module defines ``OP_TYPE``, optionally ``DOMAIN`` ("" default), ``run(ctx, *inputs)``
returning a tuple with one entry per node output (None for an unused optional output; the
executor checks this, :class:`core.executor.KernelOutputError`), and optionally:

- ``supports(node) -> bool``: attribute and dtype checks (default: True);
- ``support_reason(node) -> str | None``: why ``supports`` rejects the node, in the module's
  own words (None: no particular reason; :meth:`OpTable.support_reason` then names the
  dtypes and attributes);
- ``prepare(ctx, *inputs) -> dict[int, tensor | None] | None``: the plan-time weight hook.
  The executor calls it once per per-step node, after constant folding and before the first
  run, with the node's context and, for each node input, its value when it is a plan constant
  (a weight: a device tensor; a small integer constant: a host array) and None otherwise. It
  returns None (nothing to prepare) or {input index: replacement}: a tensor in the kernel's
  own form (a packed or interleaved weight) that becomes a new plan constant for that input,
  or None to drop that input (the kernel then receives None). Only constant inputs may be
  replaced. Static per-node facts the kernel needs (K, N, ...) go in ``ctx.cache``; the
  kernel reads them there, so the presence of its cache entry says "my inputs are prepared".
  A kernel must never key a cache on a tensor's device pointer (streamed weights share one
  staging slot), and must still run on unprepared inputs (direct calls, fed weights).
  During the call ``ctx.cache[PREPARE_SHARED]`` is a dict shared by every hook of the plan's
  prepare pass (removed afterwards): hooks of different nodes that derive the same form of
  one constant store it there under a key naming the constant (``ctx.node.inputs[j]``) and
  return that same object, which the executor then keeps once (the cuda provider's tied
  embedding and lm_head read one packed weight). A constant that is a view of another (a
  folded Reshape of a weight) is named there by the constant it views (:func:`storage_name`).
  Never key on an object's id: a weight is uploaded just before the first hook that receives
  it, and dropped once its last reader has replaced it, so ids are reused during the pass.
- ``prepared(node, *inputs) -> dict[int, Spec | None] | None``: what ``prepare`` will return
  for ``node``, from shapes and dtypes alone (the load's residency is planned before any
  weight is read: :mod:`core.runtime.forecast`). ``inputs``: per node input a :class:`Spec`
  of the constant (its ``key`` the constant's :func:`storage_name`), None for a non-constant.
  It returns None when ``prepare`` returns None, else the same indices, each the
  :class:`Spec` of the replacement (its ``key`` the key of the shared form, so two nodes that
  get one object declare one key; None: a form of its own) or None for a dropped input. A
  module with ``prepare`` and no ``prepared`` is planned from the raw sizes.

Modules whose name starts with "_" are helpers. The table is built by
introspecting the package (the registry comes from the modules, not a hand-kept
list), so adding an op is adding a file.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Hashable
from types import ModuleType
from typing import Any

import attrs
import numpy as np

from core.protocol import Kernel, NodeInfo

#: ``ctx.cache`` key of the dict a prepare pass shares between its hooks (module docstring).
PREPARE_SHARED = "prepare_shared"
#: Key, in that shared dict, of {constant name: the name of the constant whose storage it is a
#: view of (its own name when it owns its storage)}, as the pass began: hooks that share a form
#: of one weight read under two names (the builder's tied int4 table and its reshaped view) key
#: it by :func:`storage_name`.
STORAGE_NAMES = "storage_names"
#: ``ctx.cache`` key of a node's run memos (:func:`memo`): a dict of what its kernel derived
#: from the arguments of a call, kept with those arguments (the cuda eager replay's launches, a
#: converted or dequantised weight). A re-plan that moves a weight drops it for the nodes
#: reading that weight (:func:`core.runtime.streaming.forget`), so the old copy is freed; the
#: rest of a node's cache (what its prepare hook recorded of the weight's layout) stays.
RUN_MEMO = "run_memo"


def run_memos(ctx) -> dict:
    """The node's run memos (:data:`RUN_MEMO`): key -> (arguments, what was derived from them)."""
    return ctx.cache.setdefault(RUN_MEMO, {})


def memo(ctx, key: str, args: tuple, make: Callable[[], Any]) -> Any:
    """``make()``, kept in the node's run memos under ``key`` while the same ``args`` come back
    (by identity; the memo holds them, so their ids stay unique; never by device pointer)."""
    memos = run_memos(ctx)
    hit = memos.get(key)
    if hit is not None and len(hit[0]) == len(args) and all(a is b for a, b in zip(hit[0], args)):
        return hit[1]
    out = make()
    memos[key] = (args, out)
    return out


def storage_name(ctx, name: str) -> str:
    """The constant whose storage constant ``name`` views (``name`` itself when none, or outside
    a prepare pass), by :data:`STORAGE_NAMES`."""
    shared = ctx.cache.get(PREPARE_SHARED) or {}
    return shared.get(STORAGE_NAMES, {}).get(name, name)


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


@attrs.frozen
class Spec:
    """A tensor without its data: its shape and dtype, and a key (module docstring,
    ``prepared``): for a constant input the constant whose storage it is, for a prepared form
    the key of the form several nodes share (None: its own). ``size``, ``ndim`` and ``nbytes``
    are an array's, so a hook's shape checks run on a Spec as on the array."""

    shape: tuple[int, ...] = attrs.field(converter=_shape)
    dtype: np.dtype = attrs.field(converter=np.dtype)
    key: Hashable = None

    @property
    def size(self) -> int:
        """Elements."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        """Axes."""
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes."""
        return self.size * self.dtype.itemsize


class OpTable:
    """(domain, op_type) -> op module, for every op module of ``package``.

    ``supports``, ``support_reason``, ``kernel`` and ``prepare`` are what a provider's members
    of the same names usually delegate to (``prepare`` is the optional provider member the
    executor looks up; ``support_reason`` the optional one the parity kit reads when it skips
    an unsupported case).
    """

    def __init__(self, package: ModuleType):
        self.modules: dict[tuple[str, str], ModuleType] = {}
        for info in pkgutil.iter_modules(package.__path__):
            if info.name.startswith("_"):
                continue
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            op_type = getattr(module, "OP_TYPE", None)
            if op_type is not None:
                self.modules[(getattr(module, "DOMAIN", ""), op_type)] = module

    def supports(self, node: NodeInfo) -> bool:
        """True when an op module exists for the node and its ``supports`` (if any) agrees; a
        module with ``support_reason`` and no ``supports`` accepts the node when it gives no reason."""
        module = self.modules.get((node.domain, node.op_type))
        if module is None:
            return False
        check = getattr(module, "supports", None)
        if check is None:
            explain = getattr(module, "support_reason", None)
            return explain is None or not explain(node)
        return bool(check(node))

    def support_reason(self, node: NodeInfo) -> str | None:
        """None when :meth:`supports` accepts the node; else why not: "no op module for
        DOMAIN.OP" (DOMAIN "ai.onnx" for the default domain), the op module's own
        ``support_reason(node)`` answer when it has one and gives one, else
        "<module>.supports() returned False for dtypes [...] attrs {...}"."""
        module = self.modules.get((node.domain, node.op_type))
        if module is None:
            return f"no op module for {node.domain or 'ai.onnx'}.{node.op_type}"
        if self.supports(node):
            return None
        explain = getattr(module, "support_reason", None)
        reason = explain(node) if explain is not None else None
        if reason:
            return str(reason)
        dtypes = ", ".join("-" if d is None else np.dtype(d).name for d in node.input_dtypes)
        attributes = ", ".join(f"{k}={v!r}" for k, v in sorted(node.attrs.items()))
        return f"{module.__name__}.supports() returned False for dtypes [{dtypes}] attrs {{{attributes}}}"

    def kernel(self, node: NodeInfo) -> Kernel:
        """The op module's ``run``.

        Raises:
            KeyError: no module for the node's (domain, op_type).
        """
        return self.modules[(node.domain, node.op_type)].run

    def prepare(self, node: NodeInfo) -> Callable[..., dict | None] | None:
        """The op module's plan-time weight hook ``prepare(ctx, *inputs)`` (module docstring),
        or None when the module has none or no module exists for the node."""
        module = self.modules.get((node.domain, node.op_type))
        return None if module is None else getattr(module, "prepare", None)

    def prepared(self, node: NodeInfo) -> Callable[..., dict | None] | None:
        """The op module's declaration of what its hook prepares, ``prepared(node, *inputs)``
        (module docstring), or None when the module has none or no module exists."""
        module = self.modules.get((node.domain, node.op_type))
        return None if module is None else getattr(module, "prepared", None)
