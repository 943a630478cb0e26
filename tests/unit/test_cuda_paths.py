"""The cuda provider's path counters are one object (providers/cuda/paths.py): each launcher
module declares its group, counts through it, and its stats() reads it (no GPU needed)."""

import pytest

from providers.cuda.paths import PATHS, PathCounters


def test_declared_paths_count_and_a_misspelt_one_is_named():
    paths = PathCounters()
    paths.declare("g", ("a", "b"))
    paths.add("g", "a")
    paths.add("g", "b", 3)
    assert paths.stats("g") == {"a": 1, "b": 3} and paths.all() == {"g": {"a": 1, "b": 3}}
    paths.declare("g", ("a", "c"))  # declared again: counts kept
    assert paths.stats("g") == {"a": 1, "b": 3, "c": 0}
    with pytest.raises(KeyError, match="g.d was never declared"):
        paths.add("g", "d")


def test_every_launcher_module_counts_in_the_one_object():
    from providers.cuda import replay
    from providers.cuda.ops import _mma, _norm, group_query_attention, reduce_sum_sub_cast

    groups = PATHS.all()
    for group, module in (("replay", replay), ("gqa", group_query_attention), ("mma", _mma), ("norm", _norm),
                          ("reduce_sum_sub_cast", reduce_sum_sub_cast)):
        assert module.stats() == groups[group], group
        assert not hasattr(module, "_counts") and not hasattr(module, "counts")
