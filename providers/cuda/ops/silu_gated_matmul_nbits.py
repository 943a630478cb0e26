"""SiluGatedMatMulNBits (domain "lockstep", core.fusion): Y = SiluMul(MatMulNBits(X, gate),
MatMulNBits(X, up)) with the MatMulNBits attributes shared by both projections (OPS.md 2).

Inputs: X, B_gate, scales_gate, zero_points_gate (or absent), B_up, scales_up, zero_points_up
(graph constants of equal shapes and dtypes). Where MatMulNBits would use the tensor-core
int4 kernel: ONE launch over the gate and up rows interleaved in groups of 8 features
(``_mma.glu_rows``; codes, scales and zero points copied once per node) with the SiluMul in
its epilogue, bitwise the unfused MatMulNBits, MatMulNBits, SiluMul of this provider.
Otherwise those three kernels run in turn.
"""

from providers.cpu_reference.ops._gated import gate_view
from providers.cuda.module import ctype
from providers.cuda.ops import NULL, _mma, matmul_nbits, silu_mul

OP_TYPE = "SiluGatedMatMulNBits"
DOMAIN = "lockstep"


def supports(node) -> bool:
    """The configurations MatMulNBits accepts (both projections share the attributes)."""
    return len(node.inputs) == 7 and matmul_nbits.supports(gate_view(node))


def _interleaved(ctx, n: int, pairs):
    """The (gate, up) arrays of ``pairs`` as one array each, rows in glu_rows order, cached per
    node by device pointers (the inputs are weights)."""
    import cupy

    key = tuple(None if g is None else (g.data.ptr, u.data.ptr, g.shape) for g, u in pairs)
    hit = ctx.cache.get("glu_rows")
    if hit is not None and hit[0] == key:
        return hit[1]
    out = [None if g is None else _mma.glu_interleave(cupy, g.reshape(n, -1), u.reshape(n, -1))
           for g, u in pairs]
    ctx.cache["glu_rows"] = (key, out)
    return out


def run(ctx, x, b_gate, scales_gate, zp_gate, b_up, scales_up, zp_up):
    attrs = ctx.node.attrs
    k, n, bits, bs, nb = matmul_nbits.geometry(attrs, x, b_gate, scales_gate)
    if (b_gate.shape != b_up.shape or scales_gate.shape != scales_up.shape or scales_gate.dtype != scales_up.dtype
            or (zp_gate is None) != (zp_up is None)
            or (zp_gate is not None and (zp_gate.shape != zp_up.shape or zp_gate.dtype != zp_up.dtype))):
        raise ValueError("SiluGatedMatMulNBits: the gate and up weights differ in shape or dtype")
    _, zp_mode, zp_stride = matmul_nbits.zero_point_mode(zp_gate, x.dtype, n, nb)
    y = ctx.output(0, (*x.shape[:-1], n), x.dtype)
    m = x.size // k
    if m == 0:
        return (y,)
    if matmul_nbits.uses_mma(x, bits, k, zp_mode, zp_gate):
        b, s, z = _interleaved(ctx, n, ((b_gate, b_up), (scales_gate, scales_up),
                                        (None, None) if zp_gate is None else (zp_gate, zp_up)))
        _mma.nbits4(x, b, s, NULL if z is None else z, zp_mode, zp_stride, None, y, m, _mma.glu_width(n), k, bs,
                    ctype(s.dtype), NULL, glu_out=n)
        return (y,)
    gate, up = ctx.output("gate", y.shape, x.dtype), ctx.output("up", y.shape, x.dtype)
    matmul_nbits.launch(attrs, x, b_gate, scales_gate, zp_gate, None, gate)
    matmul_nbits.launch(attrs, x, b_up, scales_up, zp_up, None, up)
    silu_mul.launch(gate, up, y)
    return (y,)
