"""Start the ranks of one worker: one process per rank, gloo on CPU, NCCL on GPUs.

Configuration is checked in the parent before any process starts, so every rank sees the
same verdict and no rank is left waiting in a collective (seed 001).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from loraplane.worker.engine.executor import ExecutorFailed
from loraplane.worker.parallel.state import ParallelConfig, ParallelState

# Keys in the parent's store under which ranks record their failures, in the order they fail.
_FAILURES = "loraplane/failures"


class RankFailed(ExecutorFailed):
    """A rank process died or raised; the message names the rank and carries its traceback."""


def exit_with_parent(poll_s: float = 1.0) -> None:
    """End this rank process as soon as the process that started it is gone.

    A rank waits on its inbox queue, whose write end it holds itself, so a parent that dies
    without stopping it (SIGKILL, a crash, a pod killed) would leave it blocked forever with
    the model in memory. A daemon thread watches the parent's PID and exits the process.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="loraplane-parent-watch", daemon=True).start()


def rendezvous_store() -> dist.TCPStore:
    """The ranks' rendezvous store, served by the calling (parent) process.

    The kernel picks its port as the store binds, so no other process can take the port between
    choosing and binding it (as it could with a port probed free first). Keep the returned
    store alive until every rank has joined; pass its `.port` to `init_rank`.
    """
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def init_rank(rank: int, world: int, device: str, port: int) -> torch.device:
    """Join the worker's process group through the parent's store at `port`; returns the device."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=world, device_id=torch.device("cuda", rank)
        )
        return torch.device("cuda", rank)
    # One thread per rank: the ranks share the CPU cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
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
    exit_with_parent()
    dev = init_rank(rank, world, device, port)
    try:
        ps = ParallelState(config, rank)
        fn(rank, ps, dev, *args)
    except BaseException:
        # Recorded before the teardown: the peers fail next, on the closed connections, and
        # the parent must report this rank's error, not theirs.
        record_failure(port, rank)
        dist.destroy_process_group()  # no barrier: the peers may be waiting in a collective
        raise
    finish_rank()


def record_failure(port: int, rank: int) -> None:
    """Append this rank's current traceback to the failures in the parent's store."""
    with contextlib.suppress(Exception):  # the parent still sees the exit status
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        n = store.add(_FAILURES, 1)
        store.set(f"{_FAILURES}/{n}", f"rank {rank} failed:\n{traceback.format_exc()}")


def first_failure(store: dist.TCPStore) -> str | None:
    """The failure a rank recorded first (see `record_failure`), or None."""
    if store.add(_FAILURES, 0) < 1:
        return None
    return bytes(store.get(f"{_FAILURES}/1")).decode()


def finish_rank() -> None:
    """End a rank that completed its work: wait for every rank, tear down, exit 0 at once.

    A CI run once saw rank 0 of a parity run abort with no Python error ("terminate called
    without an active exception", SIGABRT), which fails the run. That message is a C++ thread
    torn down mid-flight; two teardown races can produce it, and both are removed here:
    - a rank that finishes first closing its connections while a peer still uses them: the
      barrier makes every rank reach the end before any tears down;
    - interpreter finalization running the destructors of gloo's and torch's static state in
      no particular order: `os._exit` leaves without it (output flushed first).
    """
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn: Callable[..., Any], config: ParallelConfig, device: str, *args: Any) -> None:
    """Run fn(rank, parallel_state, device, *args) on `config.tp` processes and wait for all.

    Raises `RankFailed` with the traceback of the rank that failed first.
    """
    if device == "cuda" and torch.cuda.device_count() < config.tp:
        raise RuntimeError(
            f"tp={config.tp} needs {config.tp} GPUs, this machine has {torch.cuda.device_count()}"
        )
    store = rendezvous_store()
    try:
        mp.start_processes(
            _entry,
            args=(fn, config.tp, device, store.port, config, args),
            nprocs=config.tp,
            join=True,
            start_method="spawn",
        )
    except ProcessException as exc:
        # `start_processes` reports whichever rank exited first, often a peer that failed
        # only because the failing rank closed its connections.
        first = first_failure(store)
        raise RankFailed(first or str(exc)) from exc
