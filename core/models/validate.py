"""Load-time checks of a model folder beyond the graph's inputs and outputs
(:func:`core.models.model.check_graph`): every field of genai_config.json the runtime reads,
the graph's references and its rotary cache. A folder that passes them does not fail later
with a raw ``KeyError``, ``IndexError`` or ``TypeError``; one that fails gets a
:class:`~core.models.model.ModelError` naming the file and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeGuard

import onnx

#: Integer fields of genai_config.json (path in the file) that must be positive.
SIZES = ("model.vocab_size", "model.context_length", "model.decoder.num_hidden_layers",
         "model.decoder.num_attention_heads", "model.decoder.num_key_value_heads", "model.decoder.head_size",
         "model.decoder.hidden_size")


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config_fields(data: Any) -> None:
    """The types and ranges of genai_config.json's fields, before they are read.

    Raises:
        ValueError: the first bad field, named by its path (``model.eos_token_id``, ...); the
            caller adds the file's path (a ModelError).
    """
    if not isinstance(data, dict):
        raise ValueError("it must hold a JSON object")
    if "model" not in data:
        raise KeyError("model")
    m = data["model"]
    if not isinstance(m, dict):
        raise ValueError("model must be an object")
    if "decoder" not in m:
        raise KeyError("decoder")
    if not isinstance(m["decoder"], dict):
        raise ValueError("model.decoder must be an object")
    d = m["decoder"]
    for path in SIZES:
        parent, key = (d, path.rsplit(".", 1)[1]) if path.startswith("model.decoder.") else (m, path.split(".")[1])
        if key not in parent:
            raise KeyError(key)
        if not _is_int(parent[key]) or parent[key] < 1:
            raise ValueError(f"{path} must be a positive integer, got {parent[key]!r}")
    vocab: int = m["vocab_size"]
    eos = m.get("eos_token_id", m.get("pad_token_id", 0))
    ids = eos if isinstance(eos, list) else [eos]
    if not ids or not all(_is_int(t) and 0 <= t < vocab for t in ids):
        raise ValueError(f"model.eos_token_id must be a token id in [0, {vocab}) or a non-empty list of them, "
                         f"got {eos!r}")
    pad = m.get("pad_token_id", ids[0])
    if not _is_int(pad) or not 0 <= pad < vocab:
        raise ValueError(f"model.pad_token_id must be a token id in [0, {vocab}), got {pad!r}")
    if not isinstance(d.get("filename", "model.onnx"), str) or not d.get("filename", "model.onnx"):
        raise ValueError(f"model.decoder.filename must be a file name, got {d.get('filename')!r}")
    for key in ("inputs", "outputs"):
        group = d.get(key) or {}
        if not isinstance(group, dict):
            raise ValueError(f"model.decoder.{key} must be an object of tensor names, got {group!r:.60}")
        bad = [k for k, v in group.items() if not isinstance(v, str)]
        if bad:
            raise ValueError(f"model.decoder.{key}.{bad[0]} must be a tensor name, got {group[bad[0]]!r:.60}")
    search = data.get("search")
    if search is not None and not isinstance(search, dict):
        raise ValueError(f"search must be an object, got {search!r:.60}")
    from core.generation.sampling import SamplingError, search_defaults

    try:
        search_defaults(search)
    except SamplingError as exc:
        raise ValueError(f"search: {exc}") from None


def check_references(graph: onnx.GraphProto, path: Path | str) -> None:
    """Every tensor a node reads is a graph input, an initializer or another node's output
    (an initializer lost from the file, e.g. external data not written, would be a KeyError
    at the first run).

    Raises:
        core.models.model.ModelError: names the file, the node and the missing tensors.
    """
    from core.models.model import ModelError, _names

    known = {vi.name for vi in graph.input} | {t.name for t in graph.initializer} | {""}
    known |= {o for n in graph.node for o in n.output}
    for node in graph.node:
        missing = [x for x in node.input if x not in known]
        if missing:
            raise ModelError(f"{path}: node {node.name or node.op_type} reads {_names(missing)}, which no "
                             "initializer, graph input or node provides (missing weights or external data?)")


def check_rotary(graph: onnx.GraphProto, context_length: int, path: Path | str, config_path: Path | str) -> None:
    """The rotary cos/sin caches of every GroupQueryAttention node hold ``context_length``
    positions (a shorter cache would fail part way through decoding).

    Raises:
        core.models.model.ModelError: names genai_config.json's context_length and the cache.
    """
    from core.models.model import ModelError

    shapes = {t.name: list(t.dims) for t in graph.initializer}
    for node in graph.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) < 9:
            continue
        for name in node.input[7:9]:
            dims = shapes.get(name)
            rows = dims[0] if dims else None
            if rows is not None and rows < context_length:
                raise ModelError(f"{config_path}: model.context_length is {context_length}, but the rotary cache "
                                 f"{name} of {path} holds {rows} positions; lower context_length to {rows}")
