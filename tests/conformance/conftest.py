"""The parity kit run by Lockstep's own tests: cpu_reference against itself (must pass) and the
example plugin lockstep-numpy64 when it is installed
(``pip install --no-deps --no-build-isolation -e examples/lockstep-numpy64``)."""

from __future__ import annotations

import os

import pytest

from core.plugins import registry
from core.testing.target import KitTarget, Rule

SEED = int(os.environ.get("LOCKSTEP_KIT_SEED", int.from_bytes(os.urandom(4), "little")))
NUMPY64 = "numpy64" in registry().names()
#: Known departures of the example plugin from the kit's properties, each skipped with its reason.
#: None today (numpy64 declines the fused gated projections: the kit skips their cases with its
#: support_reason, and the core leaves those chains unfused for it).
NUMPY64_RULES: list[Rule] = []


def pytest_report_header(config):
    return [f"lockstep conformance: seed {SEED} (LOCKSTEP_KIT_SEED={SEED} to repeat)"]


@pytest.fixture(scope="session", params=[
    "cpu_reference",
    pytest.param("numpy64", marks=pytest.mark.skipif(
        not NUMPY64, reason="example plugin not installed: pip install --no-deps --no-build-isolation "
                            "-e examples/lockstep-numpy64")),
])
def lockstep_target(request) -> KitTarget:
    """The kit target of one provider; the decode gates run on the tiny model (batches 1, 2, 4)."""
    rules = list(NUMPY64_RULES) if request.param == "numpy64" else []
    return KitTarget(request.param, batches=(1, 2, 4), steps=40, seed=SEED, rules=rules)
