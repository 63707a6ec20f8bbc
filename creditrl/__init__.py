"""creditrl: reinforcement learning for language models, exact to the token."""

from creditrl.batch import Batch

__all__ = ["Batch", "__version__"]
__version__ = "0.1.0"
