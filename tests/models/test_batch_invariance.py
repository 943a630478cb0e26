"""Batch invariance on cpu_reference with SmolLM2 (docs/cases.md 1, 2, 4): bitwise, not approximately."""

import numpy as np
import pytest

from core.generation.generate import generate
from core.generation.loop import decode
from core.session import Session

pytestmark = pytest.mark.model

STEPS = 24


def run_rows(model, rows, steps=STEPS, **kw):
    """Tokens and per-step last-position logits of each row."""
    session = Session(model, "cpu_reference", batch=len(rows), capacity=kw.pop("capacity", 128), **kw)
    logits = []
    trace = decode(session, rows, steps, observer=lambda *_: logits.append(session.last_logits()))
    return trace.tokens.T, np.stack(logits, 1)


def test_each_row_of_a_mixed_batch_is_bitwise_its_batch1_run(fp32_model, prompt_ids):
    lengths = {len(p) for p in prompt_ids}
    assert len(lengths) == len(prompt_ids), "the prompts must differ in length"
    tokens, logits = run_rows(fp32_model, prompt_ids)
    for b, ids in enumerate(prompt_ids):
        t1, l1 = run_rows(fp32_model, [ids], capacity=96)
        assert np.array_equal(tokens[b], t1[0]), f"row {b} tokens"
        assert np.array_equal(logits[b], l1[0]), f"row {b} logits"


def test_rows_finishing_at_different_steps_match_batch1(fp32_model, prompt_ids):
    """generate(): rows end on EOS at different steps; each row's output equals its batch-1 run."""
    batched = generate(Session(fp32_model, "cpu_reference", batch=5, capacity=128), prompt_ids, 40)
    reasons = [r for _, r in batched]
    lengths = [len(t) for t, _ in batched]
    assert "eos" in reasons and len(set(lengths)) > 1, "want rows that end at different steps"
    for b, ids in enumerate(prompt_ids):
        alone = generate(Session(fp32_model, "cpu_reference", batch=1, capacity=128), [ids], 40)
        assert batched[b] == alone[0], f"row {b}"


def test_n_copies_of_one_prompt_are_bitwise_equal(fp32_model, prompt_ids):
    tokens, logits = run_rows(fp32_model, [prompt_ids[2]] * 4, steps=8)
    for b in range(1, 4):
        assert np.array_equal(tokens[b], tokens[0]) and np.array_equal(logits[b], logits[0])


def test_padding_amount_does_not_change_a_row(fp32_model, prompt_ids):
    """docs/cases.md 1: the same prompt beside partners 0, 1, 7 and len(prompt) tokens longer."""
    ids = prompt_ids[3]
    base_t, base_lg = run_rows(fp32_model, [ids], steps=6, capacity=256)
    for extra in (0, 1, 7, len(ids)):
        partner = prompt_ids[4][: len(ids)] + [42] * extra if extra else list(ids)
        partner = partner + [7] * max(0, len(ids) + extra - len(partner))
        t, lg = run_rows(fp32_model, [ids, partner], steps=6, capacity=256)
        assert np.array_equal(t[0], base_t[0]) and np.array_equal(lg[0], base_lg[0]), extra


def test_seq_major_equals_head_major_bitwise(fp32_model, prompt_ids):
    rows = prompt_ids[:3]
    a = run_rows(fp32_model, rows, steps=8)
    b = run_rows(fp32_model, rows, steps=8, kv_layout="seq_major")
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_growing_cache_equals_fixed_bitwise(fp32_model, prompt_ids):
    """docs/cases.md 6: a head-major growing cache (several growth events) gives the fixed run's bits."""
    rows = prompt_ids[:3]
    fixed = run_rows(fp32_model, rows, steps=40, capacity=128)
    session = Session(fp32_model, "cpu_reference", batch=3, capacity=8,
                      kv_policy="growing")
    t = decode(session, rows, 40, keep_logits=True)
    tokens, logits = list(t.tokens), list(t.logits)
    assert session.counters.growth_events >= 2
    assert session.counters.kv_bytes_moved > 0
    assert np.array_equal(np.stack(tokens, 1), fixed[0]) and np.array_equal(np.stack(logits, 1), fixed[1])


def test_nan_in_unused_kv_slots_changes_nothing(fp32_model, prompt_ids):
    """docs/cases.md 5, 7: poison every slot past each row's length before prefill and each step."""
    rows = prompt_ids[:2]
    clean = run_rows(fp32_model, rows, steps=6)
    session = Session(fp32_model, "cpu_reference", batch=2, capacity=128)

    def poison():
        for k, v in session.state.kv.layers:
            for b in range(2):
                n = int(session.lengths[b]) + (1 if session.started else max(len(r) for r in rows))
                k[b, :, n:] = np.nan
                v[b, :, n:] = np.nan

    poison()
    t = decode(session, rows, 6, keep_logits=True, observer=lambda *_: poison())  # before each step
    tokens, logits = list(t.tokens), list(t.logits)
    assert np.array_equal(np.stack(tokens, 1), clean[0]) and np.array_equal(np.stack(logits, 1), clean[1])
