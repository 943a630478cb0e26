"""The cpu_reference execution provider (NumPy)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from core.executor import PlanBinding
from core.ops import OpTable
from core.protocol import Capabilities, KVRequest, NodeInfo
from providers.cpu_reference import ops
from providers.cpu_reference.argmax import argmax_rows


class CpuReferenceProvider:
    """NumPy kernels, fp32 math (fp16 models are computed in fp32 and rounded at op outputs).

    No graph capture, no VMM: ``kv_commit`` only counts bytes.
    """

    name = "cpu_reference"

    def __init__(self):
        self._ops = OpTable(ops)
        self.committed_bytes = 0

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float32", "float16"))

    def supports(self, node: NodeInfo) -> bool:
        return self._ops.supports(node)

    def kernel(self, node: NodeInfo):
        return self._ops.kernel(node)

    def allocate(self, shape: Sequence[int], dtype: Any, zero: bool = False) -> np.ndarray:
        return np.zeros(shape, dtype) if zero else np.empty(shape, dtype)

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array)

    def download(self, tensor: Any) -> np.ndarray:
        return np.array(tensor, copy=True)

    def io_binding(self, plan) -> PlanBinding:
        return PlanBinding(plan)

    def device_argmax(self, logits: np.ndarray, positions: np.ndarray, result: np.ndarray) -> None:
        rows = logits[np.arange(logits.shape[0]), np.asarray(positions, dtype=np.int64)]
        result[...] = argmax_rows(rows)

    def decode_advance(self, result, input_ids, attention_mask, lengths) -> None:
        flagged = result[:, 1] != 0
        input_ids[:, 0] = np.where(flagged, 0, result[:, 0])
        attention_mask[np.arange(len(lengths)), lengths] = 1
        lengths += 1

    def kv_commit(self, arena: Any, requests: Sequence[KVRequest]) -> int:
        added = sum(r.nbytes for r in requests)
        self.committed_bytes += added
        return added

    def synchronize(self) -> None:
        pass
