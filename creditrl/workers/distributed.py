"""torch.distributed among the ranks of a worker group: set-up, data-parallel reductions, and
Batch transfer as safetensors bytes (never pickle).

Every function is a no-op (or the identity) when no process group is initialised, so the
workers run unchanged in one process. The rendezvous binds loopback unless given another
address (see ``init_process_group``). Collectives time out after the ``timeout_s`` given to
``init_process_group``: a dead peer surfaces as an error, not a hang.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Iterable

import torch
import torch.distributed as dist

from creditrl.batch import Batch
from creditrl.hosts import is_loopback, unbracketed

__all__ = [
    "all_reduce_gradients",
    "all_reduce_sum",
    "broadcast_bytes",
    "collective_device",
    "destroy_process_group",
    "init_process_group",
    "is_distributed",
    "rank",
    "scatter_batches",
    "world_size",
]


def _loopback_interface() -> str | None:
    """The loopback network interface's name (``lo`` on Linux, ``lo0`` on macOS), if found."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def _listen(host: str, port: int) -> int:
    """A socket listening on exactly ``host:port``; returns its file descriptor (the TCP store
    takes it over and closes it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise OSError(
            f"the process-group rendezvous cannot listen on {host}:{port} ({err.strerror}); "
            "another process holds that port: choose another one"
        ) from None
    return sock.detach()


def init_process_group(
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    device: torch.device | None = None,
    master_addr: str | None = None,
    master_port: int,
    timeout_s: float = 60.0,
) -> None:
    """Join the default process group through a TCP store at ``master_addr:master_port``
    (None: ``$MASTER_ADDR``, else 127.0.0.1). ``backend`` is ``gloo`` on CPU, ``nccl`` on GPU
    (``Placement.backend``); collectives then take their tensors on ``collective_device()``.
    Under NCCL ``device`` (this rank's GPU, ``Placement.device``; required) becomes the current
    CUDA device and is passed as ``device_id``, which binds the communicator to it at once
    instead of guessing from the current device at the first collective.

    On a loopback address nothing listens beyond this machine: rank 0 opens the store's
    listening socket on that address itself (torch's store would listen on every interface),
    and gloo and NCCL use the loopback interface (``GLOO_SOCKET_IFNAME`` /
    ``NCCL_SOCKET_IFNAME``, unless already set). Any other address is torch's multi-node
    set-up, unchanged."""
    device_id = None
    if backend == "nccl":
        if device is None or device.type != "cuda":
            raise ValueError(f"an NCCL process group needs this rank's CUDA device, got {device}")
        torch.cuda.set_device(device)
        device_id = device
    host = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    if host == "localhost":
        host = "127.0.0.1"
    os.environ.setdefault("MASTER_ADDR", host)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    timeout = datetime.timedelta(seconds=timeout_s)
    listen_fd = None
    if is_loopback(host):
        interface = _loopback_interface()
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
        if rank == 0:
            listen_fd = _listen(unbracketed(host), master_port)
    store = dist.TCPStore(
        unbracketed(host),
        master_port,
        world_size,
        rank == 0,
        timeout=timeout,
        master_listen_fd=listen_fd,
    )
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )


def destroy_process_group() -> None:
    """Leave the process group if one is initialised."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def collective_device() -> torch.device:
    """Where the process group's collectives take their tensors: this rank's current CUDA
    device under NCCL (it refuses CPU tensors), else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: dict[str, float]) -> dict[str, float]:
    """The sum over ranks of each value (one float64 all-reduce for the whole dict)."""
    if not is_distributed() or not values:
        return dict(values)
    keys = sorted(values)
    packed = torch.tensor(
        [float(values[k]) for k in keys], dtype=torch.float64, device=collective_device()
    )
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return dict(zip(keys, packed.tolist(), strict=True))


def all_reduce_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Sum each gradient over ranks (DDP's all-reduce, without its averaging: losses here are
    already divided by global token/sequence counts, so the sum is the full-batch gradient).
    Gradients are flattened into one buffer per dtype so a step costs one collective each.
    Sharded (DTensor) gradients were already reduce-scattered by FSDP2, which averages: they
    are multiplied by the world size instead."""
    if not is_distributed():
        return
    params = list(params)
    world = dist.get_world_size()
    for p in params:
        if p.grad is not None and hasattr(p.grad, "to_local"):
            p.grad.to_local().mul_(world)
    grads = [p.grad for p in params if p.grad is not None and not hasattr(p.grad, "to_local")]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for grad in group:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """Rank ``src`` sends ``data`` to every rank; all ranks return it."""
    if not is_distributed():
        if data is None:
            raise ValueError("broadcast_bytes without a process group needs data")
        return data
    device = collective_device()
    length = torch.tensor(
        [len(data) if dist.get_rank() == src else 0], dtype=torch.int64, device=device
    )
    dist.broadcast(length, src=src)
    if dist.get_rank() == src:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(int(length), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src)
    return buffer.cpu().numpy().tobytes()


def scatter_batches(parts: list[Batch] | None, src: int = 0) -> Batch:
    """Rank ``src`` passes one Batch per rank (others pass None); each rank returns its own.
    Batches travel as ``Batch.to_bytes()`` (safetensors + JSON)."""
    if not is_distributed():
        if not parts or len(parts) != 1:
            raise ValueError("scatter_batches without a process group needs exactly one part")
        return parts[0]
    me, world = dist.get_rank(), dist.get_world_size()
    device = collective_device()
    if me == src:
        if parts is None or len(parts) != world:
            raise ValueError(f"rank {src} must pass {world} batches, got {parts and len(parts)}")
        payloads = [p.to_bytes() for p in parts]
        lengths = torch.tensor([len(p) for p in payloads], dtype=torch.int64, device=device)
    else:
        lengths = torch.empty(world, dtype=torch.int64, device=device)
    dist.broadcast(lengths, src=src)
    if me == src:
        for r, payload in enumerate(payloads):
            if r != src:
                dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device), dst=r)
        return parts[src]
    buffer = torch.empty(int(lengths[me]), dtype=torch.uint8, device=device)
    dist.recv(buffer, src=src)
    return Batch.from_bytes(buffer.cpu().numpy().tobytes())
