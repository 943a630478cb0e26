"""The parity kit's suite, collected here for every provider of the conftest's lockstep_target."""

from core.testing.suite import test_decode_advance, test_device_argmax, test_download_async, test_gate, test_op  # noqa: F401,E501
