"""Streaming text with the real SmolLM2 tokenizer: emoji and CJK arrive as several byte-level
tokens; the incremental detokenizer releases each character once, whole, and the deltas add up to
the final decode (also under a stop-string holdback)."""

import pytest

from core.generation.stream import IncrementalDetokenizer

TEXTS = [
    "東京は日本の首都です。",
    "Party time 🎉🥳 with family 👨‍👩‍👧‍👦 and flags 🇫🇷!",
    "混合 text: 한국어, Ελληνικά, emoji 👍🏽 and ∑ math",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("holdback", [0, 3])
def test_deltas_add_up_to_the_decode(fp32_model, text, holdback):
    tok = fp32_model.tokenizer
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, holdback)
    parts = [d.push(t) for t in ids] + [d.finish()]
    assert "".join(parts) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in parts)
    assert sum(1 for p in parts[:-1] if not p) > 0  # some token completed no character


def test_streamed_run_equals_the_result(fp32_model_dir):
    import core

    st = core.stream(fp32_model_dir, prompts=["Say hi in Japanese."], max_new_tokens=8)
    text = "".join(d.text for d in st)
    row = st.result().rows[0]
    assert text == row.text and row.output_ids
