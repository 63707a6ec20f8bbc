"""The controller's distributed utilities: the process-group primitives of
``creditrl.workers.distributed`` (defined there because the workers use them too)."""

from creditrl.workers.distributed import (
    all_reduce_gradients,
    all_reduce_sum,
    broadcast_bytes,
    destroy_process_group,
    init_process_group,
    is_distributed,
    rank,
    scatter_batches,
    world_size,
)

__all__ = [
    "all_reduce_gradients",
    "all_reduce_sum",
    "broadcast_bytes",
    "destroy_process_group",
    "init_process_group",
    "is_distributed",
    "rank",
    "scatter_batches",
    "world_size",
]
