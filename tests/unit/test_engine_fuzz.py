"""Solo equivalence of the engine on cpu_reference: random arrivals, each request equal to its solo run.

The control test switches on a batch-dependent reduction (every logits row gets the batch
mean added at batch > 1), which a batch-1 solo run never sees: the same fuzzer must then
report mismatches, so the fuzzer can fail.
"""

from __future__ import annotations

import pytest

from core.runtime.runner import Runner
from core.testing.arrivals import fuzz_arrivals
from core.testing.tiny_model import make_tiny_model, write_byte_tokenizer
from providers.cpu_reference.provider import CpuReferenceProvider


class BatchDependentProvider(CpuReferenceProvider):
    """cpu_reference with a deliberately batch-dependent reduction on the logits (the control)."""

    def __init__(self):
        super().__init__()
        self.mixed_steps = 0

    def kernel(self, node):
        base = super().kernel(node)
        if "logits" not in node.outputs:
            return base

        def mixed(ctx, *inputs):
            outs = base(ctx, *inputs)
            y = outs[node.outputs.index("logits")]
            if y.shape[0] > 1:  # a reduction across the rows: row b's logits depend on its neighbours
                y += y.mean(axis=0, keepdims=True)
                self.mixed_steps += 1
            return outs
        return mixed


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_byte_tokenizer(make_tiny_model(tmp_path_factory.mktemp("fuzz")))


def test_every_request_equals_its_solo_run(folder):
    report = fuzz_arrivals(Runner(folder, "cpu_reference"), seed=40, requests=300, max_batch=8, capacity=48)
    assert report.mismatches == []
    # the fuzz covered what it claims: several buckets, full batches, aborts, sampling, stop rules
    assert report.requests == 300 and report.max_running == 8
    assert {2, 4, 8} <= report.buckets
    assert report.aborted >= 10 and report.sampled >= 100 and report.stopped >= 5
    assert report.rows_moved > 0  # rows were moved down into freed slots (compaction) and stayed right


@pytest.mark.parametrize("run_ahead", [True, False])
def test_small_buckets_and_sparse_arrivals(folder, run_ahead):
    report = fuzz_arrivals(Runner(folder, "cpu_reference"), seed=7, requests=40, max_batch=4, capacity=32,
                           arrival_span=400, run_ahead=run_ahead)
    assert report.mismatches == []
    assert 1 in report.buckets and 2 in report.buckets


@pytest.mark.parametrize("run_ahead", [True, False])
def test_compaction_moves_rows_and_keeps_them_right(folder, run_ahead):
    # rows end in random order, so rows left in high slots get moved down; equal either way
    moved = fuzz_arrivals(Runner(folder, "cpu_reference"), seed=11, requests=80, max_batch=8, capacity=48,
                          run_ahead=run_ahead)
    still = fuzz_arrivals(Runner(folder, "cpu_reference"), seed=11, requests=80, max_batch=8, capacity=48,
                          run_ahead=run_ahead, compact=False)
    assert moved.mismatches == [] and still.mismatches == []
    assert moved.rows_moved > 0 and still.rows_moved == 0


def test_the_fuzzer_fails_on_a_batch_dependent_reduction(folder):
    provider = BatchDependentProvider()
    report = fuzz_arrivals(Runner(folder, provider), seed=40, requests=60, max_batch=8, capacity=48)
    assert provider.mixed_steps > 0
    assert len(report.mismatches) >= 10
