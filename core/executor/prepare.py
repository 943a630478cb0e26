"""Prepared weights: a plan's load-time pass over the providers' ``prepare`` hooks.

Prepared weights. A provider may offer ``prepare(node) -> hook | None`` (an optional member;
:meth:`core.ops.OpTable.prepare` returns the op module's ``prepare``, see :mod:`core.ops`).
After folding, the hook of every per-step node with constant inputs is called once with the
node's context and its inputs (constants, else None); the replacements it returns become new
constants named ``f"{node.name}:prepared:{i}"`` that the node reads instead, an input it
drops becomes absent, and a replaced constant that no per-step node still reads is dropped
(:meth:`Plan.weight_bytes` counts what stays). Kernels also run unprepared (a direct call or
a fed weight); a prepared node never runs on a host kernel.

Weight memory. Initializers stay host arrays until a node needs them on the provider: a
folded node's inputs are uploaded before it runs, a prepared node's constant inputs just
before its hook (nodes that read one weight are prepared one after the other, so a weight
several hooks replace, the tied embedding, is on the device for those hooks only), and every
other weight after the prepare pass. A replaced weight is dropped as soon as its last
per-step reader has been prepared, and a folded node's input nothing else reads after
folding; ``reset_peak()`` at the end returns the freed blocks. So the device holds one copy
of each weight in the form its kernels read, and the load's peak is those weights plus one
node's raw inputs and its hook's transient (:attr:`Plan.load_peak_bytes` measures it).
During the pass every hook's ``ctx.cache[core.ops.PREPARE_SHARED]`` is one dict, where hooks
that derive the same form of one constant share it; a prepared object several hooks return
becomes one constant. :meth:`Plan.weight_bytes` counts each storage once (a constant that
is a view of another adds nothing) and :meth:`Plan.weight_reads` reports such views as
aliases of one weight.

"""

from __future__ import annotations

import attrs
import numpy as np

from core.executor.folding import Folding
from core.executor.weights import bytes_key
from core.ops import PREPARE_SHARED, STORAGE_NAMES


class Preparing(Folding):
    """The prepare pass of :class:`~core.executor.plan.Plan` (module docstring)."""

    def _prepare(self) -> list[str]:
        """Apply the provider's ``prepare`` hooks to the per-step nodes (module docstring,
        "Prepared weights" and "Weight memory"); returns the names of the new constants.

        Raises:
            ValueError: a hook replaced an input that is not a constant.
        """
        made: list[str] = []
        # per-step readers left of every constant: a replaced one goes as its last reader is done
        left: dict[str, int] = {}
        for i in self.steps:
            for x in set(self.nodes[i].inputs):
                if x in self.constants:
                    left[x] = left.get(x, 0) + 1
        kept: set[str] = set(self.output_names)  # constants a processed node still reads as they are
        replaced: set[str] = set()
        names: dict[int, str] = {}  # id of a prepared value -> its constant name (shared forms)
        shared: dict = {STORAGE_NAMES: self._storage_names()}  # ctx.cache[PREPARE_SHARED] of every hook
        sharing: list[tuple[list, list[str]]] = []  # (keys a hook added to shared, its node's constants)
        for i in self._prepare_order():
            node = self.nodes[i]
            hook = self.provider.prepare(node)
            here = [x for x in dict.fromkeys(node.inputs) if x in left]
            if hook is not None and any(x in self.constants for x in node.inputs if x):
                on_device = self.placer is None or self.placer.prepare_on_device(self.as_plan(), node)
                args = [(self._value(x) if on_device else self.constants[x]) if x in self.constants else None
                        for x in node.inputs]
                ctx = self.contexts[i]
                ctx.cache[PREPARE_SHARED] = shared
                before = set(shared)
                try:
                    changes = hook(ctx, *args)
                finally:
                    ctx.cache.pop(PREPARE_SHARED, None)
                del args
                sharing.append(([k for k in shared if k not in before], here))
                if changes:
                    for name, source in self._apply_changes(i, changes, replaced, names, made):
                        self._place(name, node.name, source)
                del changes
            kept.update(x for x in self.nodes[i].inputs if x in left)
            for x in here:
                left[x] -= 1
                if left[x]:
                    continue
                if x in replaced and x not in kept:
                    self._drop(x)  # its last reader read a prepared form: never uploaded again
                elif x not in self._placed and x in self.constants and self._weight(x):
                    self._place(x, node.name)
            # a shared form whose sources have no hook left to ask for it: dropped from the
            # dict, so a form the placer moved to host memory leaves the device now
            for keys, _ in [e for e in sharing if not any(left[x] for x in e[1])]:
                for k in keys:
                    shared.pop(k, None)
            sharing = [e for e in sharing if any(left[x] for x in e[1])]
        still_read = {x for i in self.steps for x in self.nodes[i].inputs} | set(self.output_names)
        for name in replaced - still_read:
            self._drop(name)
        return made

    def _storage_names(self) -> dict[str, str]:
        """{constant: the first constant (in name order) holding the same bytes in the same
        order}, for the uploaded constants (core.ops.STORAGE_NAMES): a contiguous view of a whole
        weight (a folded Reshape) is named by that weight; a slice or a transposed view is not.
        Every value is alive while this runs, so the ids of their storages are distinct; the
        result holds names only."""
        first: dict[tuple, str] = {}
        out: dict[str, str] = {}
        for name in sorted(self.constants):
            if name not in self._pending:
                out[name] = first.setdefault(bytes_key(self.constants[name]), name)
        return out

    def _prepare_order(self) -> list[int]:
        """:attr:`steps` with the later readers of a weight moved up behind its first reader (the
        tied embedding's lookup and the lm_head), so a weight several hooks replace is on the
        device for those hooks only. Hooks do not depend on each other's order."""
        readers: dict[str, list[int]] = {}
        for i in self.steps:
            for x in dict.fromkeys(self.nodes[i].inputs):
                if x in self._pending:
                    readers.setdefault(x, []).append(i)
        order: dict[int, None] = {}
        for i in self.steps:
            order.setdefault(i)
            for x in dict.fromkeys(self.nodes[i].inputs):
                for j in readers.get(x, ()):
                    order.setdefault(j)
        return list(order)

    def _apply_changes(self, i: int, changes: dict, replaced: set, names: dict, made: list) -> list[tuple[str, str]]:
        """Rewire node ``i`` to a hook's replacements (module docstring, "Prepared weights"):
        new constants named ``{node}:prepared:{j}`` (one name for one object, however many
        hooks return it), dropped inputs absent. Returns (new constant, the input it replaced)
        for each constant made here.

        Raises:
            ValueError: a replaced input is not a constant.
        """
        node = self.nodes[i]
        inputs = list(node.inputs)
        dtypes = list(node.input_dtypes) + [None] * (len(inputs) - len(node.input_dtypes))
        new: list[tuple[str, str]] = []
        for j, value in sorted(changes.items()):
            if not 0 <= j < len(inputs) or not inputs[j] or inputs[j] not in self.constants:
                raise ValueError(f"prepare hook of node {node.name!r} ({node.op_type}) replaced input {j}, "
                                 "which is not a constant")
            replaced.add(inputs[j])
            if value is None:
                inputs[j], dtypes[j] = "", None
                continue
            name = names.get(id(value))
            if name is None or self.constants.get(name) is not value:
                name = names[id(value)] = f"{node.name}:prepared:{j}"
                self.constants[name] = value
                made.append(name)
                new.append((name, inputs[j]))
            inputs[j], dtypes[j] = name, np.dtype(value.dtype)
        self.nodes[i] = self.contexts[i].node = attrs.evolve(node, inputs=tuple(inputs), input_dtypes=tuple(dtypes))
        self.host_kernels[i] = None  # a reference kernel does not read the prepared form
        return new
