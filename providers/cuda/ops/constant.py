"""Constant (ONNX): a host value (cpu_reference). ONNX Constant-21."""

from providers.cpu_reference.ops import constant as _ref

OP_TYPE = "Constant"
DOMAIN = ""
supports = _ref.supports
run = _ref.run
