"""The errors a user can cause, shown by the CLI as one line (no traceback)."""

from core.executor import KernelOutputError, UnsupportedOpError
from core.models.cache import CacheError
from core.models.model import ModelError
from core.models.prepare import PrepareError
from core.plugins import ProviderError
from core.runtime.kv import KVFullError, KVLayoutError
from core.runtime.residency import BudgetError
from core.session import RequestError

#: KernelOutputError is a provider bug, not a user's: it is still one line naming the node and
#: the kernel, which is what the provider's author needs.
USER_ERRORS = (RequestError, ProviderError, ModelError, PrepareError, UnsupportedOpError, KVLayoutError,
               KVFullError, BudgetError, KernelOutputError, CacheError)
