"""The parity kit's op, device_argmax and decode_advance cases on the cuda provider (GPU only).

One source of cases for every provider: core/testing/op_cases.py (OP_CASES, ARGMAX_CASES),
run by core/testing/suite.py against cpu_reference on fresh random inputs with poisoned
outputs, plus the bitwise properties the cases ask for (each row alone equals its row of the
batch for M = 1..256; a fused op equals its unfused chain). A case the cuda provider's support
check rejects is skipped with that reason; anything else that goes wrong fails.

    pytest -m cuda tests/cuda/test_ops.py          # these cases (LOCKSTEP_KIT_SEED=N to repeat)
    pytest --lockstep-provider cuda                # the whole kit, decode gates included
"""

import os

import pytest
from _gpu import require_gpu

require_gpu()

from core.testing.suite import test_decode_advance, test_device_argmax, test_op  # noqa: E402, F401
from core.testing.target import KitTarget  # noqa: E402

SEED = int(os.environ.get("LOCKSTEP_KIT_SEED", int.from_bytes(os.urandom(4), "little")))


@pytest.fixture(scope="session")
def lockstep_target(gpu) -> KitTarget:
    """The kit target of the session's cuda provider (failure messages carry the seed)."""
    return KitTarget(gpu, seed=SEED)


@pytest.mark.parametrize("case_id,path", [("ReduceSumSubCast/mask-w64-keep1", "kernel"),
                                          ("ReduceSumSubCast/mask-w64-keep1-int32", "cupy")])
def test_reduce_sum_sub_cast_paths_match_the_reference(lockstep_target, case_id, path):
    """lockstep.ReduceSumSubCast has two launch paths on cuda: the rowsum_sub_i32 kernel for the
    builder's int64 mask, CuPy expressions for anything else (an int32 mask here). Each matches
    cpu_reference exactly (and its unfused chain bitwise), and each case took the path named."""
    from core.testing.kit import run_op_case
    from core.testing.op_cases import OP_CASES
    from providers.cuda.ops import reduce_sum_sub_cast

    case = next(c for c in OP_CASES if c.id == case_id)
    before = reduce_sum_sub_cast.stats()[path]
    result = run_op_case(case, "int32", lockstep_target.provider(), lockstep_target.reference(),
                         lockstep_target.rng(case_id))
    assert result.passed, result.detail
    assert reduce_sum_sub_cast.stats()[path] > before
