"""Generation on the tiny model (cpu_reference): sampled rows are batch invariant, per-row stop
rules, streamed text, chat messages, continuation == a fresh run over the history, and bad
options refused before any work."""

from __future__ import annotations

import json

import numpy as np
import pytest

import core
from core.generation.chat import Conversation
from core.generation.stream import IncrementalDetokenizer, eos_ids
from core.models.model import load_model
from core.session import RequestError, Session
from core.testing.tiny_model import make_tiny_model, write_byte_tokenizer

MIXED = [
    dict(do_sample=True, temperature=0.8, top_k=20, seed=5),
    None,
    dict(do_sample=True, top_k=0, top_p=0.7, seed=9),
    dict(repetition_penalty=1.3),
    dict(do_sample=True, top_k=0, min_p=0.1, seed=1, repetition_penalty=1.2),
    dict(do_sample=True, temperature=1.5, top_k=5, top_p=0.9, seed=2**63 + 7),
    dict(do_sample=True, seed=11),
    dict(do_sample=False, temperature=0.3),
]
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10], [11, 12, 13, 14, 15], [16, 17], [18, 19, 20], [21]]
NEW = [10, 12, 8, 15, 9, 11, 7, 13]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("gen"))
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def runner(tiny):
    return core.Runner(tiny, "cpu_reference")


def _run(runner, prompts, new, sampling, **kw):
    s = Session(runner, batch=len(prompts), capacity=96)
    g = s.stream(prompts, max_new_tokens=new, sampling=sampling, **kw)
    deltas = list(g)
    return g, deltas, s


def test_sampled_rows_at_batch_8_equal_their_batch_1_runs(runner):
    g, _, s = _run(runner, PROMPTS, NEW, MIXED)
    assert s.state.sampling is not None  # device_sample ran, not device_argmax
    rows = [r.output_ids for r in g.rows]
    assert [len(r) for r in rows] == [min(n, len(r)) for n, r in zip(NEW, rows)]
    for b in range(8):
        alone, _, _ = _run(runner, [PROMPTS[b]], NEW[b], [MIXED[b]])
        assert alone.rows[0].output_ids == rows[b], b
    # plain greedy rows equal the greedy-only batch (device_argmax) bitwise
    greedy, _, s2 = _run(runner, PROMPTS, NEW, None)
    assert s2.state.sampling is None
    for b in (1, 7):
        assert greedy.rows[b].output_ids == rows[b]
    # a sampled row's draws depend on its seed
    other, _, _ = _run(runner, [PROMPTS[6]], NEW[6], [dict(MIXED[6], seed=12)])
    assert other.rows[0].output_ids != rows[6]


def test_seeds_are_drawn_and_reported_when_not_given(tiny):
    r = core.run(tiny, input_ids=[[1, 2, 3]] * 2, max_new_tokens=4, do_sample=True)
    seeds = [row.sampling["seed"] for row in r.rows]
    assert all(isinstance(x, int) for x in seeds) and seeds[0] != seeds[1]
    again = core.run(tiny, input_ids=[[1, 2, 3]], max_new_tokens=4, do_sample=True, seed=seeds[0])
    assert again.rows[0].output_ids == r.rows[0].output_ids


def test_prefill_logits_are_bitwise_the_token_by_token_decode(runner):
    """The property continuation rests on: a prompt's last logits == feeding it one step at a time."""
    hist = [[5, 9, 3, 77, 12, 40, 41], [8, 1, 200], [9, 9, 9, 9, 100]]
    a = Session(runner, batch=3, capacity=32)
    a.prefill(hist)
    full = a.last_logits()
    b = Session(runner, batch=3, capacity=32)
    b.prefill([h[:1] for h in hist])
    got = {}
    for t in range(1, 7):
        b.step(force_tokens=[h[t] if t < len(h) else 0 for h in hist])
        for r, h in enumerate(hist):
            if t == len(h) - 1:
                got[r] = b.last_logits()[r]
    for r in range(3):
        assert np.array_equal(got[r], full[r]), r


def test_continuation_equals_a_fresh_run_over_the_history(runner):
    g, _, s = _run(runner, PROMPTS, NEW, MIXED)
    extra = [[20, 21], None, [22], [23, 24, 25], [26], [], [27, 28, 29, 30], [31]]
    g.extend(extra, max_new_tokens=6)
    deltas = list(g)
    assert deltas and all(d.row != 1 for d in deltas)  # the row given None stays ended
    for b in range(8):
        if extra[b] is None:
            continue
        r = g.rows[b]
        fresh, _, _ = _run(runner, [r.prompt_ids], 6, [MIXED[b]])
        assert r.output_ids == fresh.rows[0].output_ids, b
        assert len(r.output_ids) > 0
    # the logits too, bitwise: one row continued twice against a fresh run over its history
    one, _, s1 = _run(runner, [PROMPTS[3]], 5, [MIXED[4]])
    one.extend([[40, 41, 42]], max_new_tokens=5).run()
    one.extend([[43]], max_new_tokens=5).run()
    continued = s1.last_logits()  # before s2 runs: the two sessions share the runner's logits buffer
    fresh, _, s2 = _run(runner, [one.rows[0].prompt_ids], 5, [MIXED[4]])
    assert fresh.rows[0].output_ids == one.rows[0].output_ids
    assert np.array_equal(continued, s2.last_logits())


def test_extend_refuses_bad_requests_and_the_session_stays_usable(runner):
    g, _, s = _run(runner, PROMPTS[:2], 3, None)
    with pytest.raises(RequestError, match="2 rows"):
        g.extend([[1]])
    with pytest.raises(RequestError, match="outside"):
        g.extend([[1], [999]])
    with pytest.raises(RequestError, match="limit"):
        g.extend([[1] * 200, None])
    with pytest.raises(RequestError, match="no row"):
        g.extend([None, None])
    g.extend([[1], [2]], max_new_tokens=2)
    assert all(len(r.output_ids) <= 2 for r in g.run())


def test_per_row_max_new_tokens_stop_ids_and_eos(tiny, tmp_path):
    base = core.run(tiny, input_ids=PROMPTS[:3], max_new_tokens=[3, 6, 0])
    assert [len(r.output_ids) for r in base.rows][2] == 0 and base.rows[2].finish_reason == "length"
    assert len(base.rows[0].output_ids) <= 3
    stop_tok = base.rows[1].output_ids[2]
    r = core.run(tiny, input_ids=PROMPTS[:3], max_new_tokens=[3, 6, 0], stop_token_ids=[[], [stop_tok], []])
    i = base.rows[1].output_ids.index(stop_tok)
    assert r.rows[1].output_ids == base.rows[1].output_ids[:i + 1]
    assert r.rows[1].finish_reason == "stop" and r.rows[1].stop == stop_tok
    assert r.rows[0].output_ids == base.rows[0].output_ids
    # every EOS id of genai_config.json ends a row (a list of them)
    first = base.rows[0].output_ids[0]
    cfg = json.loads((tiny / "genai_config.json").read_text())
    cfg["model"]["eos_token_id"] = [2, int(first)]
    folder = make_tiny_model(tmp_path / "eos")
    (folder / "genai_config.json").write_text(json.dumps(cfg))
    assert eos_ids(load_model(folder)) == {2, int(first)}
    r = core.run(folder, input_ids=PROMPTS[:1], max_new_tokens=5)
    assert r.rows[0].output_ids == [first] and r.rows[0].finish_reason == "eos"


def test_a_stop_string_ends_exactly_that_row(tiny):
    kw = dict(prompts=["abc", "hello there", "xyz"], max_new_tokens=24, chat=False)
    base = core.run(tiny, **kw)
    text = base.rows[1].text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2]
                and text[:i].find(text[i:i + 2]) < 0)
    cut = text.index(stop)
    r = core.run(tiny, stop=[None, [stop], None], **kw)
    assert r.rows[1].finish_reason == "stop" and r.rows[1].stop == stop
    assert r.rows[1].text == text[:cut]
    assert r.rows[1].output_ids == base.rows[1].output_ids[:len(r.rows[1].output_ids)]
    assert len(r.rows[1].output_ids) < len(base.rows[1].output_ids)
    for b in (0, 2):
        assert r.rows[b] == base.rows[b]


def test_streamed_text_concatenates_to_the_final_text(tiny):
    """Random byte tokens split multi-byte characters (U+FFFD while incomplete); with stop
    strings the text is also held back. The deltas of a row add up to its final text."""
    st = core.stream(tiny, prompts=["日本語", "🎉 emoji", "café"], max_new_tokens=40, chat=False,
                     stop=["zz", "\u00e9t"], do_sample=True, seed=3)
    got = ["", "", ""]
    ends = {}
    for d in st:
        got[d.row] += d.text
        if d.finish_reason:
            ends[d.row] = d.finish_reason
    result = st.result()
    tok = load_model(tiny).tokenizer
    for b, row in enumerate(result.rows):
        assert got[b] == row.text
        assert ends[b] == row.finish_reason
        if row.finish_reason != "stop":
            assert row.text == tok.decode(row.output_ids)


def test_incremental_detokenizer_emoji_and_cjk(tiny):
    tok = load_model(tiny).tokenizer
    text = "日本語のテキスト 🎉👍🏽 café Ω"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # multi-byte characters span several tokens
    d = IncrementalDetokenizer(tok)
    parts = [d.push(t) for t in ids]
    parts.append(d.finish())
    assert "".join(parts) == text
    assert not any("\ufffd" in p for p in parts)
    assert sum(1 for p in parts if p) < len(ids)  # some tokens released nothing (a char in flight)


def test_chat_messages_and_a_system_prompt(tiny):
    model = load_model(tiny)
    r = core.run(tiny, messages=[{"role": "user", "content": "hi"}], max_new_tokens=2, system="mine")
    assert model.tokenizer.decode(r.rows[0].prompt_ids) == "<system>mine\n<user>hi\n<assistant>"
    r2 = core.run(tiny, messages=[[{"role": "system", "content": "own"}, {"role": "user", "content": "a"},
                                   {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
                                  [{"role": "user", "content": "d"}]], max_new_tokens=2)
    texts = [model.tokenizer.decode(row.prompt_ids) for row in r2.rows]
    assert texts == ["<system>own\n<user>a\n<assistant>b\n<user>c\n<assistant>",
                     "<system>default\n<user>d\n<assistant>"]
    r3 = core.run(tiny, prompts=["q"], system="sys", max_new_tokens=1)
    assert model.tokenizer.decode(r3.rows[0].prompt_ids).startswith("<system>sys\n<user>q")


@pytest.mark.parametrize("messages,match", [
    ([{"role": "robot", "content": "x"}], "role must be"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "role must be"),
    ([{"role": "user"}], "'role' and 'content'"),
    ([{"role": "user", "content": 3}], "content must be a str"),
    ([], "non-empty list"),
])
def test_bad_messages_are_refused(tiny, messages, match):
    with pytest.raises(RequestError, match=match):
        core.run(tiny, messages=[messages], max_new_tokens=1)


def test_conversation_continues_the_cache_and_equals_a_fresh_run(runner):
    s = Session(runner, batch=1)
    talk = Conversation(s, system="be brief", max_new_tokens=6, sampling=dict(do_sample=True, seed=4))
    first = "".join(d.text for d in talk.say("hello"))
    steps_before = s.counters.prefill_tokens
    second = list(talk.say("more please"))
    assert talk.refills == 0 and s.counters.prefill_tokens == steps_before  # no new prefill
    row = talk.generation.rows[0]
    fresh, _, _ = _run(runner, [row.prompt_ids], 6, [dict(do_sample=True, seed=4)])
    assert fresh.rows[0].output_ids == row.output_ids
    assert "".join(d.text for d in second) == row.text
    assert [m["role"] for m in talk.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert talk.messages[2]["content"] == first


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-3), "top_k must be >= 0"),
    (dict(temprature=1), "unknown option 'temprature'"),
    (dict(sampling=[None, dict(top_p=2)]), "row 1: top_p"),
    (dict(stop=[""]), "stop must not be an empty string"),
    (dict(stop_token_ids=[999]), "stop_token_ids must be"),
    (dict(max_new_tokens=[1, -1]), "max_new_tokens"),
])
def test_bad_options_are_one_line_errors_before_any_work(runner, kw, match):
    before = runner.provider.uploaded_bytes
    with pytest.raises(RequestError, match=match) as err:
        core.run(runner, input_ids=PROMPTS[:2], **kw)
    assert "\n" not in str(err.value)
    s = Session(runner, batch=2, capacity=32)
    with pytest.raises(RequestError):
        s.stream(PROMPTS[:2], 4, sampling=dict(top_k=-1))
    assert runner.provider.uploaded_bytes - before < 4096  # buffers only: no prefill ran
    assert len(s.stream(PROMPTS[:2], 2).run()) == 2  # still usable


def test_sampling_on_a_provider_without_device_sample_is_refused(tiny):
    from providers.cpu_reference.provider import CpuReferenceProvider

    class NoSample:  # a provider object that does not inherit ProviderBase's host sampler
        def __init__(self):
            self._p = CpuReferenceProvider()

        def __getattr__(self, name):
            if name == "device_sample":
                raise AttributeError(name)
            return getattr(self._p, name)

    s = Session(tiny, NoSample(), batch=1, capacity=16)
    with pytest.raises(RequestError, match="has no device_sample"):
        s.prefill([[1, 2]], sampling=dict(do_sample=True))
    assert s.prefill([[1, 2]]).tokens.shape == (1,)  # greedy still works


def test_cli_run_stream_and_chat(tiny, capsys, monkeypatch):
    from core.cli import main

    assert main(["run", "--model", str(tiny), "--prompt", "hi", "--max-new-tokens", "5", "--stream",
                 "--do-sample", "--seed", "1", "--raw"]) == 0
    streamed = capsys.readouterr().out
    r = core.run(tiny, prompts=["hi"], max_new_tokens=5, chat=False, do_sample=True, seed=1)
    assert streamed == r.rows[0].text + "\n"
    assert main(["run", "--model", str(tiny), "--prompt", "hi", "--top-p", "2"]) == 2
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nagain\n"))
    assert main(["chat", "--model", str(tiny), "--max-new-tokens", "3", "--system", "s"]) == 0


def test_cli_stream_json_keeps_stdout_json_and_reports_rates_and_finish(tiny, capsys):
    """``run --stream --json``: stdout is the JSON document alone (the text streams to stderr);
    ``run --stream`` prints the same rates and finish line on stderr as ``run``."""
    import json

    from core.cli import main

    assert main(["run", "--model", str(tiny), "--prompt", "hi", "--max-new-tokens", "4", "--stream", "--raw",
                 "--json"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["rows"][0]["text"] and doc["rows"][0]["text"] in out.err
    assert main(["run", "--model", str(tiny), "--prompt", "hi", "--max-new-tokens", "4", "--stream",
                 "--raw"]) == 0
    err = capsys.readouterr().err
    assert "decode" in err and "finish: " in err


def test_a_system_prompt_with_raw_names_the_cli_flags(tiny, capsys):
    from core.cli import main

    assert main(["run", "--model", str(tiny), "--prompt", "x", "--raw", "--system", "Be brief."]) == 2
    err = capsys.readouterr().err
    assert "--system" in err and "--raw" in err


@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_row_that_fills_the_capacity_ends_while_another_decodes(runner, run_ahead):
    """Each row needs only its own prompt + max_new_tokens - 1 positions (check_prompts): a row
    that ends exactly at the capacity while another row decodes on is stepped in place (its KV
    past its end is never read), the other row equals its batch-1 run, and the full row cannot
    be continued (refused: no room) while the other can, equal to a fresh run."""
    long, short = list(range(30, 60)), [7, 8, 9]
    s = Session(runner, batch=2, capacity=32, run_ahead=run_ahead)
    g = s.stream([long, short], max_new_tokens=[3, 20])
    rows = [r.output_ids for r in g.run()]
    for b, (p, n) in enumerate([(long, 3), (short, 20)]):
        alone = Session(runner, batch=1, capacity=32).stream([p], max_new_tokens=n)
        assert alone.run()[0].output_ids == rows[b], b
    assert len(rows[1]) == 20
    with pytest.raises(RequestError, match="limit"):
        g.extend([[1], None])
    g.extend([None, [5, 6]], max_new_tokens=3)
    history = g.rows[1].prompt_ids
    continued = [r.output_ids for r in g.run()][1]
    assert continued == Session(runner, batch=1, capacity=32).stream([history], max_new_tokens=3).run()[0].output_ids
