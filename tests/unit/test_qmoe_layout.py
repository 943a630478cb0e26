"""core.qmoe_layout: the builder's CUDA QMoE layout (CUTLASS fpA_intB, SM80) and the raw one.

The repack round trip is the identity both ways, for 2, 4 and 8 bits; the cutlass side is
byte-for-byte what the builder's own packer writes (onnxruntime_genai's
``_pack_weights_for_cuda_mixed_gemm``, when installed); a node's layout is read from
``weights_prepacked`` or the codes' shapes against the scales', and a node whose shapes cannot
tell is refused with a named error.
"""

from __future__ import annotations

import numpy as np
import pytest

from core import qmoe_layout
from core.qmoe_layout import CUTLASS, RAW

SHAPES = [(128, 64, 4), (64, 128, 4), (64, 64, 4), (256, 192, 4), (64, 128, 8), (128, 64, 2), (64, 256, 2)]


def _raw(rng, e, n, k, bits):
    return rng.integers(0, 256, (e, n, k * bits // 8), dtype=np.uint8)


@pytest.mark.parametrize("arch", qmoe_layout.ARCHES)
@pytest.mark.parametrize("n,k,bits", SHAPES)
def test_the_repack_round_trip_is_the_identity(n, k, bits, arch):
    rng = np.random.default_rng(n * k + bits)
    raw = _raw(rng, 3, n, k, bits)
    packed = qmoe_layout.to_cutlass(raw, bits, arch)
    assert packed.shape == (3, k, n * bits // 8) and packed.dtype == np.uint8
    np.testing.assert_array_equal(qmoe_layout.to_raw(packed, bits, arch), raw)
    np.testing.assert_array_equal(qmoe_layout.to_cutlass(qmoe_layout.to_raw(packed, bits, arch), bits, arch), packed)
    perm = qmoe_layout.permutation(n, k, bits, arch)
    assert np.array_equal(np.sort(perm), np.arange(n * k)), "a permutation of code positions"


@pytest.mark.parametrize("arch", qmoe_layout.ARCHES)
@pytest.mark.parametrize("n,k,bits", SHAPES)
def test_the_cutlass_side_is_the_builders_packer(n, k, bits, arch):
    pytest.importorskip("torch")
    quantizer = pytest.importorskip("onnxruntime_genai.models.quantization.cuda_quantizer")
    if bits == 2 and arch == 90:
        pytest.skip("the builder packs 2 bits for SM80 only")
    rng = np.random.default_rng(7 + bits)
    raw = _raw(rng, 2, n, k, bits)
    for e in range(2):
        want = quantizer._pack_weights_for_cuda_mixed_gemm(raw[e], n, k, bits, arch)
        got = qmoe_layout.to_cutlass(raw[e:e + 1], bits, arch)
        np.testing.assert_array_equal(got.reshape(-1), np.asarray(want).view(np.uint8))


def test_the_packer_refuses_what_the_builder_refuses():
    with pytest.raises(ValueError, match="multiple of 64"):
        qmoe_layout.permutation(64, 32, 4)  # K = 32: the tiny LFM2-MoE's down projection
    with pytest.raises(ValueError, match="bits=3"):
        qmoe_layout.permutation(64, 64, 3)


@pytest.mark.parametrize("attrs,projections,layout", [
    ({"weights_prepacked": 1}, [], CUTLASS),
    ({"weights_prepacked": 0}, [], RAW),
    ({"block_size": 32}, [((8, 128, 32), (8, 128, 2), 4)], RAW),            # fc1 raw [E, 2I, H/2]
    ({"block_size": 32}, [((8, 64, 64), (8, 128, 2), 4)], CUTLASS),         # fc1 cutlass [E, H, 2I/2]
    # a square fc1 (2I == H) cannot tell; fc2 [E, H, I] can
    ({"block_size": 32}, [((8, 64, 32), (8, 64, 2), 4), ((8, 32, 32), (8, 64, 1), 4)], CUTLASS),
])
def test_a_nodes_layout_comes_from_the_attribute_or_the_shapes(attrs, projections, layout):
    assert qmoe_layout.node_layout(attrs, projections) == layout


def test_square_projections_read_raw_and_shapes_that_fit_neither_are_refused():
    square = ((8, 64, 32), (8, 64, 2), 4)
    assert qmoe_layout.node_layout({"block_size": 32}, [square, square]) == RAW
    assert qmoe_layout.node_layout({}, [((8, 64, 32), (8, 64), 4)]) == RAW  # one scale per row, square
    assert qmoe_layout.node_layout({}, [((8, 64, 16), (8, 32), 4)]) == CUTLASS  # one scale per row: N = 32 outputs
    with pytest.raises(ValueError, match="fit neither"):
        qmoe_layout.node_layout({"block_size": 32}, [((8, 60, 30), (8, 64, 2), 4)])
