"""Pure token-level functions on (batch, T) tensors: no models, no I/O."""
