"""The errors a user can cause, shown by the CLI as one line (no traceback)."""

from core.executor import UnsupportedOpError
from core.runtime.kv import KVLayoutError
from core.models.model import ModelError
from core.plugins import ProviderError
from core.models.prepare import PrepareError
from core.session import RequestError

USER_ERRORS = (RequestError, ProviderError, ModelError, PrepareError, UnsupportedOpError, KVLayoutError)
