"""Folders built with the ONNX Runtime GenAI builder's own defaults, as users get them elsewhere.

``core.testing.families.build_family`` runs the builder with no extra option, so the sliding
layers of Gemma 2, Gemma 3, Mistral (every layer) and SmolLM3 get ``sliding_window_cache=1``, a
window-sized KV cache, which Lockstep keeps as a ring (docs/kv-geometry.md). ``lockstep
prepare`` passes only ``windowed_kv_cache=false``, which changes nothing in the other families'
graphs, so tests/models/test_families.py covers those as the builder writes them by default.

Window 24, ring 40 slots, session capacity 64: the prompts plus 32 greedy tokens reach 49
positions, and the teacher-forced check runs a 45-token prompt (longer than the ring) and 15
more tokens, so every check runs with the rings wrapped.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from core.generation.generate import generate
from core.generation.loop import decode
from core.models.model import load_model
from core.runtime import ring
from core.session import RequestError, Session
from core.testing.families import build_family

pytest.importorskip("onnxruntime_genai")

from _ort import ort_greedy, ort_teacher_forced  # noqa: E402

pytest.importorskip("transformers")

pytestmark = pytest.mark.model

STEPS = 32
CAPACITY = 64
PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 21)), [200, 7, 7, 31, 64, 128, 9, 250, 1, 33, 77, 12, 6, 90, 44, 23, 8]]
#: family -> the window of each of its two layers' KV cache in the builder's default graph.
WINDOWED = {"gemma2": (24, 0), "gemma3": (24, 0), "mistral": (24, 24), "smollm3": (24, 0)}


@pytest.fixture(scope="session")
def default_dirs(tmp_path_factory):
    """(family, precision) -> its CPU folder built with the builder's defaults (int4: a copy whose
    MatMulNBits say accuracy_level 0, so ORT multiplies in fp32 as cpu_reference does)."""
    import onnx

    root = tmp_path_factory.mktemp("builder-defaults")
    built: dict[tuple[str, str], object] = {}

    def get(family: str, precision: str = "fp32"):
        key = (family, precision)
        if key not in built:
            folder = build_family(family, root / f"{family}-{precision}", precision, "cpu")
            shutil.rmtree(folder / "hf")
            shutil.rmtree(folder / "cache", ignore_errors=True)
            if precision == "int4":
                graph = onnx.load(str(folder / "model.onnx"), load_external_data=False)
                levels = [a for n in graph.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
                          if a.name == "accuracy_level"]
                assert levels  # an int4 graph
                for a in levels:
                    a.i = 0
                onnx.save(graph, str(folder / "model.onnx"))
            built[key] = folder
        return built[key]

    return get


def _session(model, batch, **kw):
    return Session(model, "cpu_reference", batch=batch, **({"capacity": CAPACITY} | kw))


@pytest.mark.parametrize("precision", ["fp32", "int4"])
@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_windowed_default_folder_greedy_tokens_equal_ort_genai(default_dirs, family, precision):
    folder = default_dirs(family, precision)
    model = load_model(folder)
    session = _session(model, len(PROMPTS))
    assert session.state.kv.windows == WINDOWED[family]
    ours = generate(session, PROMPTS, STEPS)
    rings = [g.capacity for g, w in zip(session.state.kv.layer_geometries, WINDOWED[family]) if w]
    assert rings == [ring.ring_size(24)] * len(rings) and max(session.state.lengths) > rings[0]  # wrapped
    for b, ids in enumerate(PROMPTS):
        tokens, reason = ours[b]
        if reason == "eos":
            tokens = tokens[:-1]
        assert tokens == ort_greedy(folder, ids, STEPS), f"{family} {precision} prompt {b}"


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_windowed_teacher_forced_logits_follow_ort_genai_past_a_prompt_longer_than_the_ring(default_dirs, family):
    """A 45-token prompt (its window read from the new K/V, not the ring) and 15 forced tokens:
    every step's logits within 1e-4 of the logit spread of ORT GenAI's, top-1 equal."""
    folder = default_dirs(family)
    rng = np.random.default_rng(3)
    ids, forced = rng.integers(3, 256, 45).tolist(), rng.integers(3, 256, 15).tolist()
    want = ort_teacher_forced(folder, ids, forced)
    session = _session(load_model(folder), 1)
    got = []
    decode(session, [ids], len(forced), force=[forced], observer=lambda *_: got.append(session.last_logits()[0]))
    got = np.stack(got)
    spread = want.max(-1) - want.min(-1)
    assert (np.abs(got - want).max(-1) <= 1e-4 * spread).all(), family
    assert (got.argmax(-1) == want.argmax(-1)).all(), family


def _trace(session, rows, steps=STEPS):
    logits = []
    trace = decode(session, rows, steps, observer=lambda *_: logits.append(session.last_logits()))
    return trace.tokens.T, np.stack(logits, 1)


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_windowed_rows_of_a_batch_are_bitwise_their_batch1_runs(default_dirs, family):
    model = load_model(default_dirs(family))
    tokens, logits = _trace(_session(model, len(PROMPTS)), PROMPTS)
    for b, ids in enumerate(PROMPTS):
        t1, l1 = _trace(_session(model, 1), [ids])
        assert np.array_equal(tokens[b], t1[0]) and np.array_equal(logits[b], l1[0]), f"{family} row {b}"


def test_windowed_growth_and_prefill_groups_are_bitwise_the_fixed_padded_run(default_dirs):
    """Gemma 3 (a ring layer and a full one): a growing cache from 16 positions (the ring grows
    to 40 slots with it, then the full layer alone) and a prefill in length groups (scratch
    rings copied into the cache) give the bits of a fixed cache with one padded prefill."""
    model = load_model(default_dirs("gemma3"))
    rows = [PROMPTS[0], list(range(30, 75)), PROMPTS[1]]  # 45 tokens: a scratch ring wraps too
    want = _trace(_session(model, 3, prefill_groups="off"), rows, 16)
    grown = _session(model, 3, capacity=16, kv_policy="growing", max_capacity=128)
    got = _trace(grown, rows, 16)
    assert grown.counters.growth_events >= 2
    grouped = _session(model, 3, prefill_groups="always")
    got_groups = _trace(grouped, rows, 16)
    assert grouped.counters.prefill_runs > 1
    for other in (got, got_groups):
        assert np.array_equal(other[0], want[0]) and np.array_equal(other[1], want[1])


def test_windowed_continuation_is_exact_within_the_rewind_limit_and_refused_past_it(default_dirs):
    """Gemma 2, two rows: a row that ended 10 steps before the other continues bitwise as a
    fresh run over its history; one that ended 25 steps before (more than the ring's 17) is
    refused before any work, and the session then serves the next request."""
    model = load_model(default_dirs("gemma2"))
    session = _session(model, 2)
    g = session.stream(PROMPTS[:2], max_new_tokens=[20, 30])
    g.run()
    g.extend([[40, 41], None], max_new_tokens=6)
    g.run()
    fresh = _session(model, 1).stream([g.rows[0].prompt_ids], max_new_tokens=6)
    fresh.run()
    assert g.rows[0].output_ids == fresh.rows[0].output_ids and len(g.rows[0].output_ids) == 6
    late = session.stream(PROMPTS[:2], max_new_tokens=[5, 30])
    late.run()
    with pytest.raises(RequestError, match="past its end"):
        late.extend([[40], None], max_new_tokens=4)
    again = session.stream([PROMPTS[2], PROMPTS[0]], max_new_tokens=8)
    again.run()
    alone = _session(model, 1).stream([PROMPTS[2]], max_new_tokens=8)
    alone.run()
    assert again.rows[0].output_ids == alone.rows[0].output_ids


def test_windowed_rewind_past_the_ring_is_refused_and_changes_nothing(default_dirs):
    model = load_model(default_dirs("mistral"))
    session = _session(model, 1)
    decode(session, [PROMPTS[0]], 30)
    limit = session.state.kv.rewind_limit
    length = int(session.state.lengths[0])
    with pytest.raises(RequestError, match="ring"):
        session.rewind([length - limit - 1])
    assert int(session.state.lengths[0]) == length
    session.rewind([length - limit])  # at the limit: exact, the next steps run
    session.step()
