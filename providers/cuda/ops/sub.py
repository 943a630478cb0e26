"""Sub (ONNX, default domain): numpy broadcasting, on the device (CuPy ufunc with out=)
or on the host when both operands are host values (cpu_reference). Source: ONNX Sub-14."""

from providers.cuda.ops import _binary

OP_TYPE = "Sub"
DOMAIN = ""


def run(ctx, a, b):
    import cupy

    return _binary.run(ctx, cupy.subtract, "sub", a, b)
