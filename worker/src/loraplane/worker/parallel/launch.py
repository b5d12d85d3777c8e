"""Start the ranks of one worker: one process per rank, gloo on CPU, NCCL on GPUs.

Configuration is checked in the parent before any process starts, so every rank sees the
same verdict and no rank is left waiting in a collective (seed 001).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loraplane.worker.parallel.state import ParallelConfig, ParallelState


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_rank(rank: int, world: int, device: str, port: int) -> torch.device:
    """Join the worker's process group; returns this rank's device."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
        )
        return torch.device("cuda", rank)
    # One thread per rank: the ranks share the CPU cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return torch.device("cpu")


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world: int,
    device: str,
    port: int,
    config: ParallelConfig,
    args: tuple[Any, ...],
) -> None:
    dev = init_rank(rank, world, device, port)
    try:
        ps = ParallelState(config, rank)
        fn(rank, ps, dev, *args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., Any], config: ParallelConfig, device: str, *args: Any) -> None:
    """Run fn(rank, parallel_state, device, *args) on `config.tp` processes and wait for all."""
    if device == "cuda" and torch.cuda.device_count() < config.tp:
        raise RuntimeError(
            f"tp={config.tp} needs {config.tp} GPUs, this machine has {torch.cuda.device_count()}"
        )
    mp.start_processes(
        _entry,
        args=(fn, config.tp, device, free_port(), config, args),
        nprocs=config.tp,
        join=True,
        start_method="spawn",
    )
