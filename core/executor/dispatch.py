"""Dispatch and execution: run a plan's per-step program, choosing host or provider kernels.

Running walks the per-step nodes, :attr:`~core.executor.plan.Plan.steps`, in graph order (the
builder writes them topologically sorted). On a device provider each node's kernel is chosen
on the first run for each combination of graph-input types: its host kernel when every input
is a host value (:mod:`core.executor.host`), else the provider's. The choices form a program,
kept for later runs with the same combination.

Activation memory. A decode step keeps every node's output buffers from step to step (stable
pointers for capture and eager replay; a few rows each). A prefill does not need to: its buffers
are [B * S, ...] and the next decode step uses other shapes. So a *transient* run (by default
every run of the last-position program, the prefills; ``Plan.run(..., transient=...)`` chooses)
marks every kernel context ``transient`` and, right after the last node that reads a node's
outputs, drops that node's buffers of this run (:meth:`KernelContext.release_transient`; a buffer
a captured graph holds is never dropped) and the run's references to them. The provider's
allocator then hands the same memory to later nodes, so the run's peak is its live activations
(a layer or two) rather than one buffer per node of every layer: for 8,192 prompt tokens of a
16-layer model, hundreds of MB instead of several GB. Dropping a buffer only drops the context's
reference, so a graph output the run returns (the logits) keeps its memory; after the run every
buffer of it is dropped from the contexts (also when a kernel raised). The lifetimes are
computed once per program (:meth:`Plan._deaths`), and :attr:`Plan.transient_peak_bytes` says
how many bytes the run's node buffers held at once.

Observer. :attr:`Plan.observer`, when set, is told about every node of a run (``begin(node)``,
``end(node, args, results)``; :class:`core.kernel_profile.NodeObserver` counts and times them).

Hooks. A node with declared hooks (:attr:`Plan.hooks`, :mod:`core.executor.hooks`) runs them
around its kernel, once per launch (a row-blocked node: once per block), inside the observer's
``begin`` and ``end``; such a node always runs its provider kernel, never a host one. Dispatch
is the one place a per-step kernel is called: hooks hold no kernel and ``kernels`` is never
replaced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np

from core import fusion
from core.executor.checks import Step, check_outputs
from core.executor.hooks import NodeHooks, block_args, page_contexts
from core.opdefs import is_host
from core.protocol import ExecutionProvider, Kernel, KernelContext, NodeInfo

if TYPE_CHECKING:
    from core.executor.plan import Plan


class Dispatch:
    """The running half of :class:`~core.executor.plan.Plan` (module docstring)."""

    # the plan's state (set by Plan.__init__, core.executor.plan)
    provider: ExecutionProvider
    kv_layout: str
    nodes: list[NodeInfo]
    contexts: list[KernelContext]
    kernels: list[Kernel]
    host_kernels: list[Kernel | None]
    _host_contexts: list[KernelContext | None]
    _types: dict[str, tuple[np.dtype | None, int | None]]
    input_names: list[str]
    output_names: list[str]
    host_dispatch: bool
    constants: dict[str, Any]
    last_position_constants: dict[str, np.ndarray]
    steps: list[int]
    last_position_steps: list[tuple[int, NodeInfo]] | None
    _programs: dict[tuple, list[Step]]
    _deaths_of: dict[tuple, list]
    _program: list[Step]
    _frozen: bool
    _live: int
    transient_peak_bytes: int
    observer: Any
    hooks: dict[int, NodeHooks]

    def as_plan(self) -> Plan:
        """This object as the :class:`~core.executor.plan.Plan` it is part of (for typing)."""
        return cast("Plan", self)

    def _step(self, i: int, args: list, node: NodeInfo | None = None) -> Step:
        """Node ``i``'s step for these argument values: its host kernel when it has one and
        every argument is a host value, else the provider's kernel. ``node``: the node's
        inputs and outputs when they differ from ``nodes[i]`` (the last-position program).
        A node with hooks (:attr:`hooks`) always takes the provider's kernel."""
        node = self.nodes[i] if node is None else node
        kernel, ctx, hooks = self.host_kernels[i], self._host_contexts[i], self.hooks.get(i)
        if kernel is not None and ctx is not None and hooks is None and all(map(is_host, args)):
            return Step(i, kernel, ctx, node, True)
        return Step(i, self.kernels[i], self.contexts[i], node, False, hooks)

    def _check_outputs(self, step: Step, results: Any) -> None:
        """Check a result that is not ``step.last`` (:mod:`core.executor.checks`).

        Raises:
            KernelOutputError: not a tuple/list, too few entries or a non-None entry past the
                declared outputs, or a named output that is None or of another dtype / rank
                than declared.
        """
        check_outputs(self.nodes[step.index], self._types, step, results)

    def _every_context(self) -> list[KernelContext]:
        return self.contexts + [c for c in self._host_contexts if c is not None]

    def set_frozen(self, frozen: bool) -> None:
        """Forbid (True) or allow (False) buffer allocation in every kernel context (capture)."""
        self._frozen = frozen
        for ctx in self._every_context():
            ctx.frozen = frozen

    def release_buffers(self) -> int:
        """Drop the kernel contexts' buffers that no captured graph uses (KernelContext.release);
        returns the bytes dropped."""
        return sum(ctx.release() for ctx in self._every_context())

    def set_hooks(self, hooks: dict[int, NodeHooks]) -> None:
        """Declare the hooks of the plan's nodes (node index -> :class:`NodeHooks`), replacing
        every earlier declaration (``{}`` clears them); the next run chooses its kernels again
        (:meth:`reset_dispatch`)."""
        self.hooks = dict(hooks)
        self.reset_dispatch()

    def _call_hooked(self, step: Step, args: list) -> Any:
        """Run ``step``'s kernel with its hooks (:mod:`core.executor.hooks`): per launch, its
        ``before`` actions, the kernel, its ``after`` actions; a row-blocked node's blocks
        write rows ``a:b`` of its ``[..., N]`` output."""
        hooks = step.hooks
        assert hooks is not None
        if hooks.n is None:
            (launch,) = hooks.launches
            for action in launch.before:
                action()
            results = step.kernel(step.ctx, *args)
            hooks.count += 1
            for action in launch.after:
                action()
            return results
        ctx, n, full = step.ctx, hooks.n, None
        for context, launch, (a, b) in zip(page_contexts(ctx, hooks), hooks.launches, hooks.ranges):
            for action in launch.before:
                action()
            (part,) = step.kernel(context, *block_args(args, hooks, launch))
            if full is None:
                full = ctx.output(0, (*part.shape[:-1], n), part.dtype)
            full[..., a:b] = part
            hooks.count += 1
            for action in launch.after:
                action()
        return (full,)

    def reset_dispatch(self) -> None:
        """Forget the host/device kernel choices (:mod:`core.executor.host`): the next run
        chooses again. Needed only after replacing constants by values of another kind (a
        device weight by a host array); the choices are keyed by the graph inputs' types."""
        self._programs.clear()

    def host_nodes(self) -> list[str]:
        """Names of the nodes the latest run ran on host (cpu_reference) kernels."""
        return [self.nodes[s.index].name for s in self._program if s.host]

    def run(self, feeds: dict[str, Any], transient: bool | None = None) -> dict[str, Any]:
        """Run the graph. ``feeds`` maps every graph input to a tensor (and optionally
        :data:`core.fusion.LAST_INDEX`: the last-position program); returns graph outputs.

        ``transient``: free each node's buffers once the run no longer reads them ("Activation
        memory" in the module docstring); None (default): for runs of the last-position
        program, the prefills, and not for the others (decode steps keep theirs). Never while
        the plan is frozen (a capture: the graph keeps the buffers' pointers).

        Raises:
            KeyError: a graph input is not fed.
            KernelOutputError: a kernel returned bad outputs (:mod:`core.executor.checks`).
        """
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise KeyError(f"graph inputs not fed: {', '.join(missing)}")
        values: dict[str, Any] = dict(self.constants)
        values.update(feeds)
        gathered = self.last_position_steps if feeds.get(fusion.LAST_INDEX) is not None else None
        if gathered is not None:
            values.update(self.last_position_constants)
        if transient is None or self._frozen:  # a capture records buffers that must outlive it
            transient = gathered is not None and not self._frozen
        key = (gathered is not None, tuple(type(feeds[n]) for n in self.input_names) if self.host_dispatch else None)
        program = self._programs.get(key)
        order: list[tuple[int, NodeInfo]] = []
        if program is None:
            order = gathered if gathered is not None else [(i, self.nodes[i]) for i in self.steps]
        deaths = self._deaths(key, order if program is None else program) if transient else None
        if deaths is not None:
            self._live = self.transient_peak_bytes = 0
            for ctx in self._every_context():
                ctx.transient = True
        try:
            if program is None:
                self._program = self._programs[key] = self._dispatch(values, order, deaths)
            else:
                self._program = program
                self._execute(program, values, deaths)
        finally:
            if deaths is not None:
                for ctx in self._every_context():
                    ctx.transient = False
                    ctx.release_transient()  # a run that raised: nothing of it is kept either
        return {name: values[name] for name in self.output_names}

    def _deaths(self, key: tuple, order: list) -> list[tuple[list[int], list[str]]]:
        """Activation lifetimes of the program ``key`` (``order``: its steps or its ``(index,
        node)`` pairs): after position p, the positions whose nodes' buffers die (every output
        read for the last time, or never read) and the value names that die (graph outputs
        never do: the run returns them). A node that also writes a graph output (attention
        with its present KV, the lm_head with the logits) still drops its buffers: what the
        run returns keeps its own reference, so its memory is not reused while it lives."""
        cached = self._deaths_of.get(key)
        if cached is not None:
            return cached
        ios = [(s.inputs, s.outputs) if isinstance(s, Step) else (s[1].inputs, s[1].outputs) for s in order]
        last_read: dict[str, int] = {}
        made: dict[str, int] = {}
        for pos, (inputs, outputs) in enumerate(ios):
            for x in inputs:
                if x:
                    last_read[x] = pos
            for y in outputs:
                if y:
                    made[y] = pos
        returned = set(self.output_names)
        deaths: list[tuple[list[int], list[str]]] = [([], []) for _ in ios]
        for pos, (_, outputs) in enumerate(ios):
            names = [y for y in outputs if y]
            ends = [max(pos, last_read.get(y, pos)) for y in names]
            deaths[max(ends, default=pos)][0].append(pos)
            for y, end in zip(names, ends):
                # the run returns graph outputs: their values stay (and so does their memory: a
                # context that drops a buffer only drops its own reference)
                if made[y] == pos and y not in returned:  # a graph never writes a name twice
                    deaths[end][1].append(y)
        self._deaths_of[key] = deaths
        return deaths

    def _free(self, program: list[Step], values: dict[str, Any], pos: int,
              death: tuple[list[int], list[str]]) -> None:
        """After position ``pos`` of a transient run: count what its node allocated, then drop
        what dies there (:meth:`_deaths`), keeping :attr:`transient_peak_bytes` up to date."""
        step = program[pos]
        if not step.host:
            self._live += step.ctx.take_transient_allocated()
            self.transient_peak_bytes = max(self.transient_peak_bytes, self._live)
        for dead in death[0]:
            freed = program[dead].ctx.release_transient()
            if not program[dead].host:
                self._live -= freed
            program[dead].last = None
        for name in death[1]:
            values.pop(name, None)

    def _execute(self, program: list[Step], values: dict[str, Any],
                 deaths: list[tuple[list[int], list[str]]] | None) -> None:
        """:meth:`run`'s loop over a cached program; with :attr:`observer` set, the observer is
        told about every node: ``begin(node)`` before its kernel, ``end(node, args, results)``
        after (``node`` a NodeInfo; it may time it, e.g. with device events, or count its
        work). ``deaths``: a transient run's lifetimes (:meth:`_deaths`), or None."""
        observer = self.observer
        if observer is None and deaths is None:  # the decode step: nothing but the kernels
            for step in program:
                args = [values[x] if x else None for x in step.inputs]
                results = step.kernel(step.ctx, *args) if step.hooks is None else self._call_hooked(step, args)
                if results is not step.last:
                    self._check_outputs(step, results)
                for name, value in zip(step.outputs, results):
                    if name:
                        values[name] = value
            return
        for pos, step in enumerate(program):
            args = [values[x] if x else None for x in step.inputs]
            if observer is not None:
                observer.begin(self.nodes[step.index])
            results = step.kernel(step.ctx, *args) if step.hooks is None else self._call_hooked(step, args)
            if observer is not None:
                observer.end(self.nodes[step.index], args, results)
            del args
            if results is not step.last:
                self._check_outputs(step, results)
            for name, value in zip(step.outputs, results):
                if name:
                    values[name] = value
            del results
            if deaths is not None:
                self._free(program, values, pos, deaths[pos])

    def _dispatch(self, values: dict[str, Any], order: list[tuple[int, NodeInfo]],
                  deaths: list[tuple[list[int], list[str]]] | None = None) -> list[Step]:
        """Run the nodes of ``order`` (``(index, node)`` pairs), choosing each node's kernel
        from its argument values (host dispatch); returns the program of the choices.
        ``deaths``: as :meth:`_execute`'s."""
        program = []
        observer = self.observer
        for pos, (i, node) in enumerate(order):
            args = [values[x] if x else None for x in node.inputs]
            step = self._step(i, args, node)
            if observer is not None:
                observer.begin(self.nodes[i])
            results = step.kernel(step.ctx, *args) if step.hooks is None else self._call_hooked(step, args)
            if observer is not None:
                observer.end(self.nodes[i], args, results)
            del args
            self._check_outputs(step, results)
            for name, value in zip(node.outputs, results):
                if name:
                    values[name] = value
            del results
            program.append(step)
            if deaths is not None:
                self._free(program, values, pos, deaths[pos])
        return program

