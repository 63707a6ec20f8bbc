"""The controller's distributed utilities: the process-group primitives of
``creditrl.workers.distributed`` (defined there because the workers use them too)."""

from creditrl.workers.distributed import *  # noqa: F403
from creditrl.workers.distributed import __all__  # noqa: F401
