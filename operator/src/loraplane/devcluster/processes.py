"""Start detached processes and stop exactly those again, by PID.

A PID alone can be reused after its process exits, so every process is recorded with its
start time (field 22 of /proc/<pid>/stat); a PID whose start time differs is someone
else's and is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from loraplane.devcluster.layout import Process


def start_ticks(pid: int) -> int | None:
    """The start time of `pid` in clock ticks since boot, or None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may contain spaces.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has exited already
        return None
    return int(fields[19])


def is_running(process: Process) -> bool:
    return start_ticks(process.pid) == process.start_ticks


def spawn(
    name: str,
    argv: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    ports: Sequence[int] = (),
) -> tuple[Process, subprocess.Popen[bytes]]:
    """Start `argv` in its own session (so its children can be signalled as a group),
    with stdout and stderr appended to `log`. Returns the record to stop it by, and the
    Popen (a caller that outlives the child polls it so the child is reaped)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        child = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    ticks = start_ticks(child.pid)
    if ticks is None:
        raise RuntimeError(f"{name} exited at once; see {log}")
    return Process(
        name=name, pid=child.pid, start_ticks=ticks, log=str(log), ports=list(ports)
    ), child


def stop(process: Process, *, grace_s: float = 10.0) -> None:
    """SIGTERM the process group of `process`, then SIGKILL it after `grace_s`."""
    if not is_running(process):
        return
    _signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not is_running(process):
            break
        _reap(process.pid)
        time.sleep(0.05)
    if is_running(process):
        _signal_group(process.pid, signal.SIGKILL)
        for _ in range(100):
            _reap(process.pid)
            if not is_running(process):
                break
            time.sleep(0.05)
    # Children that left the group are still ours if the group leader made them; a
    # member of the group that outlived its leader is killed too.
    _signal_group(process.pid, signal.SIGKILL)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # the leader of a new session is the leader of its group
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


# Ports handed out by free_port: below the kernel's ephemeral range (32768-60999 by
# default), from a per-process random start, never the same one twice in a process.
_PORT_FLOOR = 20000
_handed_out: set[int] = set()


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now, for a server started right after.

    `bind(0)` would answer from the ephemeral range, where any outgoing connection (a gloo or
    NCCL bootstrap, an HTTP client) can take the port before the server meant to get it binds
    ("address already in use"). A port below that range is only ever taken by an explicit bind.
    """
    ceiling = max(_ephemeral_floor(), _PORT_FLOOR + 1000)
    span = ceiling - _PORT_FLOOR
    start = random.Random(os.getpid() ^ time.time_ns()).randrange(span)
    for step in range(span):
        port = _PORT_FLOOR + (start + step) % span
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port on {host} between {_PORT_FLOOR} and {ceiling}")


def is_listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0
