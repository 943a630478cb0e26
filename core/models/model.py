"""Model loading: an ONNX Runtime GenAI builder folder.

A folder holds ``genai_config.json`` (docs/ops.md 6.1), ``model.onnx`` (+ external data),
``tokenizer.json`` and ``tokenizer_config.json`` with the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import numpy as np
import onnx
from onnx import numpy_helper


class ModelError(ValueError):
    """The model folder is missing, incomplete or malformed; the message names the file."""


@attrs.frozen
class ModelConfig:
    """Fields of genai_config.json the decode loop needs (docs/ops.md 6.1).

    Attributes:
        num_layers, num_heads, num_kv_heads, head_size, hidden_size, vocab_size: geometry.
        context_length: the model's maximum sequence length (tokens).
        eos_token_ids: tokens that end a row.
        pad_token_id: token used for right padding.
        past_key, past_value, present_key, present_value: name patterns with ``%d``.
        search: the "search" section (generation defaults: do_sample, temperature, top_k, ...).
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    past_key: str = "past_key_values.%d.key"
    past_value: str = "past_key_values.%d.value"
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"
    search: dict = attrs.field(factory=dict, eq=False)

    @classmethod
    def from_json(cls, data: dict) -> ModelConfig:
        """Parse a genai_config.json dict (docs/ops.md 6.1); raises KeyError/ValueError if malformed."""
        m = data["model"]
        d = m["decoder"]
        eos = m.get("eos_token_id", m.get("pad_token_id", 0))
        eos = tuple(eos) if isinstance(eos, list) else (int(eos),)
        ins, outs = d.get("inputs", {}), d.get("outputs", {})
        names = {key: group.get(key, getattr(cls, attr)) for group, key, attr in (
            (ins, "past_key_names", "past_key"), (ins, "past_value_names", "past_value"),
            (outs, "present_key_names", "present_key"), (outs, "present_value_names", "present_value"))}
        for key, pattern in names.items():
            if not isinstance(pattern, str) or pattern.count("%d") != 1:
                raise ValueError(f"{key} must be a name pattern with one %d, got {pattern!r}")
        return cls(
            num_layers=int(d["num_hidden_layers"]), num_heads=int(d["num_attention_heads"]),
            num_kv_heads=int(d["num_key_value_heads"]), head_size=int(d["head_size"]),
            hidden_size=int(d["hidden_size"]), vocab_size=int(m["vocab_size"]),
            context_length=int(m["context_length"]), eos_token_ids=eos,
            pad_token_id=int(m.get("pad_token_id", eos[0])),
            past_key=names["past_key_names"], past_value=names["past_value_names"],
            present_key=names["present_key_names"], present_value=names["present_value_names"],
            search=dict(data.get("search") or {}),
        )


class Tokenizer:
    """tokenizers.Tokenizer plus the jinja2 chat template from tokenizer_config.json."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = folder / "tokenizer.json"
        if not path.exists():
            raise ModelError(f"model folder {folder} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise ModelError(f"cannot read {path}: {exc}") from exc
        cfg_path = folder / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        except ValueError as exc:
            raise ModelError(f"cannot read {cfg_path}: {exc}") from exc
        if not isinstance(cfg, dict):
            raise ModelError(f"{cfg_path} must hold a JSON object")
        template = cfg.get("chat_template")
        jinja_path = folder / "chat_template.jinja"
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        self._template = None
        if template is not None:
            import jinja2

            try:
                self._template = _environment().from_string(template)
            except jinja2.TemplateError as exc:
                source = jinja_path if jinja_path.exists() and cfg.get("chat_template") is None else cfg_path
                raise ModelError(f"chat template in {source} does not parse: {exc}") from exc
        self.chat_template: str | None = template
        self.bos_token = cfg.get("bos_token")
        self.eos_token = cfg.get("eos_token")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added; templates carry their own)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of token ids (special tokens skipped unless asked)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, prompt: str) -> str:
        """The prompt as one user turn, rendered with the model's jinja2 template.

        Raises:
            ModelError: the model has no chat template (use raw mode).
        """
        return self.render_chat([{"role": "user", "content": prompt}])

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Chat ``messages`` (``{"role", "content"}`` dicts; a "system" one first replaces the
        template's default system prompt) rendered with the model's jinja2 template, as
        transformers' ``apply_chat_template(tokenize=False)`` does.

        Raises:
            ModelError: the model has no chat template (use raw mode), or the template raised.
        """
        if not self.chat_template or self._template is None:
            raise ModelError("this model has no chat template; pass chat=False (CLI: --raw)")
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=_token_text(self.bos_token), eos_token=_token_text(self.eos_token))

    def token_id(self, token) -> int | None:
        """The id of a token given as text (or a tokenizer_config dict with "content"), or None."""
        text = _token_text(token)
        return self._tok.token_to_id(text) if text else None


def _environment():
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.globals["raise_exception"] = _raise_template_error
    return env


def _token_text(tok) -> str:
    if isinstance(tok, dict):
        return tok.get("content", "")
    return tok or ""


def _raise_template_error(message: str):
    raise ModelError(f"chat template error: {message}")


@attrs.define
class Model:
    """A loaded builder model.

    Attributes:
        folder: the model folder.
        config: :class:`ModelConfig` from genai_config.json.
        graph: the ONNX GraphProto (initializer data loaded from external files).
        initializers: name -> numpy array of every initializer.
        io_dtype: numpy dtype of the KV cache and logits (float32 or float16).
        tokenizer: :class:`Tokenizer`, or None when the folder has no tokenizer.json.
    """

    folder: Path
    config: ModelConfig
    graph: onnx.GraphProto
    initializers: dict
    io_dtype: np.dtype
    tokenizer: Tokenizer | None

    def weight_bytes(self) -> int:
        """Bytes of all initializers (the weights one decode step reads)."""
        return sum(int(a.nbytes) for a in self.initializers.values())


def load_model(folder: str | Path) -> Model:
    """Load a builder folder.

    Raises:
        ModelError: the folder, genai_config.json, the ONNX file or its external data is
            missing or unreadable (the message names which).
    """
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ModelError(f"{folder} is a file; a model is a folder (genai_config.json, model.onnx, ...)")
    if not folder.is_dir():
        raise ModelError(f"model folder not found: {folder}")
    cfg_path = folder / "genai_config.json"
    if not cfg_path.exists():
        raise ModelError(f"{folder} is not a builder model folder: genai_config.json is missing")
    try:
        data = json.loads(cfg_path.read_text())
        config = ModelConfig.from_json(data)
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelError(f"{cfg_path} is malformed: {exc!r}") from exc
    onnx_name = data["model"]["decoder"].get("filename", "model.onnx")
    onnx_path = folder / onnx_name
    if not onnx_path.exists():
        raise ModelError(f"model file missing: {onnx_path}")
    try:
        proto = onnx.load(str(onnx_path), load_external_data=True)
    except Exception as exc:  # noqa: BLE001 - onnx raises several kinds
        raise ModelError(f"cannot read {onnx_path} (or its external data): {exc}") from exc
    graph = proto.graph
    initializers = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    io_dtype = np.dtype(np.float32)
    for vi in graph.output:
        if vi.name == "logits":
            io_dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
    for vi in graph.input:
        if vi.name == config.past_key % 0:
            io_dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
    tokenizer = Tokenizer(folder) if (folder / "tokenizer.json").exists() else None
    return Model(folder, config, graph, initializers, np.dtype(io_dtype), tokenizer)
