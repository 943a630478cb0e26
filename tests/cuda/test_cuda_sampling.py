"""device_sample on the GPU: equal to the NumPy reference on identical fp32 logits, greedy rows
equal to device_argmax, captured == eager, batch N == batch 1, and the distribution per option."""

import numpy as np
import pytest

from tests.cuda._gpu import require_gpu

cupy = require_gpu()

from core.generation import sampling as sm  # noqa: E402
from core.protocol import SamplingTensors  # noqa: E402
from core.session import Session  # noqa: E402

OPTIONS = [
    dict(do_sample=True, top_k=0, seed=1),
    dict(do_sample=True, temperature=0.7, top_k=50, seed=2),
    dict(do_sample=True, top_k=0, top_p=0.9, seed=3),
    dict(do_sample=True, top_k=40, top_p=0.8, min_p=0.05, temperature=1.2, seed=4),
    dict(do_sample=True, top_k=0, min_p=0.1, repetition_penalty=1.3, seed=5),
    dict(repetition_penalty=1.2),  # greedy with a penalty
    None,                          # plain greedy
    dict(do_sample=True, top_k=1, seed=6),
]


def _sample(gpu, logits, params, history, counter, positions=None, fed=None):
    B = logits.shape[0]
    f, i = sm.pack(params)
    t = SamplingTensors(cupy.asarray(f), cupy.asarray(i), cupy.asarray(history))
    res = cupy.zeros((B, 2), cupy.int32)
    pos = cupy.asarray(np.zeros(B, np.int32) if positions is None else positions)
    gpu.device_sample(cupy.asarray(logits), pos, cupy.asarray(counter.astype(np.int32)),
                      None if fed is None else cupy.asarray(fed), t, res)
    return res.get(), t.history.get()


@pytest.mark.parametrize("vocab", [256, 49152, 151936])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_device_sample_equals_the_reference_on_identical_logits(gpu, vocab, dtype):
    rng = np.random.default_rng(vocab)
    B, steps = len(OPTIONS), 24
    params = [sm.make_params(o) for o in OPTIONS]
    history = (rng.random((B, vocab)) < 0.01).astype(np.uint8)
    for step in range(steps):
        logits = (rng.standard_normal((B, 1, vocab)) * 3).astype(dtype)
        logits[2, 0, 7] = logits[2, 0, 9] = logits[2].max()  # a tie at the top
        counter = np.arange(B) * 1000 + step
        got, _ = _sample(gpu, logits, params, history, counter)
        want = sm.sample_rows(logits[:, 0].astype(np.float32), *sm.pack(params), counter, history)
        assert np.array_equal(got, want), (step, got.tolist(), want.tolist())


def test_greedy_rows_are_device_argmax_and_non_finite_rows_are_flagged(gpu):
    rng = np.random.default_rng(1)
    B, V = 4, 49152
    logits = rng.standard_normal((B, 2, V)).astype(np.float32)
    logits[1, 1, 100] = np.nan
    pos = np.array([0, 1, 1, 0], np.int32)
    params = [sm.make_params(None)] * 2 + [sm.make_params(dict(do_sample=True, seed=3))] * 2
    got, _ = _sample(gpu, logits, params, np.zeros((B, V), np.uint8), np.zeros(B), positions=pos)
    ref = cupy.zeros((B, 2), cupy.int32)
    gpu.device_argmax(cupy.asarray(logits), cupy.asarray(pos), ref)
    assert np.array_equal(got[:2], ref.get()[:2])
    assert got[1].tolist() == [-1, 1]


def test_fed_tokens_are_marked_in_the_history(gpu):
    B, V = 3, 1000
    logits = np.zeros((B, 1, V), np.float32)
    fed = np.array([[5], [999], [0]], np.int64)
    _, hist = _sample(gpu, logits, [sm.make_params(dict(repetition_penalty=1.5))] * B, np.zeros((B, V), np.uint8),
                      np.zeros(B), fed=fed)
    assert hist.sum() == 3 and hist[0, 5] == hist[1, 999] == hist[2, 0] == 1


def test_gpu_distribution_matches_the_filtered_softmax(gpu):
    """Same draws as the reference, so the reference chi-square carries over; checked here on
    20000 GPU draws of one row at different positions."""
    from scipy import stats

    logits = np.array([2.0, 1.5, 1.5, 1.0, 0.5, 0.2, 0.0, -0.3, -0.8, -1.0, -2.0, -3.5], np.float32)
    p = sm.make_params(dict(do_sample=True, top_k=6, top_p=0.9, temperature=1.3, seed=8))
    n = 20000
    got, _ = _sample(gpu, np.repeat(logits[None, None], n, 0), [p] * n, np.zeros((n, 12), np.uint8), np.arange(n))
    counts = np.bincount(got[:, 0], minlength=12)
    keep, e = sm.kept_mask(logits / np.float32(1.3), 6, 0.9, 0.0)
    want = np.where(keep, e, 0) / np.where(keep, e, 0).sum()
    assert (counts[~keep] == 0).all()
    assert stats.chisquare(counts[keep], want[keep] * n).pvalue > 1e-4


def test_sampled_session_captured_equals_eager_and_batch_one(model_dir, gpu):
    """Mixed options at batch 8: captured == eager bitwise, and every row == its batch-1 run."""
    from core.runtime.runner import Runner

    runner = Runner(model_dir, gpu)
    rng = np.random.default_rng(0)
    vocab = runner.model.config.vocab_size
    prompts = [list(rng.integers(3, vocab, size=int(n))) for n in rng.integers(2, 12, size=8)]
    opts = OPTIONS

    def run(batch_prompts, batch_opts, capture):
        s = Session(runner, batch=len(batch_prompts), capacity=128, capture=capture)
        rows = s.stream(batch_prompts, max_new_tokens=40, sampling=batch_opts).run()
        counters = s.counters
        s.close()
        return [r.output_ids for r in rows], counters

    eager, c_e = run(prompts, opts, False)
    captured, c_c = run(prompts, opts, True)
    assert c_c.replays > 0 and c_e.replays == 0
    assert captured == eager
    for b in range(8):
        alone, _ = run([prompts[b]], [opts[b]], True)
        assert alone[0] == captured[b], b


def test_sampling_matches_cpu_reference_on_the_fp32_model(model_dir, gpu):
    """fp32 tiny model: the sampled tokens of cuda and cpu_reference agree (logits agree to
    ~1e-6, so a different draw needs a near tie of the Gumbel scores)."""
    import core

    if "fp32" not in str(model_dir):
        pytest.skip("the fp32 model only")
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    kw = dict(input_ids=prompts, max_new_tokens=24, sampling=[OPTIONS[1], OPTIONS[3]])
    a = core.run(model_dir, provider=gpu, **kw)
    b = core.run(model_dir, provider="cpu_reference", **kw)
    assert [r.output_ids for r in a.rows] == [r.output_ids for r in b.rows]
