"""A conversation over one session row: each user turn continues the row's KV cache.

:class:`Conversation` keeps the messages and a :class:`~core.generation.stream.Generation`.
The first turn prefills the chat template's rendering of the messages; every later turn
appends only what the template adds after the history the row already holds (the end of the
assistant turn and the new user turn), found by rendering the whole conversation and removing
the decoded history (special tokens kept) from its front. When the template does not render
the history as a prefix (a template that rewrites earlier turns), the turn starts afresh from
the full rendering instead (counted in :attr:`Conversation.refills`). A reply stopped early
(:meth:`Conversation.interrupt`, Ctrl-C in ``lockstep chat``) stays in the conversation as far
as it got. ``lockstep chat`` is a loop over :meth:`Conversation.say`.
"""

from __future__ import annotations

from typing import Any, Generator

from core.generation.stream import Delta, Generation


class Conversation:
    """A chat with the model on a session of batch 1.

    Args:
        session: a :class:`~core.session.Session` with ``batch == 1`` (a growing KV cache lets
            the conversation run up to the model context).
        system: the system prompt (None: the template's default, if it has one).
        max_new_tokens: the most tokens per reply.
        sampling: sampling options for every reply (see :mod:`core.generation.sampling`).

    Raises:
        core.session.RequestError: batch != 1, or the model has no tokenizer.
        core.models.model.ModelError: the model has no chat template.
    """

    def __init__(self, session, system: str | None = None, max_new_tokens: int = 256, sampling: Any = None):
        from core.session import RequestError

        if session.batch != 1:
            raise RequestError(f"a conversation runs on a session of batch 1, not {session.batch}")
        tok = session.model.tokenizer
        if tok is None:
            raise RequestError("chat needs a tokenizer; this model has no tokenizer.json")
        tok.render_chat([{"role": "user", "content": "x"}])  # ModelError now if there is no template
        self.session, self.tokenizer = session, tok
        self.messages: list[dict] = [] if system is None else [{"role": "system", "content": system}]
        self.max_new_tokens = max_new_tokens
        self.sampling = session.check_sampling(sampling)
        self.generation: Generation | None = None
        self.refills = 0

    def history_ids(self) -> list[int]:
        """Every token of the conversation the row holds (the last reply included)."""
        return [] if self.generation is None else self.generation.rows[0].history

    def say(self, text: str) -> Generator[Delta, None, None]:
        """Add a user turn and stream the reply; the reply joins :attr:`messages` when it ends.

        Raises:
            core.session.RequestError: empty text, or the conversation outgrows the KV limit.
        """
        from core.generation.generate import check_messages

        messages = check_messages(0, self.messages + [{"role": "user", "content": text}])
        if not text.strip():
            from core.session import RequestError

            raise RequestError("say() needs some text")
        full = self.tokenizer.render_chat(messages)
        gen = self.generation
        held = self.tokenizer.decode(self.history_ids(), skip_special_tokens=False) if gen else ""
        if gen is not None and full.startswith(held):
            gen.extend([self.tokenizer.encode(full[len(held):])], self.max_new_tokens, self.sampling)
        else:
            if gen is not None:
                self.refills += 1
            gen = Generation(self.session, [self.tokenizer.encode(full)], self.max_new_tokens, self.sampling)
            self.generation = gen
        self.messages = messages
        yield from gen
        self.messages.append({"role": "assistant", "content": gen.rows[0].text})

    def interrupt(self) -> list[Delta]:
        """Stop the reply :meth:`say` is streaming (close that iterator first) between decode
        steps: the partial reply joins :attr:`messages` and the conversation goes on from it.
        Returns the reply's last delta (text held back until then), or [] when no reply runs.

        Raises:
            core.session.RequestError: the reply has no token yet (see
                :meth:`~core.generation.stream.Generation.interrupt`).
        """
        gen = self.generation
        if gen is None or gen.rows[0].finish_reason is not None:
            return []
        out = gen.interrupt()
        self.messages.append({"role": "assistant", "content": gen.rows[0].text})
        return out
