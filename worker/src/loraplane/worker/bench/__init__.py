"""GPU benchmarks of loraplane (issue 9): kernel bandwidth and end-to-end decode throughput.

* ``loraplane.worker.bench.kernels``: shrink / expand (plain, stacked, MoE) against the device's
  measured copy bandwidth, the torch reference and the dense base matmul
  (``run_kernels_bench``; ``python -m loraplane.worker.bench.kernels --device cuda --json``).
* ``loraplane.worker.bench.decode``: decode tokens/s of ``ModelRunner`` with LoRA off vs on
  (``run_decode_bench``; ``python -m loraplane.worker.bench.decode --device cuda --json``).

Both run on CPU at tiny shapes (Triton in its interpreter: ``TRITON_INTERPRET=1``), which is
what ``tests/unit/bench`` does; numbers mean something only on a GPU. See docs/performance.md.
Nothing here imports Triton at module import: callers may still set ``TRITON_INTERPRET``.
"""
