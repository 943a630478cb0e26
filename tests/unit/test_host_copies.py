"""Host memory under a budget (docs/large-models.md, Limits): each streamed or mapped weight is
held once on the host, in the staged copy, in the layout its kernel reads; nothing else the
Runner keeps (its constants, the kernels' caches, the prepare pass's shared forms) holds a
second copy of it, and the raw weight stays a view of the memory-mapped file.

cpu_reference with a prepare hook that makes a new array (as the cuda hooks pack fp16 and int4
weights) stands in for the device: its "device" is host memory too, so the count is of every
array the Runner holds, resident ones included."""

import numpy as np
import pytest

from core.runtime import residency
from core.runtime.runner import Runner
from core.testing.tiny_model import TinyConfig, make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider


class _Packing(CpuReferenceProvider):
    """MatMul weights prepared as a new array (W^T), read back by the kernel."""

    def prepare(self, node):
        if node.op_type != "MatMul":
            return super().prepare(node)
        return lambda ctx, a, w: None if w is None else {1: np.ascontiguousarray(w.T)}

    def kernel(self, node):
        run = super().kernel(node)
        if node.op_type != "MatMul":
            return run
        return lambda ctx, a, w: run(ctx, a, np.ascontiguousarray(w.T))

    def row_blocks(self, node, shape_of):
        return None


def _owned(value, seen: dict) -> None:
    """Every NumPy buffer reachable from ``value`` that owns its memory (a memory map's pages
    are the file's, not a copy), by the id of its base."""
    if isinstance(value, np.ndarray):
        root = value
        while isinstance(root.base, np.ndarray):
            root = root.base
        if not isinstance(root, np.memmap) and root.base is None:
            seen[id(root)] = root
    elif isinstance(value, dict):
        for v in value.values():
            _owned(v, seen)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _owned(v, seen)


@pytest.fixture(autouse=True)
def small_tensors_stream(monkeypatch):
    monkeypatch.setattr(residency, "SMALL_BYTES", 512)


@pytest.mark.parametrize("tied", [True, False])
def test_each_streamed_weight_is_held_once_on_the_host(tmp_path, tied):
    folder = make_tiny_model(tmp_path / "m", config=TinyConfig(layers=4, vocab=256, tied=tied), external=True)
    weights = sum(w.nbytes for w in residency.weights_of(Runner(folder, _Packing()).plan))
    provider = _Packing()
    runner = Runner(folder, provider, weight_budget=weights // 2, staging_slots=2)
    r = runner.residency
    assert r.streams
    staged = runner.plan.staged_weights
    # the host copies are those of what streams or is mapped, nothing else (a weight the load
    # staged and the Runner's plan keeps resident has given its host copy back)
    assert set(staged) == set(r.streamed_tensors) | set(r.mapped)
    slots = {id(s) for s in runner.stream.slots}
    for name in r.streamed_tensors:  # what the kernels read is a slot view, not another copy
        base = runner.plan.constants[name]
        while isinstance(base.base, np.ndarray):
            base = base.base
        assert id(base) in slots
    held: dict = {}
    _owned([ctx.cache for ctx in runner.plan.contexts], held)
    assert not held, "a kernel's cache holds a copy of a weight"
