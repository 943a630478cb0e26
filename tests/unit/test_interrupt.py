"""Ctrl-C keeps work: `lockstep run` prints the rows made so far with finish reason
"interrupted" (text and --json), and `lockstep chat` stops only the current reply, which stays
in the conversation as if it had ended there (core/generation/interrupt.py)."""

import io
import json
import os
import signal

import pytest

import core
from core.cli import build_parser, main
from core.generation.chat import Conversation
from core.generation.engine_run import EngineStream
from core.generation.stream import FINISH_REASONS, Generation
from core.session import RequestError, Session
from core.testing.tiny_model import make_tiny_model, write_byte_tokenizer

PROMPTS = ["hi", "name a colour"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_byte_tokenizer(make_tiny_model(tmp_path_factory.mktemp("interrupt") / "m"))


def _ctrl_c_after(monkeypatch, steps: int) -> None:
    """SIGINT to this process as the ``steps``-th step's tokens are read (prefill = 1)."""
    real = Generation._observe
    seen = []

    def observe(self, out):
        seen.append(1)
        if len(seen) == steps:
            os.kill(os.getpid(), signal.SIGINT)
        yield from real(self, out)

    monkeypatch.setattr(Generation, "_observe", observe)


def _ctrl_c_at_tokens(monkeypatch, tokens: int) -> None:
    """SIGINT to this process once a row of ``lockstep run`` (on the engine) has ``tokens``
    tokens; every row gets the tokens of the engine iteration it arrived in."""
    real = EngineStream._event

    def event(self, b, e):
        real(self, b, e)
        if len(self.rows[b].output_ids) == tokens and not self._signalled:
            self._signalled = True
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(EngineStream, "_signalled", False, raising=False)
    monkeypatch.setattr(EngineStream, "_event", event)


@pytest.mark.parametrize("stream", [False, True])
def test_run_keeps_the_rows_made_before_ctrl_c(tiny, capsys, monkeypatch, stream):
    full = core.run(tiny, prompts=PROMPTS, max_new_tokens=12, chat=False)
    assert all(r.finish_reason == "length" for r in full.rows)  # the reference ran to the end
    _ctrl_c_at_tokens(monkeypatch, 3)
    argv = ["run", "--model", str(tiny), "--raw", "--json", "--max-new-tokens", "12"]
    code = main(argv + [x for p in PROMPTS for x in ("--prompt", p)] + (["--stream"] if stream else []))
    doc = json.loads(capsys.readouterr().out)
    assert code == 130 and "interrupted" in FINISH_REASONS
    tok = core.load_model(tiny).tokenizer
    for got, ref in zip(doc["rows"], full.rows):
        assert got["finish_reason"] == "interrupted"
        assert got["output_ids"] == ref.output_ids[:3]  # the steps made, bitwise as an uninterrupted run
        assert got["text"] == tok.decode(ref.output_ids[:3])  # held-back text released


def test_run_prints_interrupted_rows_as_text_and_names_them(tiny, capsys, monkeypatch):
    ref = core.run(tiny, prompts=["hi"], max_new_tokens=2, chat=False).rows[0]
    _ctrl_c_at_tokens(monkeypatch, 2)
    code = main(["run", "--model", str(tiny), "--raw", "--max-new-tokens", "12", "--prompt", "hi"])
    out = capsys.readouterr()
    assert code == 130 and out.out == ref.text + "\n" and "finish: interrupted (2 tokens)" in out.err
    assert "kept the 2 tokens made so far" in out.err


def test_an_interrupted_reply_stays_in_the_conversation_like_one_that_ended_there(tiny):
    """Stopping a reply after 3 tokens leaves the same conversation and KV cache as a reply
    that ended at 3 tokens: the next turn is bitwise the same."""
    def talk(stop_early: bool):
        s = Session(core.load_model(tiny), batch=1)
        c = Conversation(s, max_new_tokens=12 if stop_early else 3)
        deltas = c.say("hello")
        ids = []
        for d in deltas:
            ids += d.token_ids
            if stop_early and len(ids) == 3:
                deltas.close()
                c.interrupt()
                break
        assert c.generation.rows[0].finish_reason == ("interrupted" if stop_early else "length")
        c.max_new_tokens = 6
        second = [t for d in c.say("more") for t in d.token_ids]
        return ids, c.messages, second

    stopped, ended = talk(True), talk(False)
    assert stopped == ended and [m["role"] for m in stopped[1]] == ["user", "assistant", "user", "assistant"]


def test_interrupt_before_the_prefill_is_refused_and_changes_nothing(tiny):
    s = Session(core.load_model(tiny), batch=1, capacity=32)
    gen = s.stream([[1, 2, 3]], 4)
    with pytest.raises(RequestError, match="after the prefill"):
        gen.interrupt()
    assert gen.run()[0].finish_reason == "length" and len(gen.rows[0].output_ids) == 4


def test_chat_ctrl_c_stops_the_reply_and_the_next_line_is_answered(tiny, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nmore\n\n"))
    _ctrl_c_after(monkeypatch, 2)
    code = main(["chat", "--model", str(tiny), "--max-new-tokens", "8"])
    out = capsys.readouterr()
    assert code == 0 and out.err.count("reply stopped; the conversation goes on") == 1
    assert "interrupted" not in out.err.replace("reply stopped", "")
    assert out.out.count("\n") == 2  # both turns answered


def test_chat_help_names_the_commands_the_empty_line_and_ctrl_c():
    chat = build_parser()._subparsers._group_actions[0].choices["chat"]  # type: ignore[union-attr]
    text = chat.format_help()
    for word in ("/reset", "/exit", "empty line", "Ctrl-C", "Ctrl-D"):
        assert word in text
