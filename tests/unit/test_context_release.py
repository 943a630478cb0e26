"""KernelContext.release / Plan.release_buffers: a sweep frees the last point's activations,
never a buffer a captured graph holds."""

import numpy as np

from core.protocol import KernelContext, NodeInfo
from providers.cpu_reference.provider import CpuReferenceProvider


def _ctx():
    node = NodeInfo(name="n", op_type="Add", domain="", inputs=("a", "b"), outputs=("y",), attrs={},
                    input_dtypes=(np.dtype(np.float32),) * 2)
    return KernelContext(node, CpuReferenceProvider(), "head_major")


def test_release_drops_unpinned_buffers_and_keeps_what_a_capture_pinned():
    ctx = _ctx()
    pinned = ctx.output(0, (1, 8), np.float32)  # the warm-up step allocates it ...
    ctx.frozen = True
    assert ctx.output(0, (1, 8), np.float32) is pinned  # ... and the capture pins it
    ctx.frozen = False
    eager = ctx.output(0, (4, 8), np.float32)  # a prefill shape, never captured
    assert ctx.release() == eager.nbytes
    assert ctx.output(0, (1, 8), np.float32) is pinned  # still the graph's buffer
    again = ctx.output(0, (4, 8), np.float32)
    assert again is not eager and ctx.allocations == 3  # (1, 8), (4, 8), (4, 8) again
