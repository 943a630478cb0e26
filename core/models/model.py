"""Model loading: an ONNX Runtime GenAI builder folder.

A folder holds ``genai_config.json`` (docs/ops.md 6.1), ``model.onnx`` (+ external data),
``tokenizer.json`` and ``tokenizer_config.json`` with the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from core.errors import ModelError  # noqa: F401 (re-exported)
from core.models import validate


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
        except (ValueError, OSError) as exc:  # OSError: a folder of that name, unreadable
            raise ModelError(f"cannot read {cfg_path}: {exc}") from exc
        if not isinstance(cfg, dict):
            raise ModelError(f"{cfg_path} must hold a JSON object")
        for key in ("bos_token", "eos_token"):
            tok = cfg.get(key)
            if not (tok is None or isinstance(tok, str) or (isinstance(tok, dict)
                                                              and isinstance(tok.get("content", ""), str))):
                raise ModelError(f"{cfg_path}: {key} must be a token's text (or an object with 'content'), "
                                 f"got {tok!r:.60}")
        template = _default_template(cfg.get("chat_template"), cfg_path)
        jinja_path = folder / "chat_template.jinja"
        if template is None and jinja_path.is_file():
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
        import jinja2

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=_token_text(self.bos_token), eos_token=_token_text(self.eos_token))
        except ModelError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ModelError(f"the model's chat template failed to render: {type(exc).__name__}: {exc}") from exc

    def token_id(self, token) -> int | None:
        """The id of a token given as text (or a tokenizer_config dict with "content"), or None."""
        text = _token_text(token)
        return self._tok.token_to_id(text) if text else None


def _default_template(template: Any, path: Path) -> str | None:
    """The chat template of tokenizer_config.json: a string, or from the list of named
    templates Hugging Face writes (``[{"name": "default", "template": ...}, ...]``) the one
    named "default" (as transformers picks it).

    Raises:
        ModelError: any other form, or a list without a "default" entry.
    """
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                          and isinstance(t.get("template"), str) for t in template):
        named = {t["name"]: t["template"] for t in template}
        if "default" in named:
            return named["default"]
        raise ModelError(f"{path}: chat_template lists templates {sorted(named)} but none named 'default'")
    raise ModelError(f"{path}: chat_template must be a string or a list of {{'name', 'template'}} objects, "
                     f"got {template!r:.60}")


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
        graph: the ONNX GraphProto (external initializer data not loaded: only their headers).
        initializers: name -> numpy array of every initializer (read-only memory maps of the
            external data file, :func:`tensor_array`).
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
        raise ModelError(f"{folder} is not a builder model folder: genai_config.json is missing (make one with "
                         "`lockstep prepare NAME`, or give the folder the ONNX Runtime GenAI builder wrote)")
    try:
        data = json.loads(cfg_path.read_text())
        validate.check_config_fields(data)
        config = ModelConfig.from_json(data)
    except KeyError as exc:  # a missing key: name it, as the builder writes it
        raise ModelError(f"{cfg_path} is malformed: it has no {exc.args[0]!r} entry where the ONNX Runtime "
                         "GenAI builder writes one (model, model.decoder, and their sizes)") from exc
    except (ValueError, TypeError, OSError) as exc:
        raise ModelError(f"{cfg_path} is malformed: {exc}") from exc
    onnx_name = data["model"]["decoder"].get("filename", "model.onnx")
    onnx_path = folder / onnx_name
    from core.models.prepare import rebuild_hint

    if not onnx_path.is_file():
        raise ModelError(f"model file missing: {onnx_path}; {rebuild_hint(folder)}")
    if onnx_path.stat().st_size == 0:
        raise ModelError(f"{onnx_path} is empty (0 bytes: an interrupted build or copy?); {rebuild_hint(folder)}")
    try:
        proto = onnx.load(str(onnx_path), load_external_data=False)
        graph = proto.graph
        check_graph(graph, config, data["model"]["decoder"], onnx_path)
        validate.check_references(graph, onnx_path)
        validate.check_rotary(graph, config.context_length, onnx_path, cfg_path)
        initializers = {t.name: tensor_array(t, onnx_path.parent) for t in graph.initializer}
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - onnx and numpy raise several kinds
        raise ModelError(f"the model folder {folder} is damaged (an interrupted build or copy?): {onnx_name} or "
                         f"its external data cannot be read ({exc}); {rebuild_hint(folder)}") from exc
    io_dtype = np.dtype(np.float32)
    for vi in graph.output:
        if vi.name == "logits":
            io_dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
    for vi in graph.input:
        if vi.name == config.past_key % 0:
            io_dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
    tokenizer = Tokenizer(folder) if (folder / "tokenizer.json").exists() else None
    return Model(folder, config, graph, initializers, np.dtype(io_dtype), tokenizer)


def external_location(tensor: onnx.TensorProto) -> tuple[str, int, int | None] | None:
    """(file, byte offset, byte length or None) of a tensor stored in external data, read from
    its ``external_data`` entries (onnx external data spec); None for a tensor stored inline."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in tensor.external_data}
    length = info.get("length")
    return info["location"], int(info.get("offset", 0)), None if length is None else int(length)


def tensor_nbytes(tensor: onnx.TensorProto) -> int:
    """Bytes of an initializer's values from its header alone (dims and data type; nothing read)."""
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
    return int(np.prod(tensor.dims, dtype=np.int64)) * dtype.itemsize


def tensor_array(tensor: onnx.TensorProto, folder: Path) -> np.ndarray:
    """An initializer's values: a read-only memory map of its bytes in the external data file
    (nothing is read until a page is touched, and the page cache is shared, so a weight that
    goes straight to pinned host memory or the device is never held twice), else the inline
    values (:func:`onnx.numpy_helper.to_array`).

    Raises:
        ModelError: the external file is missing or shorter than the tensor.
    """
    where = external_location(tensor)
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
    if where is None or dtype.kind not in "biuf":
        if where is not None:
            external_data_helper.load_external_data_for_tensor(tensor, str(folder))
        return numpy_helper.to_array(tensor)
    name, offset, length = where
    path = folder / name
    shape = tuple(int(d) for d in tensor.dims)
    nbytes = tensor_nbytes(tensor)
    if not path.is_file():
        raise ModelError(f"external data file missing: {path} (tensor {tensor.name!r})")
    if (length is not None and length < nbytes) or path.stat().st_size < offset + nbytes:
        raise ModelError(f"{path} is too short for tensor {tensor.name!r} ({nbytes:,} bytes at offset {offset:,}): "
                         "an interrupted build or copy?")
    if nbytes == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape or (1,)).reshape(shape)


#: Graph input and output names the runtime binds (docs/ops.md 6.1); genai_config.json must name these.
BOUND_NAMES = {"input_ids": "input_ids", "attention_mask": "attention_mask", "logits": "logits"}
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def _dims(vi: onnx.ValueInfoProto) -> list[int | str] | None:
    """The declared shape of a graph input/output: ints for fixed axes, names (or "?") for the
    others; None when no shape is declared."""
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]


def check_graph(graph: onnx.GraphProto, config: ModelConfig, decoder: dict, path: Path | str = "model.onnx") -> None:
    """Check the graph's inputs and outputs against genai_config.json before anything is planned.

    Every graph input must be one the runtime feeds: ``input_ids`` and ``attention_mask``
    (int64 ``[batch, sequence]``) and ``past_key_values.%d.key/value`` for each layer (fp32 or
    fp16, rank 4, ``num_key_value_heads`` and ``head_size`` where the axes are fixed). The
    outputs must hold ``logits`` (fp32/fp16 ``[batch, sequence, vocab]``, the vocab axis equal
    to ``vocab_size`` when fixed) and ``present.%d.key/value`` for each layer.

    Raises:
        ModelError: the first mismatch, naming the graph file, the tensor and what was expected.
    """
    where = f"{path} does not match genai_config.json (is it a decoder written by the model builder?)"
    ins, outs = decoder.get("inputs", {}) or {}, decoder.get("outputs", {}) or {}
    for key, name in BOUND_NAMES.items():
        declared = (outs if key == "logits" else ins).get(key, name)
        if declared != name:
            raise ModelError(f"{path}: genai_config.json names the {key} tensor {declared!r}; Lockstep binds {name!r}")
    graph_in = {vi.name: vi for vi in graph.input}
    graph_out = {vi.name: vi for vi in graph.output}
    n = config.num_layers
    kv_in = [config.past_key % i for i in range(n)] + [config.past_value % i for i in range(n)]
    kv_out = [config.present_key % i for i in range(n)] + [config.present_value % i for i in range(n)]
    missing = [x for x in ["input_ids", "attention_mask", *kv_in] if x not in graph_in]
    if missing:
        raise ModelError(f"{where}: graph inputs missing: {_names(missing)}")
    extra = [x for x in graph_in if x not in {"input_ids", "attention_mask", *kv_in}]
    if extra:
        raise ModelError(f"{where}: graph inputs the runtime does not feed: {_names(extra)} "
                         f"(it feeds input_ids, attention_mask and {n} layers of past key/value)")
    missing = [x for x in ["logits", *kv_out] if x not in graph_out]
    if missing:
        raise ModelError(f"{where}: graph outputs missing: {_names(missing)}")

    def check(vi: onnx.ValueInfoProto, dtypes: tuple, dtype_text: str, rank: int, fixed: dict[int, int],
              axes: str) -> None:
        elem = vi.type.tensor_type.elem_type
        if elem not in dtypes:
            got = onnx.TensorProto.DataType.Name(elem) if elem else "no type"
            raise ModelError(f"{where}: {vi.name} is {got}, expected {dtype_text}")
        dims = _dims(vi)
        if dims is None or len(dims) != rank:
            raise ModelError(f"{where}: {vi.name} has shape {dims}, expected rank {rank} {axes}")
        for axis, want in fixed.items():
            if isinstance(dims[axis], int) and dims[axis] != want:
                raise ModelError(f"{where}: {vi.name} has shape {dims}, expected {axes} with axis {axis} = {want}")

    for name in ("input_ids", "attention_mask"):
        check(graph_in[name], (onnx.TensorProto.INT64,), "int64", 2, {}, "[batch, sequence]")
    kv_dtype = graph_in[kv_in[0]].type.tensor_type.elem_type
    kv_axes = {1: config.num_kv_heads, 3: config.head_size}
    for vi in [graph_in[x] for x in kv_in] + [graph_out[x] for x in kv_out]:
        check(vi, _FLOATS, "float32 or float16", 4, kv_axes, "[batch, kv heads, positions, head size]")
        if vi.type.tensor_type.elem_type != kv_dtype:
            raise ModelError(f"{where}: {vi.name} and {kv_in[0]} have different dtypes")
    logits = graph_out["logits"]
    check(logits, _FLOATS, "float32 or float16", 3, {}, "[batch, sequence, vocab]")
    dims = _dims(logits)
    vocab = dims[-1] if dims else None  # rank 3, checked above
    if vocab != config.vocab_size:
        raise ModelError(f"{where}: the vocab axis of logits is {vocab!r}, genai_config.json says "
                         f"vocab_size {config.vocab_size}")


def _names(names: list[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
