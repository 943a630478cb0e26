"""Helpers for the cpu_reference op tests: one-node ONNX models run on ORT (oracle) and the executor."""

from __future__ import annotations

import zlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from core.executor import Plan
from providers.cpu_reference.provider import CpuReferenceProvider


class OneNode:
    """Build a one-node model and run it on ORT (CPU EP) and on cpu_reference."""

    @staticmethod
    def model(op_type: str, inputs: dict, outputs: dict, domain: str = "", **attrs) -> onnx.ModelProto:
        """``inputs``: name -> array (None = absent optional input, written as "");
        ``outputs``: name -> numpy dtype (None = absent optional output, written as "")."""
        names = [n if a is not None else "" for n, a in inputs.items()]
        while names and not names[-1]:
            names.pop()
        node = helper.make_node(op_type, names,
                                [n if t is not None else "" for n, t in outputs.items()],
                                domain=domain or None, **attrs)
        graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                        for n, a in inputs.items() if a is not None]
        graph_outputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), None)
                         for n, t in outputs.items() if t is not None]
        graph = helper.make_graph([node], "one", graph_inputs, graph_outputs)
        opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
        return helper.make_model(graph, opset_imports=opsets, ir_version=10)

    @staticmethod
    def ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, {k: v for k, v in feeds.items() if v is not None})

    @staticmethod
    def ref(model: onnx.ModelProto, feeds: dict, kv_layout: str = "head_major") -> list[np.ndarray]:
        plan = Plan(model.graph, {}, CpuReferenceProvider(), kv_layout=kv_layout)
        out = plan.run({k: v for k, v in feeds.items() if v is not None})
        return [out[o.name] for o in model.graph.output]

    @classmethod
    def both(cls, op_type: str, inputs: dict, outputs: dict, domain: str = "", **attrs):
        m = cls.model(op_type, inputs, outputs, domain, **attrs)
        return cls.ort(m, inputs), cls.ref(m, inputs)


@pytest.fixture
def one_node() -> type[OneNode]:
    return OneNode


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's id: the same data on every run, so a result (and a
    failure) reproduces. Unseeded, fp32 comparisons against ORT at tolerances near the rounding
    of their sums failed an occasional CI run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
