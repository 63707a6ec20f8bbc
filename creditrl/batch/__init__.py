"""The Batch container, its field catalogue, and pickle-free serialization."""

from creditrl.batch.balance import BalancedBatch, balance_batch, invert_permutation
from creditrl.batch.batch import Batch, pad_to_divisor, unpad
from creditrl.batch.fields import FIELDS, FieldSpec, describe, require
from creditrl.batch.rollout import assemble_rollout_batch, position_ids_from_mask

__all__ = [
    "FIELDS",
    "BalancedBatch",
    "Batch",
    "FieldSpec",
    "assemble_rollout_batch",
    "balance_batch",
    "describe",
    "invert_permutation",
    "pad_to_divisor",
    "position_ids_from_mask",
    "require",
    "unpad",
]
