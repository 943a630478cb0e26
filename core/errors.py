"""The errors a user can cause, shown by the CLI as one line (no traceback).

A leaf module: it imports nothing from Lockstep, so every module can raise these without an
import circle. The modules that raised them before (``core.session``, ``core.runtime.kv``, ...)
re-export them under their old names; ``core.session.RequestError is core.errors.RequestError``.
"""


class RequestError(ValueError):
    """A request the session refuses before any kernel runs; the session stays usable."""

class StaleGenerationError(RequestError):
    """A generation was resumed (iterated or extended) after another request started on its
    session: the session's KV cache no longer holds its rows. Nothing ran; the session and
    the newer request are unharmed."""

class ProviderError(RuntimeError):
    """A provider cannot be found or created; the message says why and what is available."""

class ModelError(ValueError):
    """The model folder is missing, incomplete or malformed; the message names the file."""

class PrepareError(RuntimeError):
    """The model cannot be prepared; the message says which step failed and how to fix it."""

class CacheError(ValueError):
    """A ``clean`` target that names nothing in the cache (the message lists what is there)."""

class UnsupportedOpError(ValueError):
    """The provider cannot run some nodes of the graph; the message lists op types and nodes."""

class KernelOutputError(RuntimeError):
    """A kernel returned something other than its node's declared outputs (not a tuple, a
    wrong count, None for a used output, or a dtype / rank the graph does not declare); the
    message names the node, its op type and the kernel."""

class KVLayoutError(ValueError):
    """A layout/policy/batch combination that cannot work (named in the message)."""

class KVFullError(ValueError):
    """A step needs more KV positions than the cache may hold (its limit is in the message)."""

class BudgetError(ValueError):
    """A weight budget that cannot work (too small for the always-resident weights plus the
    staging ring, or malformed); the message gives the bytes needed."""


#: KernelOutputError is a provider bug, not a user's: it is still one line naming the node and
#: the kernel, which is what the provider's author needs.
USER_ERRORS = (RequestError, ProviderError, ModelError, PrepareError, UnsupportedOpError, KVLayoutError,
               KVFullError, BudgetError, KernelOutputError, CacheError)
