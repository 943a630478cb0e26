"""Host packing of fp16 tensor-core weights (providers/cuda/ops/_mma_layout.pack_into): the
host path (one gather per 64-row chunk of K over a fixed index, the chunks over threads) gives
bitwise the strided transpose the device runs, for aligned and padded shapes, a gate/up pair,
one thread or several, and writes into a buffer it is given (pinned memory for a streamed
weight: the packed form is written once)."""

import types

import numpy as np
import pytest

from providers.cuda.ops import _mma_layout as layout

#: The array-module path of the device (one strided copy per input), run with NumPy.
DEVICE = types.SimpleNamespace(empty=np.empty, zeros=np.zeros, float16=np.float16)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("k, n", [(64, 16), (100, 24), (130, 40), (1, 1), (256, 48), (512, 8)])
def test_host_packing_is_bitwise_the_device_transpose(monkeypatch, threads, k, n):
    monkeypatch.setattr(layout.os, "cpu_count", lambda: threads)
    rng = np.random.default_rng(k * 1000 + n)
    w, up = (rng.standard_normal((k, n)).astype(np.float16) for _ in range(2))
    for pair in (None, up):
        want = layout.pack(DEVICE, w, pair)
        got = layout.pack(np, w, pair)
        assert got.shape == want.shape == (layout.packed_size(k, n, pair is not None),)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_pack_into_writes_the_given_buffer_from_a_memory_map(tmp_path):
    k, n = 192, 64
    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float16)
    w.tofile(tmp_path / "w.bin")
    mapped = np.memmap(tmp_path / "w.bin", np.float16, "r", shape=(k, n))
    out = np.full(layout.packed_size(k, n), np.nan, np.float16)
    layout.pack_into(np, mapped, None, out)
    assert np.array_equal(out.view(np.uint16), layout.pack(DEVICE, w).view(np.uint16))
