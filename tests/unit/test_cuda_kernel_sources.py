"""Source-level rules of the cuda provider's kernels, checked without a GPU.

Every kernel is launched with programmatic dependent launch (kernels/pdl.cuh), so a kernel
that does not call PDL_ENTER() could run while its predecessor is still writing its inputs.
Code before PDL_ENTER() may only load what no kernel of the step writes, or a guess it checks
after the wait (kernels/pdl.cuh): no store, no early return.
"""

import re
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "providers" / "cuda" / "kernels"


def _kernel_bodies():
    for path in sorted(KERNELS.glob("*.cu")):
        text = re.sub(r"__launch_bounds__\s*\([^)]*\)", "", path.read_text())
        for m in re.finditer(r"__global__[^;{(]*?(\w+)\s*\(", text):
            head_end = text.find("{", m.end())
            if text.find(";", m.end()) < head_end:
                continue  # an explicit instantiation, not a definition
            depth, i = 1, head_end + 1
            while depth:
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                i += 1
            yield f"{path.name}:{m.group(1)}", text[head_end + 1:i - 1]


BODIES = dict(_kernel_bodies())


def test_the_kernels_are_found():
    assert len(BODIES) >= 20 and "linear_mma.cu:mma_dense" in BODIES


@pytest.mark.parametrize("name", sorted(BODIES))
def test_every_kernel_enters_pdl_before_any_store_or_return(name):
    body = BODIES[name]
    assert body.count("PDL_ENTER()") == 1, f"{name} must call PDL_ENTER() exactly once"
    before = body[:body.index("PDL_ENTER()")]
    assert "return" not in before, f"{name} returns before PDL_ENTER()"
    # a store before the wait: an assignment through a pointer or into a non-local array
    assert not re.search(r"\b(atomic\w*|__stcg|__threadfence)\b", before), f"{name} writes before PDL_ENTER()"
    assert "__syncthreads" not in before, f"{name} synchronises before PDL_ENTER()"


def test_the_pdl_macros_come_before_the_kernel_file():
    from providers.cuda import module

    source = module.source("linear_mma")
    assert source.startswith("// Programmatic dependent launch")
    assert source.index("#define PDL_ENTER()") < source.index("__global__")
