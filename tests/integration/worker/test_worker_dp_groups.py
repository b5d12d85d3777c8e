"""Fan-out over DP groups with a partial failure (needs the multi-rank executor: tp=2 dp=2)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from workerkit import WorkerProcess

from loraplane.worker.server.factory import ServeConfig, unsupported_reason

pytestmark = pytest.mark.integration

DP_ARGS = ("--tp", "2", "--dp", "2", "--dp-attention")
_reason = unsupported_reason(ServeConfig(model="-", tp=2, dp=2, dp_attention=True))
needs_multirank = pytest.mark.skipif(
    _reason is not None, reason=f"make_executor cannot build it yet: {_reason}"
)


def gen_ids(worker: WorkerProcess, prompt: str, adapter: str | None) -> list[int]:
    body: dict = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
    }
    if adapter:
        body["lora_path"] = adapter
    r = worker.client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@needs_multirank
def test_partial_load_and_unload_failure_on_one_dp_group(
    worker_factory: Callable[..., WorkerProcess], make_adapter_dir: Callable[..., Path]
) -> None:
    keep = make_adapter_dir("dpkeep")
    worker = worker_factory(*DP_ARGS, "--enable-fault-injection", "--lora", f"dpkeep={keep}")
    c = worker.client
    path = str(make_adapter_dir("dpflaky", seed=4))
    c.post(
        "/debug/fault", json={"op": "load", "dp_group": 1, "count": 1, "message": "group 1 says no"}
    )
    r = c.post("/load_lora_adapter", json={"lora_name": "dpflaky", "lora_path": path})
    assert r.status_code == 400
    assert r.json() == {
        "success": False,
        "error_message": "group 1 says no",
        "loaded_adapters": {"dpkeep": str(keep.resolve())},
    }
    state = c.get("/lora_state").json()
    assert all("dpflaky" not in g["adapters"] for g in state["dp_groups"])  # rolled back on group 0
    assert "dpflaky" not in state["slots"]
    assert "dpflaky" not in [m["id"] for m in c.get("/v1/models").json()["data"]]
    # both groups failing with the same message: de-duplicated
    c.post("/debug/fault", json={"op": "load", "dp_group": 0, "count": 1, "message": "same"})
    c.post("/debug/fault", json={"op": "load", "dp_group": 1, "count": 1, "message": "same"})
    assert (
        c.post("/load_lora_adapter", json={"lora_name": "dpflaky", "lora_path": path}).json()[
            "error_message"
        ]
        == "same"
    )
    assert c.post("/load_lora_adapter", json={"lora_name": "dpflaky", "lora_path": path}).json()[
        "success"
    ]
    c.post(
        "/debug/fault",
        json={"op": "unload", "dp_group": 1, "count": 1, "message": "group 1 unload"},
    )
    r = c.post("/unload_lora_adapter", json={"lora_name": "dpflaky"})
    assert r.status_code == 400 and r.json()["error_message"] == "group 1 unload"
    state = c.get("/lora_state").json()
    assert state["inconsistent"] == ["dpflaky"]
    assert ["dpflaky" in g["adapters"] for g in state["dp_groups"]] == [False, True]
    assert c.post("/generate", json={"text": "hi", "lora_path": "dpflaky"}).status_code == 404
    assert c.post("/unload_lora_adapter", json={"lora_name": "dpflaky"}).json()["success"]
    assert c.get("/lora_state").json()["inconsistent"] == []


@needs_multirank
def test_bad_adapter_file_is_rejected_and_every_rank_keeps_serving(
    worker_factory: Callable[..., WorkerProcess],
    make_adapter_dir: Callable[..., Path],
    tmp_path: Path,
) -> None:
    # An fp8 tensor once raised NotImplementedError in the ranks, which exited: the worker died.
    keep = make_adapter_dir("dpkeep")
    worker = worker_factory(*DP_ARGS, "--lora", f"dpkeep={keep}")
    c = worker.client
    before = [gen_ids(worker, "hello there", "dpkeep"), gen_ids(worker, "hello there", None)]
    bad = tmp_path / "dpfp8"
    shutil.copytree(make_adapter_dir("dpfp8src", seed=5), bad)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].to(torch.float8_e4m3fn)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    r = c.post("/load_lora_adapter", json={"lora_name": "dpfp8", "lora_path": str(bad)})
    assert r.status_code == 400, r.text
    answer = r.json()
    assert not answer["success"]
    assert key in answer["error_message"] and "F8_E4M3" in answer["error_message"]
    assert answer["loaded_adapters"] == {"dpkeep": str(keep.resolve())}
    state = c.get("/lora_state").json()
    assert all("dpfp8" not in g["adapters"] for g in state["dp_groups"])
    assert c.post("/generate", json={"text": "hi", "lora_path": "dpfp8"}).status_code == 404
    after = [gen_ids(worker, "hello there", "dpkeep"), gen_ids(worker, "hello there", None)]
    assert after == before
    assert c.get("/health").json() == {"status": "ok"}


@needs_multirank
def test_mixed_concurrent_requests_equal_one_at_a_time_dp2(
    worker_factory: Callable[..., WorkerProcess], make_adapter_dir: Callable[..., Path]
) -> None:
    adapters = {f"dpm{i}": make_adapter_dir(f"dpm{i}", seed=20 + i) for i in range(4)}
    worker = worker_factory(
        *DP_ARGS, *[a for n, p in adapters.items() for a in ("--lora", f"{n}={p}")]
    )
    jobs = [(f"prompt number {i}", [None, *adapters][i % 5]) for i in range(10)]
    sequential = [gen_ids(worker, p, a) for p, a in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        assert list(pool.map(lambda job: gen_ids(worker, *job), jobs)) == sequential


def _children(pid: int) -> set[int]:
    """PIDs whose parent is `pid` (from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def _spawned(pid: int) -> set[int]:
    """The children of `pid` started by multiprocessing's spawn."""
    return {
        child
        for child in _children(pid)
        if "spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
    }


def _alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2 :].split()[0] != "Z"


@needs_multirank
def test_killed_worker_leaves_no_rank_process_behind(
    worker_factory: Callable[..., WorkerProcess],
) -> None:
    # A worker that dies without stopping its ranks (SIGKILL, a crash, a killed pod) must not
    # leave them running: each holds a copy of the model and would never exit on its own.
    # The ranks are children of the worker's engine core process (ADR 0012).
    worker = worker_factory(*DP_ARGS)
    (core,) = _spawned(worker.proc.pid)
    ranks = _spawned(core)
    assert len(ranks) == 2, f"expected the worker's 2 rank processes, found {sorted(ranks)}"
    ranks.add(core)
    worker.proc.kill()
    worker.proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(pid) for pid in ranks):
        time.sleep(0.2)
    assert not [pid for pid in ranks if _alive(pid)], "the core or its ranks outlived the worker"
