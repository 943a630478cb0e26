"""Activation memory of a prefill on the GPU (core.executor "Activation memory"): a transient
prefill frees each node's buffers after their last reader, so the CuPy pool's high-water mark
over the prefill is a few layers' activations, not one buffer per node; the logits and the
tokens decoded after it (captured steps) are the same bits as a prefill that keeps every buffer.

    pytest -m cuda tests/cuda/test_cuda_activation_memory.py -v -s
"""

import numpy as np
import pytest
from _gpu import require_gpu

cupy = require_gpu()

from core.executor import Plan  # noqa: E402
from core.generation.loop import decode  # noqa: E402
from core.runtime.runner import Runner  # noqa: E402
from core.session import Session  # noqa: E402
from core.testing.tiny_model import TinyConfig, make_tiny_model  # noqa: E402
from core.testing.transient import force_prefill_transient  # noqa: E402
from providers.cuda.provider import CudaProvider  # noqa: E402

CONFIG = TinyConfig(layers=8, hidden=256, intermediate=1024, heads=8, kv_heads=2, head_size=32, context=512)
ROWS = [[3 + (i * 7 + n) % 250 for i in range(n)] for n in (400, 380, 350, 390, 300, 360, 400, 330)]


@pytest.fixture(scope="module", params=[("float16", None), ("float16", "int4")], ids=["fp16", "int4"])
def model_dir(request, tmp_path_factory):
    dtype, quant = request.param
    return make_tiny_model(tmp_path_factory.mktemp("act"), dtype=dtype, quant=quant, config=CONFIG)


def _prefill(model_dir, monkeypatch, transient):
    real = Plan.run
    seen = force_prefill_transient(monkeypatch, transient)  # decode steps as by default (never)
    provider = CudaProvider()
    runner = Runner(model_dir, provider)
    session = Session(runner, batch=len(ROWS), capacity=512)
    session.prefill([r[:8] for r in ROWS])  # programs planned and kernels compiled outside the peak
    runner.plan.release_buffers()
    provider.reset_peak()
    base = provider.peak_bytes()
    session.prefill(ROWS)
    cupy.cuda.get_current_stream().synchronize()
    peak = provider.peak_bytes() - base
    logits = session.last_logits().copy()
    tokens = decode(Session(runner, batch=len(ROWS), capacity=512), ROWS, 6).tokens
    monkeypatch.setattr(Plan, "run", real)
    assert seen and all(t is transient for t in seen)
    return peak, logits, tokens


def test_a_transient_prefill_peaks_at_its_live_set_with_the_same_bits(gpu, model_dir, monkeypatch):
    kept_peak, kept_logits, kept_tokens = _prefill(model_dir, monkeypatch, False)
    freed_peak, freed_logits, freed_tokens = _prefill(model_dir, monkeypatch, True)
    print(f"prefill peak above the weights and KV: kept {kept_peak / 2**20:.1f} MiB, "
          f"transient {freed_peak / 2**20:.1f} MiB")
    assert np.array_equal(freed_logits, kept_logits)
    assert np.array_equal(freed_tokens, kept_tokens)
    unit = len(ROWS) * max(map(len, ROWS)) * CONFIG.hidden * 2  # one [B * S, hidden] fp16 activation
    assert kept_peak > CONFIG.layers * 4 * unit, (kept_peak, unit)  # it held every layer's buffers
    assert freed_peak < kept_peak / 3, (freed_peak, kept_peak)
