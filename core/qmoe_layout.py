"""The two layouts of QMoE expert codes the ONNX Runtime GenAI builder writes, and the repack
between them (docs/moe.md, "The int4 CUDA build").

- **raw** (the CPU build): per expert ``[N, K*bits/8]`` uint8, codes least-significant bits
  first along K (MatMulNBits' layout), what cpu_reference and cuda's kernels read.
- **cutlass** (the CUDA build: the builder prepacks for ONNX Runtime's CUDA fpA_intB mixed
  GEMM, ``CudaQuantizer.qmoe_prepacked_blockwise_quantize``, SM80 layout): per expert
  ``[K, N*bits/8]``: the ``[N, K]`` code matrix transposed to ``[K, N]``, its rows permuted in
  groups of ``128 / bits`` (the mma B-operand order), each row's codes transposed sub-byte-wise,
  64-row tiles of ``16 / bits`` columns interleaved (SM80 only), and the codes of each group of
  4 bytes (8 bits), 8 nibbles (4 bits) or 16 fields (2 bits) reordered. The packer stores each
  code signed and adds ``2^(bits-1)`` back at the end, so every code keeps its value: the
  transform is a permutation of code positions, and the scales ``[E, N, K/block_size]`` and any
  zero points are the raw layout's.

The builder writes the cutlass layout without a ``weights_prepacked`` attribute; a node is
read as cutlass when ``weights_prepacked=1`` or when its fc1 (else fc2) codes have the cutlass
shape and not the raw one for the scales' ``[N, K/block_size]`` (:func:`node_layout`); a node
whose every projection is square (N == K: both shapes fit) is read raw, as ONNX Runtime does
without the attribute.
Source: onnxruntime_genai/models/quantization/cuda_quantizer.py (0.18,
``_preprocess_weights_for_mixed_gemm_torch``, a port of ORT's
``preprocess_weights_for_mixed_gemm``; ORT PR 28749 describes the steps).
"""

from __future__ import annotations

import functools

import numpy as np

RAW, CUTLASS = "raw", "cutlass"
#: the builder's QMoE packer targets SM80 (force_arch=80); 90 skips the column interleave.
ARCHES = (80, 90)
#: bits -> the row order inside a group of 128 / bits rows (permute_B_rows_for_mixed_gemm, 16-bit activations).
_ROWS = {
    8: (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15),
    4: (0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27, 4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15, 22, 23,
        30, 31),
    2: tuple(r + c for r in (0, 2, 4, 6) for c in (0, 1, 8, 9, 16, 17, 24, 25, 32, 33, 40, 41, 48, 49, 56, 57)),
}
#: bits -> the code order inside a group (add_bias_and_interleave_quantized_tensor_inplace).
_GROUPS = {8: (0, 2, 1, 3), 4: (0, 2, 4, 6, 1, 3, 5, 7), 2: (*range(0, 16, 2), *range(1, 16, 2))}


@functools.lru_cache(maxsize=64)
def permutation(n: int, k: int, bits: int, arch: int = 80) -> np.ndarray:
    """int64 [N*K]: code j of the cutlass layout (LSB-first within its byte, bytes in order) is
    code ``perm[j]`` of the raw layout (raw code index ``row * K + col``).

    Raises:
        ValueError: bits not 2, 4 or 8, an unknown arch, or N, K the packer refuses (K a
            multiple of 128 / bits, N of 8 * 8 / bits; SM80: K a multiple of 64).
    """
    if bits not in _ROWS or arch not in ARCHES:
        raise ValueError(f"QMoE cutlass layout: bits={bits} (2, 4 or 8), arch={arch} (80 or 90)")
    pack, group = 8 // bits, 128 // bits
    if k % group or n % (8 * pack):
        raise ValueError(f"QMoE cutlass layout: K={k} must be a multiple of {group} and N={n} of {8 * pack}")
    a = np.arange(n * k, dtype=np.int64).reshape(n, k).T  # [K, N]: the transposed codes
    rows = np.arange(k)
    a = a[(rows // group) * group + np.asarray(_ROWS[bits])[rows % group]]
    codes = a.T.reshape(-1)  # sub-byte transpose: the flat order of N rows of K codes
    interleave = 16 // bits
    if arch < 90:
        if k % 64:
            raise ValueError(f"QMoE cutlass layout: K={k} must be a multiple of 64 (column-interleave tiles)")
        per_tile = 64 * 4 // (32 // bits)  # bytes of one tile's row group
        byts = codes.reshape(-1, interleave, k // 64, per_tile, pack)
        codes = byts.transpose(0, 2, 1, 3, 4).reshape(-1)
    order = np.asarray(_GROUPS[bits])
    return np.ascontiguousarray(codes.reshape(-1, order.size)[:, order].reshape(-1))


def _unpack(w: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [..., B] -> codes [..., B * 8 / bits], LSB first."""
    if bits == 8:
        return w
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    return ((w[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*w.shape[:-1], -1).astype(np.uint8)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [..., C] -> uint8 [..., C * bits / 8], LSB first."""
    if bits == 8:
        return codes.astype(np.uint8)
    fields = codes.reshape(*codes.shape[:-1], -1, 8 // bits).astype(np.uint8)
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    return np.bitwise_or.reduce(fields << shifts, axis=-1).astype(np.uint8)


def to_cutlass(raw: np.ndarray, bits: int, arch: int = 80) -> np.ndarray:
    """Raw codes uint8 [E, N, K*bits/8] -> the cutlass layout uint8 [E, K, N*bits/8]."""
    e, n, kb = raw.shape
    k = kb * 8 // bits
    codes = _unpack(np.asarray(raw, np.uint8), bits).reshape(e, n * k)
    return _pack(codes[:, permutation(n, k, bits, arch)], bits).reshape(e, k, n * bits // 8)


def to_raw(packed: np.ndarray, bits: int, arch: int = 80) -> np.ndarray:
    """Cutlass codes uint8 [E, K, N*bits/8] -> the raw layout uint8 [E, N, K*bits/8]."""
    e, k, nb = packed.shape
    n = nb * 8 // bits
    codes = _unpack(np.asarray(packed, np.uint8), bits).reshape(e, n * k)
    raw = np.empty_like(codes)
    raw[:, permutation(n, k, bits, arch)] = codes
    return _pack(raw.reshape(e, n, k), bits)


def layouts_of(w_shape: tuple, scales_shape: tuple, bits: int, block: int) -> set[str]:
    """The layouts codes of ``w_shape`` [E, ., .] can be in for scales [E, N, K/block] (or
    [E, N] without a block): {RAW}, {CUTLASS}, both (a square N == K) or none."""
    if len(w_shape) != 3 or len(scales_shape) < 2:
        return set()
    n = int(scales_shape[1])
    cols = int(np.prod(scales_shape[2:], dtype=np.int64)) if len(scales_shape) > 2 else None

    def fits(rows: int, inner: int) -> bool:  # rows outputs of inner inputs
        return rows == n and (not block or cols is None or -(-inner // block) == cols)

    found = set()
    if fits(int(w_shape[1]), int(w_shape[2]) * 8 // bits):
        found.add(RAW)
    if fits(int(w_shape[2]) * 8 // bits, int(w_shape[1])):
        found.add(CUTLASS)
    return found


def node_layout(attrs: dict, projections) -> str:
    """RAW or CUTLASS for a QMoE node: ``weights_prepacked`` when 0 or 1, else the layout the
    shapes of its ``projections`` [(codes shape, scales shape, bits)] (fc1 first) single out;
    RAW (ONNX Runtime's reading without the attribute) when every projection is square.

    Raises:
        ValueError: a projection whose shapes fit neither layout.
    """
    prepacked = int(attrs.get("weights_prepacked", -1))
    if prepacked in (0, 1):
        return CUTLASS if prepacked else RAW
    block = int(attrs.get("block_size", 0))
    for w_shape, s_shape, bits in projections:
        found = layouts_of(tuple(w_shape), tuple(s_shape), bits, block)
        if not found:
            raise ValueError(f"QMoE: expert codes {tuple(w_shape)} fit neither the raw [E, N, K*{bits}/8] nor "
                             f"ONNX Runtime's CUDA [E, K, N*{bits}/8] layout for scales {tuple(s_shape)}")
        if len(found) == 1:
            return found.pop()
    return RAW


def projection_bits(attrs: dict) -> tuple[int, int, int]:
    """(fc1, fc2, fc3) bit widths of a QMoE node (expert_weight_bits, default 4; fc3 as fc1)."""
    bits = int(attrs.get("expert_weight_bits", 4))
    b1 = int(attrs.get("fc1_expert_weight_bits", bits))
    return b1, int(attrs.get("fc2_expert_weight_bits", bits)), int(attrs.get("fc3_expert_weight_bits", b1))


def as_raw(attrs: dict, fc1, s1, fc2, s2, fc3=None, s3=None, arch: int = 80) -> tuple | None:
    """The expert codes (fc1, fc2, fc3) of a QMoE node in the raw layout (host uint8 arrays;
    fc3 None when absent), or None when the node's codes are raw already (:func:`node_layout`)
    or a scale is missing (nothing to read the layout from).

    Raises:
        ValueError: codes that fit neither layout, or sizes the cutlass layout cannot have.
    """
    if any(a is None for a in (fc1, s1, fc2, s2)):
        return None
    b1, b2, b3 = projection_bits(attrs)
    parts = [(fc1, s1, b1), (fc2, s2, b2)] + ([(fc3, s3, b3)] if fc3 is not None and s3 is not None else [])
    if node_layout(attrs, [(np.shape(w), np.shape(s), b) for w, s, b in parts]) == RAW:
        return None
    raw = [to_raw(np.asarray(w), b, arch) for w, _, b in parts]
    return raw[0], raw[1], raw[2] if len(raw) > 2 else None
