"""Lockstep core: batch-N decoding of ONNX Runtime GenAI builder models on pluggable providers.

    >>> import core
    >>> result = core.run("path/to/model", provider="cpu_reference", prompts=["Hi"], max_new_tokens=8)
    >>> result.rows[0].text

Public API: :func:`run`, :func:`stream`, :class:`Session`, :class:`Runner`, :func:`load_model`,
:func:`prepare`, the provider protocol (:mod:`core.protocol`) and the plugin hooks
(:mod:`core.hookspecs`, :data:`hookimpl`).
"""

from importlib import metadata as _metadata

from core.executor import UnsupportedOpError
from core.generation.generate import Result, Row, Stream, generate, run, stream
from core.generation.sampling import SamplingParams
from core.generation.stream import Delta, Generation
from core.hookspecs import ProviderSpec, hookimpl
from core.models.model import ModelError, load_model
from core.models.prepare import PrepareError, Variant, prepare
from core.plugins import ProviderError, get_provider, registry
from core.protocol import PROTOCOL_VERSION, Capabilities, ExecutionProvider, KernelContext, NodeInfo
from core.runtime.kv import KVLayoutError
from core.runtime.residency import BudgetError
from core.runtime.runner import Runner
from core.session import RequestError, Session, StaleGenerationError

try:
    __version__ = _metadata.version("lockstep")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.1.0+source"

__all__ = [
    "run", "stream", "generate", "Result", "Row", "Stream", "Delta", "Generation", "SamplingParams",
    "Session", "Runner", "BudgetError", "load_model", "prepare", "Variant",
    "get_provider", "registry", "hookimpl", "ProviderSpec", "Capabilities", "ExecutionProvider",
    "KernelContext", "NodeInfo", "PROTOCOL_VERSION", "RequestError", "StaleGenerationError", "ProviderError",
    "ModelError", "PrepareError", "UnsupportedOpError", "KVLayoutError",
]
