"""The reference sampler: Philox known answers, the distribution per option (chi-square against
the exact filtered softmax), greedy == argmax, option validation, the host device_sample."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from core.generation import sampling as sm
from core.provider import ProviderBase
from providers.cpu_reference.argmax import argmax_rows
from providers.cpu_reference.provider import CpuReferenceProvider

# Random123's known-answer vectors for Philox-4x32-10 (kat_vectors).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers(ctr, key, want):
    got = sm.philox4x32(np.array([ctr], np.uint32), key)[0]
    assert [int(x) for x in got] == list(want)


def test_uniform_words_are_keyed_by_seed_and_position_only():
    a = sm.uniform_words(7, 100, 1000)
    assert np.array_equal(a, sm.uniform_words(7, 100, 1000))
    assert np.array_equal(a[:37], sm.uniform_words(7, 100, 37))  # a prefix of the vocabulary
    assert (a != sm.uniform_words(7, 101, 1000)).mean() > 0.99
    assert (a != sm.uniform_words(8, 100, 1000)).mean() > 0.99
    assert (a != sm.uniform_words(7 + (1 << 32), 100, 1000)).mean() > 0.99  # the high seed word counts


# -- the distribution ----------------------------------------------------------------------------
LOGITS = np.array([2.0, 1.5, 1.5, 1.0, 0.5, 0.2, 0.0, -0.3, -0.8, -1.0, -2.0, -3.5], np.float32)
HISTORY = np.zeros(LOGITS.size, np.uint8)
HISTORY[[0, 4, 9]] = 1


def exact_probs(logits: np.ndarray, p: sm.SamplingParams, history: np.ndarray) -> np.ndarray:
    """transformers' processors written out independently: penalty, temperature, top-k (ties at the
    k-th kept), top-p (sorted ascending, drop the tail whose cumulative mass <= 1 - p), min-p."""
    s = logits.astype(np.float64).copy()
    r = p.repetition_penalty
    for v in np.flatnonzero(history):
        s[v] = s[v] * r if s[v] < 0 else s[v] / r
    s = s / p.temperature
    if 0 < p.top_k < s.size:
        kth = np.sort(s)[::-1][p.top_k - 1]
        s[s < kth] = -np.inf
    if p.top_p < 1:
        probs = np.exp(s - s.max())
        probs /= probs.sum()
        keep = np.zeros(s.size, bool)
        for v in range(s.size):  # kept iff the mass strictly more probable than v is < top_p
            keep[v] = np.isfinite(s[v]) and probs[s > s[v]].sum() < p.top_p
        s[~keep] = -np.inf
    if p.min_p > 0:
        rel = np.exp(s - s.max())
        s[rel < p.min_p] = -np.inf
    e = np.exp(s - s.max())
    return e / e.sum()


def draw(p: sm.SamplingParams, n: int, history=HISTORY) -> np.ndarray:
    rows = np.repeat(LOGITS[None], n, 0)
    f, i = sm.pack([p] * n)
    out = sm.sample_rows(rows, f, i, np.arange(n), np.repeat(history[None], n, 0))
    assert (out[:, 1] == 0).all()
    return np.bincount(out[:, 0], minlength=LOGITS.size)


CASES = {
    "plain": dict(do_sample=True, top_k=0, seed=1),
    "temperature": dict(do_sample=True, top_k=0, temperature=0.6, seed=2),
    "top_k": dict(do_sample=True, top_k=4, seed=3),           # ties: entries 1 and 2 share a value
    "top_k_tie": dict(do_sample=True, top_k=2, seed=4),       # the k-th value is a tie: both kept
    "top_p": dict(do_sample=True, top_k=0, top_p=0.7, seed=5),
    "min_p": dict(do_sample=True, top_k=0, min_p=0.2, seed=6),
    "penalty": dict(do_sample=True, top_k=0, repetition_penalty=1.8, seed=7),
    "all": dict(do_sample=True, top_k=6, top_p=0.9, min_p=0.05, temperature=1.3, repetition_penalty=1.2, seed=8),
}
N = 6000


@pytest.mark.parametrize("name", list(CASES))
def test_sampled_distribution_is_the_filtered_softmax(name):
    p = sm.make_params(CASES[name])
    counts = draw(p, N)
    want = exact_probs(LOGITS, p, HISTORY)
    assert (counts[want == 0] == 0).all(), "a filtered-out token was drawn"
    live = want > 0
    chi = stats.chisquare(counts[live], want[live] * N)
    assert chi.pvalue > 1e-4, (name, counts, np.round(want * N))


@pytest.mark.parametrize("name,wrong", [
    ("top_k", dict(top_k=5)), ("top_p", dict(top_p=0.8)), ("min_p", dict(min_p=0.1)),
    ("temperature", dict(temperature=0.8)), ("penalty", dict(repetition_penalty=1.4)),
])
def test_the_chi_square_catches_a_wrong_filter(name, wrong):
    """Control: the same draws against the distribution of a slightly wrong option fail."""
    p = sm.make_params(CASES[name])
    counts = draw(p, N)
    bad = exact_probs(LOGITS, sm.make_params({**CASES[name], **wrong}), HISTORY)
    if ((bad == 0) & (counts > 0)).any():
        return  # drawn where the wrong filter allows nothing: caught outright
    live = bad > 0
    assert stats.chisquare(counts[live], bad[live] * counts[live].sum()).pvalue < 1e-6


def test_greedy_is_argmax_bitwise_and_non_finite_rows_are_flagged():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((6, 300)).astype(np.float32)
    rows[1, 17] = rows[1, 40] = rows[1].max() + 1  # a tie: the lowest index
    rows[3, 5] = np.nan
    rows[4, 9] = np.inf
    greedy = [sm.make_params(None), sm.make_params(dict(do_sample=True, temperature=0.0))] * 3
    f, i = sm.pack(greedy)
    got = sm.sample_rows(rows, f, i, np.arange(6), None)
    assert np.array_equal(got, argmax_rows(rows))
    sampled = [sm.make_params(dict(do_sample=True, seed=1))] * 6
    f, i = sm.pack(sampled)
    got = sm.sample_rows(rows, f, i, np.arange(6), None)
    assert got[3].tolist() == [-1, 1] and got[4].tolist() == [-1, 1]
    assert (got[[0, 1, 2, 5], 1] == 0).all()


def test_greedy_with_a_penalty_is_the_argmax_of_the_penalised_logits():
    row = np.array([3.0, 2.9, -1.0, -1.2], np.float32)
    hist = np.array([1, 0, 1, 0], np.uint8)
    p = sm.make_params(dict(repetition_penalty=1.5))
    assert sm.sample_row(row, hist, p, 0) == (1, 0)        # 3.0 / 1.5 = 2.0 < 2.9
    assert sm.penalize(row, hist, 1.5)[2] == np.float32(-1.5)


def test_a_row_draw_depends_on_seed_and_position_only():
    p = sm.make_params(dict(do_sample=True, top_k=0, seed=11))
    rows = np.repeat(LOGITS[None], 4, 0)
    f, i = sm.pack([p] * 4)
    a = sm.sample_rows(rows, f, i, np.array([5, 6, 5, 7]), None)
    assert a[0, 0] == a[2, 0] == sm.sample_row(LOGITS, None, p, 5)[0]


def test_pack_unpack_round_trip():
    rows = [sm.make_params(dict(do_sample=True, temperature=0.7, top_k=3, top_p=0.5, min_p=0.25,
                                repetition_penalty=1.25, seed=(1 << 64) - 3)),
            sm.make_params(None)]
    back = sm.unpack(*sm.pack(rows))
    assert back[0].seed == rows[0].seed and back[0].top_k == 3 and back[0].samples
    assert all(np.array_equal(x, y) for x, y in zip(sm.pack(back), sm.pack(rows)))  # fp32 values
    assert not back[1].samples and back[1].repetition_penalty == 1.0


@pytest.mark.parametrize("options,message", [
    (dict(temprature=0.5), "unknown sampling option 'temprature'"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be finite"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(min_p=2), "min_p must be in [0, 1]"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(seed=-1), "seed must be in [0, 2**64)"),
    (dict(do_sample="yes"), "do_sample must be True or False"),
])
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(sm.SamplingError) as err:
        sm.make_params(options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_defaults_come_from_the_search_section():
    d = sm.search_defaults({"do_sample": True, "temperature": 0.5, "top_k": 7, "top_p": 0.9,
                            "repetition_penalty": 1.1, "random_seed": 42, "num_beams": 1})
    assert d == sm.SamplingParams(True, 0.5, 7, 0.9, 0.0, 1.1, 42)
    assert sm.search_defaults({"random_seed": -1}).seed is None
    with pytest.raises(sm.SamplingError, match="genai_config.json search: top_p"):
        sm.search_defaults({"top_p": 0})


def test_resolve_rows_seeds_sampled_rows_and_checks_the_count():
    rows = sm.resolve_rows([dict(do_sample=True), None], 2, sm.SamplingParams())
    assert rows[0].seed is not None and rows[1].seed is None
    with pytest.raises(sm.SamplingError, match="3 entries for 2 rows"):
        sm.resolve_rows([None] * 3, 2, sm.SamplingParams())
    with pytest.raises(sm.SamplingError, match="row 1: top_k"):
        sm.resolve_rows([None, dict(top_k=-2)], 2, sm.SamplingParams())


def _tensors(provider, params, history, vocab):
    from core.protocol import SamplingTensors

    f, i = sm.pack(params)
    return SamplingTensors(provider.upload(f), provider.upload(i), provider.upload(history.copy()))


def test_host_device_sample_of_the_base_class_matches_cpu_reference():
    """ProviderBase.device_sample (the host path a provider inherits) == cpu_reference's."""
    rng = np.random.default_rng(3)
    B, V = 5, 64
    logits = rng.standard_normal((B, 3, V)).astype(np.float32)
    params = [sm.make_params(dict(do_sample=True, top_k=9, top_p=0.8, repetition_penalty=1.3, seed=b))
              for b in range(B)]
    history = (rng.random((B, V)) < 0.2).astype(np.uint8)
    p = CpuReferenceProvider()
    positions = np.array([0, 2, 1, 0, 2], np.int32)
    counter = np.array([9, 3, 4, 4, 100], np.int32)
    fed = np.array([[1], [2], [3], [4], [5]], np.int64)
    a, b = _tensors(p, params, history, V), _tensors(p, params, history, V)
    ra, rb = np.zeros((B, 2), np.int32), np.zeros((B, 2), np.int32)
    p.device_sample(logits, positions, counter, fed, a, ra)
    ProviderBase.device_sample(p, logits, positions, counter, fed, b, rb)
    assert np.array_equal(ra, rb)
    assert np.array_equal(a.history, b.history) and a.history[np.arange(B), fed[:, 0]].all()
    want = sm.sample_rows(logits[np.arange(B), positions], *sm.pack(params), counter, a.history)
    assert np.array_equal(ra, want)
