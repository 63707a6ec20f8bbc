"""The Batch container, its field catalogue, and pickle-free serialization."""

from creditrl.batch.batch import Batch, pad_to_divisor, unpad
from creditrl.batch.fields import FIELDS, FieldSpec, describe, require

__all__ = ["FIELDS", "Batch", "FieldSpec", "describe", "pad_to_divisor", "require", "unpad"]
