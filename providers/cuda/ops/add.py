"""Add (ONNX, default domain): numpy broadcasting, on the device (kernels/elementwise.cu
or a CuPy ufunc with out=); two host operands run on the host (core.executor). Source: ONNX Add-14."""

from providers.cuda.ops import _binary

OP_TYPE = "Add"
DOMAIN = ""


def run(ctx, a, b):
    import cupy

    return _binary.run(ctx, cupy.add, "add", a, b)
