"""The cpu_reference execution provider (NumPy)."""

from __future__ import annotations

from typing import Any

import numpy as np

from core.generation.sampling import sample_rows
from core.ops import OpTable
from core.protocol import Capabilities, NodeInfo
from core.provider import ProviderBase
from core.runtime import rowblocks
from providers.cpu_reference import ops
from providers.cpu_reference.argmax import argmax_rows


class CpuReferenceProvider(ProviderBase):
    """NumPy kernels, fp32 math (fp16 models are computed in fp32 and rounded at op outputs).

    No graph capture, no VMM: ``kv_commit`` only counts bytes. "Device" tensors are numpy
    arrays, so uploads and downloads are host copies (still counted, so the weight-upload and
    streaming counters mean the same on every provider).
    """

    name = "cpu_reference"

    def __init__(self):
        super().__init__(OpTable(ops))
        #: The MoE nodes' expert residency (providers.cpu_reference.expert_pager); None: every
        #: expert resident.
        self.expert_residency: Any = None

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float32", "float16"), weight_streaming=True)

    def row_blocks(self, node: NodeInfo, shape_of):
        """The raw ONNX row split (:func:`core.runtime.rowblocks.onnx_rows`): the kernels' products
        run in column chunks of ``ROW_ALIGN`` rows (``ops.rowwise_matmul``), so a block's
        elements are bitwise the whole node's."""
        return rowblocks.onnx_rows(node, shape_of)

    def node_timer(self):
        """The host clock (:class:`core.kernel_profile.HostNodeTimer`): the NumPy kernels have
        finished when they return, so a node's time is the time between its marks."""
        from core.kernel_profile import HostNodeTimer

        return HostNodeTimer()

    def _allocate(self, shape, dtype, zero) -> np.ndarray:
        return np.zeros(shape, dtype) if zero else np.empty(shape, dtype)

    def _upload(self, array: np.ndarray) -> np.ndarray:
        return array  # contiguous already (ProviderBase.upload); the device is the host

    def _download(self, tensor: Any) -> np.ndarray:
        return np.array(tensor, copy=True)

    def _write(self, tensor, host) -> None:
        tensor[...] = host

    def device_sample(self, logits, positions, counter, fed, sampling, result) -> None:
        """The reference sampler (:func:`core.generation.sampling.sample_rows`) on the arrays."""
        rows = logits[np.arange(logits.shape[0]), np.asarray(positions, dtype=np.int64)]
        if fed is not None:
            sampling.history[np.arange(logits.shape[0]), np.asarray(fed)[:, 0]] = 1
        result[...] = sample_rows(rows, sampling.params, sampling.options, counter, sampling.history)

    def device_argmax(self, logits: np.ndarray, positions: np.ndarray, result: np.ndarray) -> None:
        rows = logits[np.arange(logits.shape[0]), np.asarray(positions, dtype=np.int64)]
        result[...] = argmax_rows(rows)
