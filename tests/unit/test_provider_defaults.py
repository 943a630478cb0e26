"""Optional provider members have documented defaults (core.provider.OPTIONAL_DEFAULTS), so the
core calls them without probing; ProviderBase answers supports/kernel/prepare from its op table."""

import numpy as np
import pytest

from core.ops import OpTable
from core.protocol import NodeInfo
from core.provider import OPTIONAL_DEFAULTS, ProviderBase, with_defaults
from providers.cpu_reference import ops
from providers.cpu_reference.provider import CpuReferenceProvider

ADD = NodeInfo(name="add", op_type="Add", domain="", attrs={}, inputs=("a", "b"), outputs=("c",),
               input_dtypes=(np.dtype(np.float32), np.dtype(np.float32)))


class Bare:
    """A provider object that does not inherit ProviderBase and has no optional member."""

    name = "bare"

    def download(self, tensor):
        return np.array(tensor, copy=True)


def test_a_provider_without_the_base_gets_every_optional_default():
    p = with_defaults(Bare())
    for name in OPTIONAL_DEFAULTS:
        assert callable(getattr(p, name))
    assert p.support_reason(ADD) is None and p.prepare(ADD) is None
    assert p.peak_bytes() is None and p.reset_peak() is None and p.node_timer() is None
    assert p.free_device_bytes() is None and p.workspace_bytes() is None and p.settings() == {}
    t = np.arange(3)
    handle = p.download_async(t)
    t[0] = 9  # the default handle downloaded when called
    assert handle.wait().tolist() == [0, 1, 2]


def test_the_base_class_has_every_optional_member_so_nothing_is_added():
    p = CpuReferenceProvider()
    before = dict(vars(p))
    assert with_defaults(p) is p and vars(p) == before
    assert all(hasattr(ProviderBase, name) for name in OPTIONAL_DEFAULTS)


def test_an_object_that_takes_no_attributes_is_named():
    class Slotted:
        __slots__ = ()
        name = "slotted"

    with pytest.raises(TypeError, match="inherit core.provider.ProviderBase"):
        with_defaults(Slotted())


def test_the_base_answers_from_its_op_table():
    table = OpTable(ops)
    p = ProviderBase(table)
    assert p.ops is table and p.supports(ADD) and p.kernel(ADD) is table.kernel(ADD)
    assert p.support_reason(ADD) is None and p.prepare(ADD) is table.prepare(ADD)


def test_a_base_without_an_op_table_must_implement_supports_and_kernel():
    p = ProviderBase()
    assert p.support_reason(ADD) is None and p.prepare(ADD) is None
    with pytest.raises(NotImplementedError, match="no op table"):
        p.supports(ADD)
    with pytest.raises(NotImplementedError, match="no op table"):
        p.kernel(ADD)
