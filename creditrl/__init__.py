"""creditrl: reinforcement learning for language models, exact to the token."""

__version__ = "0.1.0"
