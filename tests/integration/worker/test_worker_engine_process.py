"""`worker serve` runs its engine core in a child process (ADR 0012): it is ready with its
start-up adapters when /health first answers, it leaves no process behind however the front
end ends, and a core that dies fails /health and the requests in flight instead of hanging."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from tests.procs import worker_serve_command
from workerkit import WorkerProcess, generate

pytestmark = pytest.mark.integration


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process (Linux /proc)."""
    out: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out[int(entry.name)] = (ppid, cmdline)
    return out


def descendants(pid: int) -> dict[int, str]:
    procs = _processes()
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, cmdline) in procs.items():
            if ppid == parent and child not in found:
                found[child] = cmdline
                frontier.append(child)
    return found


def engine_cores(worker: WorkerProcess) -> list[int]:
    return [pid for pid, cmd in descendants(worker.proc.pid).items() if "spawn_main" in cmd]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # (a zombie has exited; its parent has not reaped it yet)


def wait_gone(pids: list[int], timeout: float = 60) -> list[int]:
    """The pids still running after waiting up to ``timeout`` s for them to exit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def test_the_core_is_ready_with_its_adapters_and_stops_with_the_worker(
    worker_factory: Callable[..., WorkerProcess], make_adapter_dir: Callable[..., Path]
) -> None:
    path = make_adapter_dir("core-a", seed=5)
    worker = worker_factory("--lora", f"core-a={path}")
    cores = engine_cores(worker)
    assert len(cores) == 1, descendants(worker.proc.pid)
    # ready means loaded: the first request after /health may name the start-up adapter
    assert "core-a" in [m["id"] for m in worker.client.get("/v1/models").json()["data"]]
    assert generate(worker, "The quick brown fox", "core-a")["choices"][0]["text"]
    everything = [worker.proc.pid, *descendants(worker.proc.pid)]
    worker.stop()  # SIGTERM
    assert wait_gone(everything) == [], {p: _processes().get(p) for p in everything}


def test_a_killed_front_end_leaves_no_core_behind(
    worker_factory: Callable[..., WorkerProcess],
) -> None:
    worker = worker_factory()
    cores = engine_cores(worker)
    assert len(cores) == 1
    worker.proc.kill()  # no shutdown at all: the core sees its pipe close
    worker.proc.wait()
    assert wait_gone(cores) == []


def test_a_dead_core_fails_health_and_the_request_in_flight(
    worker_factory: Callable[..., WorkerProcess],
) -> None:
    worker = worker_factory()
    (core,) = engine_cores(worker)
    assert worker.client.get("/health").status_code == 200
    os.kill(core, signal.SIGSTOP)  # frozen: the request below stays in flight
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 50}, "stream": True}
    received = ""
    ended_with_error = False
    with worker.client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200  # (headers go out once the request is submitted)
        os.kill(core, signal.SIGKILL)
        try:
            for chunk in response.iter_text():
                received += chunk
        except httpx.HTTPError:
            ended_with_error = True
    assert ended_with_error or "[DONE]" not in received, received
    health = worker.client.get("/health")
    assert health.status_code == 503
    assert "engine core process exited with code -9" in health.json()["error"]["message"]
    r = worker.client.post("/generate", json={**body, "stream": False})
    assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


def test_the_text_is_the_same_with_the_engine_on_a_thread(
    worker_factory: Callable[..., WorkerProcess],
) -> None:
    """--no-engine-process runs the engine in the front end's process; stop strings, streaming
    and text are the same either way."""
    threaded = worker_factory("--no-engine-process")
    assert engine_cores(threaded) == []
    core = worker_factory()
    for prompt in ("The quick brown fox", "Once upon a time", "What is the capital"):
        full = generate(threaded, prompt, None, max_tokens=12)["choices"][0]["text"]
        stop = full[4:6] if len(full) >= 6 else "zz"
        for worker in (threaded, core):
            out = generate(worker, prompt, None, max_tokens=12, stop=[stop])["choices"][0]
            assert (out["text"], out["finish_reason"]) == (
                full[: full.find(stop)] if stop in full else full,
                "stop" if stop in full else "length",
            )
            streamed = streamed_text(worker, prompt, 12, stop)
            assert streamed == out["text"]


def streamed_text(worker: WorkerProcess, prompt: str, max_tokens: int, stop: str) -> str:
    body = {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stop": [stop],
        "stream": True,
    }
    text = ""
    with worker.client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_a_core_that_cannot_start_fails_the_worker_with_its_reason(tmp_path: Path) -> None:
    from workerkit import LORAPLANE

    empty = tmp_path / "no-model"
    empty.mkdir()
    result = subprocess.run(
        worker_serve_command(LORAPLANE, empty, 1),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode != 0
    assert f"model directory {empty} has no config.json" in result.stderr
    assert "Traceback" not in result.stderr  # a wrong setting is a message, not a crash
