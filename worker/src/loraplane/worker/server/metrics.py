"""Prometheus metrics of one worker (prefix `loraplane_worker_`), fed by the engine's hooks."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

NO_ADAPTER_LABEL = "none"
# up to the control plane's default load timeout (120 s): slow S3/hf loads stay visible
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


_STEP_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1)


def _label(adapter: str | None) -> str:
    return adapter if adapter is not None else NO_ADAPTER_LABEL


class WorkerMetrics:
    """Implements `EngineObserver`; one registry per server so tests can run several."""

    def __init__(self, dp_size: int, max_loras_per_batch: int, max_loaded_loras: int) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series: they only add noise to dashboards
        self.registry = CollectorRegistry()
        self.dp_size = dp_size
        r = self.registry
        self.slots_used = Gauge(
            "loraplane_worker_lora_slots_used",
            "GPU LoRA slots holding an adapter",
            ["dp_group"],
            registry=r,
        )
        self.slots_total = Gauge(
            "loraplane_worker_lora_slots_total",
            "GPU LoRA slots (max_loras_per_batch)",
            ["dp_group"],
            registry=r,
        )
        self.max_loaded = Gauge(
            "loraplane_worker_adapters_max_loaded",
            "Host-memory adapter capacity (max_loaded_loras)",
            registry=r,
        )
        self.loaded = Gauge(
            "loraplane_worker_adapters_loaded",
            "Adapters loaded (routable or inconsistent)",
            registry=r,
        )
        self.pinned = Gauge("loraplane_worker_adapters_pinned", "Pinned adapters", registry=r)
        self.inconsistent = Gauge(
            "loraplane_worker_adapters_inconsistent",
            "Adapters left inconsistent by a partially failed unload",
            registry=r,
        )
        self.requests = Counter(
            "loraplane_worker_requests", "Generation requests accepted", ["adapter"], registry=r
        )
        self.prompt_tokens = Counter(
            "loraplane_worker_prompt_tokens",
            "Prompt tokens of accepted requests",
            ["adapter"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "loraplane_worker_generated_tokens", "Tokens generated", ["adapter"], registry=r
        )
        self.load_seconds = Histogram(
            "loraplane_worker_adapter_load_seconds",
            "Latency of adapter loads (all DP groups)",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.unload_seconds = Histogram(
            "loraplane_worker_adapter_unload_seconds",
            "Latency of adapter unloads (all DP groups)",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.evictions = Counter(
            "loraplane_worker_adapter_evictions",
            "Adapters evicted from a GPU slot (LRU)",
            ["adapter"],
            registry=r,
        )
        self.waiting_for_slot = Gauge(
            "loraplane_worker_requests_waiting_for_slot",
            "Requests waiting because their adapter has no GPU slot",
            registry=r,
        )
        self.waiting = Gauge(
            "loraplane_worker_requests_waiting", "Requests waiting to start", registry=r
        )
        self.running = Gauge(
            "loraplane_worker_requests_running", "Requests running", ["dp_group"], registry=r
        )
        self.distinct_adapters = Histogram(
            "loraplane_worker_step_distinct_adapters",
            "Distinct adapters in one forward step",
            buckets=tuple(range(0, max_loras_per_batch + 1)),
            registry=r,
        )
        self.steps = Counter("loraplane_worker_steps", "Forward steps run", registry=r)
        # where a request's time to first token goes, inside the engine (the client's TTFT
        # adds the HTTP front end and the network)
        self.queue_seconds = Histogram(
            "loraplane_worker_queue_seconds",
            "Time from the engine receiving a request to its admission into the running batch",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token_seconds = Histogram(
            "loraplane_worker_first_token_seconds",
            "Time from the engine receiving a request to its first token leaving the engine",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "loraplane_worker_step_seconds",
            "One pass of the engine loop that launched a step (kind=mixed: it feeds prompt "
            "tokens; decode: only running sequences' next tokens)",
            ["kind"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        # the paged KV cache (ADR 0015): hit rate = rate(prefix_cached_tokens) /
        # rate(prompt_tokens), or by requests from prefix_lookups
        self.prefix_lookups = Counter(
            "loraplane_worker_prefix_lookups",
            "Admitted requests by whether a prefix of their prompt was cached (result=hit|miss)",
            ["adapter", "result"],
            registry=r,
        )
        self.prefix_cached_tokens = Counter(
            "loraplane_worker_prefix_cached_tokens",
            "Prompt tokens whose KV came from the prefix cache (their prefill skipped)",
            ["adapter"],
            registry=r,
        )
        self.kv_pages = Gauge(
            "loraplane_worker_kv_pages",
            "KV-cache pages per DP group: state=used (held by requests), cached (prefixes held "
            "by none), total",
            ["dp_group", "state"],
            registry=r,
        )
        self.slot_loads = Counter(
            "loraplane_worker_slot_loads",
            "Adapters copied from host memory into a GPU LoRA slot (slot-level cold starts)",
            ["adapter"],
            registry=r,
        )
        self.info = Gauge(
            "loraplane_worker_info",
            "Always 1: the served base model and the topology (tp, dp)",
            ["model", "tp", "dp"],
            registry=r,
        )
        self.warmup_seconds = Gauge(
            "loraplane_worker_warmup_seconds",
            "Seconds the worker's warm-up ran before it served (0: none; engine.warmup)",
            registry=r,
        )
        for g in range(dp_size):
            self.slots_total.labels(str(g)).set(max_loras_per_batch)
            self.slots_used.labels(str(g)).set(0)
            self.running.labels(str(g)).set(0)
        self.max_loaded.set(max_loaded_loras)
        for counter in (self.requests, self.prompt_tokens, self.generated_tokens):
            counter.labels(NO_ADAPTER_LABEL)
        for kind in ("decode", "mixed"):
            self.step_seconds.labels(kind)
        for outcome in ("success", "failure"):  # born at 0: increase() sees the first failure
            self.load_seconds.labels(outcome)
            self.unload_seconds.labels(outcome)

    def warmed_up(self, seconds: float) -> None:
        self.warmup_seconds.set(seconds)

    def set_info(self, model: str, tp: int, dp: int) -> None:
        self.info.clear()
        self.info.labels(model, str(tp), str(dp)).set(1)

    # --- EngineObserver ------------------------------------------------------------------

    def request_started(self, adapter: str | None, prompt_tokens: int) -> None:
        self.requests.labels(_label(adapter)).inc()
        self.prompt_tokens.labels(_label(adapter)).inc(prompt_tokens)

    def tokens_generated(self, adapter: str | None, count: int) -> None:
        self.generated_tokens.labels(_label(adapter)).inc(count)

    def step(
        self,
        distinct_adapters: int,
        running_per_group: list[int],
        waiting: int,
        waiting_for_slot: int,
    ) -> None:
        self.steps.inc()
        self.distinct_adapters.observe(distinct_adapters)
        for g, n in enumerate(running_per_group):
            self.running.labels(str(g)).set(n)
        self.waiting.set(waiting)
        self.waiting_for_slot.set(waiting_for_slot)

    def request_admitted(self, queue_seconds: float) -> None:
        self.queue_seconds.observe(queue_seconds)

    def first_token(self, seconds: float) -> None:
        self.first_token_seconds.observe(seconds)

    def loop_iteration(self, kind: str, seconds: float) -> None:
        self.step_seconds.labels(kind).observe(seconds)

    def idle(self) -> None:
        for g in range(self.dp_size):
            self.running.labels(str(g)).set(0)
        self.waiting.set(0)
        self.waiting_for_slot.set(0)

    def prefix_lookup(self, adapter: str | None, cached_tokens: int, prompt_tokens: int) -> None:
        self.prefix_lookups.labels(_label(adapter), "hit" if cached_tokens else "miss").inc()
        self.prefix_cached_tokens.labels(_label(adapter)).inc(cached_tokens)

    def kv_pool(self, dp_group: int, used: int, cached: int, total: int) -> None:
        for state, value in (("used", used), ("cached", cached), ("total", total)):
            self.kv_pages.labels(str(dp_group), state).set(value)

    def evicted(self, adapter: str) -> None:
        self.evictions.labels(adapter).inc()

    def adapter_loaded(self, adapter: str) -> None:
        """A newly loaded adapter's counters start at 0, so rate() sees its first requests."""
        for counter in self._per_adapter():
            counter.labels(adapter)

    def adapter_unloaded(self, adapter: str) -> None:
        """Its series go (a worker that churns through adapters and versions would otherwise
        keep its series of every name it ever served); a later load starts them at 0."""
        for counter in self._per_adapter():
            with contextlib.suppress(KeyError):  # never loaded through this registry
                counter.remove(adapter)
        for result in ("hit", "miss"):
            with contextlib.suppress(KeyError):
                self.prefix_lookups.remove(adapter, result)

    def _per_adapter(self) -> tuple[Counter, ...]:
        return (
            self.requests,
            self.prompt_tokens,
            self.generated_tokens,
            self.evictions,
            self.slot_loads,
            self.prefix_cached_tokens,
        )

    def slot_loaded(self, adapter: str) -> None:
        self.slot_loads.labels(adapter).inc()

    def residency_changed(
        self, slots_used: int, loaded: int, pinned: int, inconsistent: int
    ) -> None:
        for g in range(self.dp_size):
            self.slots_used.labels(str(g)).set(slots_used)
        self.loaded.set(loaded + inconsistent)
        self.pinned.set(pinned)
        self.inconsistent.set(inconsistent)

    def adapter_op(self, op: str, seconds: float, success: bool) -> None:
        hist = self.load_seconds if op == "load" else self.unload_seconds
        hist.labels("success" if success else "failure").observe(seconds)
