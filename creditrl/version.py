"""creditrl's version, in a module of its own so that any module can read it without importing
the package's lazy attributes (``creditrl.__version__`` re-exports it)."""

__version__ = "0.1.0"
