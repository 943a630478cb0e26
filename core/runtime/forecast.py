"""The weights a load will have, before any is read: the prepare pass forecast from shapes.

A budget's residency is planned before loading (:mod:`core.runtime.placement`), so that the
device never holds more than the budget. The plan must be made over the weights the load will
have, not the raw initializers: a provider's prepare hooks (:mod:`core.ops`) replace weights
by forms of other sizes (padded, packed, interleaved), drop inputs, and give one object to
several nodes (the packed tied embedding), and each changes which weights stay resident and
what a page holds (an int4 lm_head's page is its packed codes and scales). A plan made from the
raw sizes names a smallest working budget the loaded plan does not work with.

:class:`Forecast` runs the plan's prepare pass on :class:`core.ops.Spec` alone: each per-step
node the provider has a hook for, in the pass's order, is rewired as the pass will rewire it,
to the forms the provider declares (``prepared_forms``, :meth:`core.provider.ProviderBase.prepared_forms`),
under the names the pass will give them (``{node}:prepared:{j}``; one name per shared form).
It has the members of a plan that :func:`core.runtime.residency.weights_of` and
:func:`core.runtime.rowblocks.plan_splits` read, so the planner sees the nodes, names and sizes
of the loaded plan. A node whose provider declares nothing keeps its raw weights.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from core.executor.weights import WeightRead, collect_reads, storage, unread_bytes
from core.ops import Spec


class Forecast:
    """A plan as its prepare pass will leave it (module docstring), from a plan that is
    folded and not yet prepared.

    Attributes:
        provider, steps: the plan's.
        nodes: the plan's nodes, rewired to their declared forms.
        constants: the plan's constants, the forms' Specs added under their names.
        forms: the names of the forms (constant name -> its Spec).
        staged_weights: empty (nothing is placed yet).
    """

    def __init__(self, plan: Any):
        self.provider, self.steps, self._plan = plan.provider, plan.steps, plan
        self.nodes = list(plan.nodes)
        self.constants: dict[str, Any] = dict(plan.constants)
        self.forms: dict[str, Spec] = {}
        self.staged_weights: dict[str, Any] = {}
        storage_names = plan._storage_names()
        names: dict[Any, str] = {}  # a shared form's key -> its name
        for i in plan._prepare_order():
            node = self.nodes[i]
            if plan.provider.prepare(node) is None or not any(x in plan.constants for x in node.inputs if x):
                continue
            specs = [None if not x or x not in plan.constants else
                     Spec(plan.constants[x].shape, plan.constants[x].dtype, storage_names.get(x, x))
                     for x in node.inputs]
            forms = plan.provider.prepared_forms(node, specs)
            if forms:
                self._rewire(i, forms, names)

    def _rewire(self, i: int, forms: dict, names: dict) -> None:
        """Node ``i`` reads ``forms`` (input index -> Spec or None) as the prepare pass rewires
        it (:meth:`core.executor.prepare.Preparing._apply_changes`)."""
        node = self.nodes[i]
        inputs = list(node.inputs)
        dtypes = list(node.input_dtypes) + [None] * (len(inputs) - len(node.input_dtypes))
        for j, spec in sorted(forms.items()):
            if not 0 <= j < len(inputs) or not inputs[j] or inputs[j] not in self._plan.constants:
                raise ValueError(f"prepared_forms of node {node.name!r} ({node.op_type}) replaced input {j}, "
                                 "which is not a constant")
            if spec is None:
                inputs[j], dtypes[j] = "", None
                continue
            name = names.get(spec.key) if spec.key is not None else None
            if name is None:
                name = f"{node.name}:prepared:{j}"
                if spec.key is not None:
                    names[spec.key] = name
                self.constants[name] = self.forms[name] = spec
            inputs[j], dtypes[j] = name, np.dtype(spec.dtype)
        self.nodes[i] = attrs.evolve(node, inputs=tuple(inputs), input_dtypes=tuple(dtypes))

    def _key(self, name: str) -> Any:
        if name in self.forms:
            return ("form", name)
        value = self.constants.get(name)
        return None if value is None else id(storage(value))

    def _nbytes(self, name: str) -> int:
        spec = self.forms.get(name)
        return spec.nbytes if spec is not None else self._plan._weight_nbytes(name, self.constants[name])

    def weight_reads(self) -> list[WeightRead]:
        """As :meth:`core.executor.Plan.weight_reads` once the plan is prepared."""
        return collect_reads(self.nodes, self.steps, self._key, self._nbytes)

    def unread_bytes(self) -> int:
        """As :meth:`core.executor.Plan.unread_bytes` once the plan is loaded: the constants no
        per-step node reads before or after the pass (a weight a form replaced is dropped), at
        their present sizes (the placer keeps them resident)."""
        plan = self._plan
        read = {x for nodes in (plan.nodes, self.nodes) for i in self.steps for x in nodes[i].inputs if x}
        return unread_bytes(plan.constants, read, plan._weight_nbytes)
