#!/usr/bin/env bash
# Run the given test tiers (pytest markers), starting the real services they need first.
#   scripts/test.sh unit kernels multirank integration cluster
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
tiers=("$@")
[ ${#tiers[@]} -gt 0 ] || tiers=(unit kernels multirank integration cluster)

needs() { local t; for t in "${tiers[@]}"; do [ "$t" = "$1" ] && return 0; done; return 1; }

# Tiny checkpoints and adapters shared by the tiers (deterministic; rebuilt when missing).
export LORAPLANE_FIXTURES="${LORAPLANE_FIXTURES:-$PWD/.fixtures}"

if needs cluster; then
  # The pinned Kubernetes binaries, helm and kubectl (built once from the Go module proxy,
  # cached outside the repo); built first so the chart tests of the unit tier can use helm.
  echo "== building the local cluster's binaries (deploy/cluster/build.sh; cached after the first run)"
  bash deploy/cluster/build.sh
  export PATH="$(bash deploy/cluster/build.sh --print-bin-dir):$PATH"
fi

if needs unit || needs integration; then
  # promtool (unit: rule tests) and prometheus (integration: a real scrape) from Debian.
  bash scripts/prometheus.sh install
fi

if needs integration; then
  echo "== starting PostgreSQL and Redis (scripts/services.sh)"
  bash scripts/services.sh start
  eval "$(bash scripts/services.sh env)"  # (exports LORAPLANE_TEST_PG_URL, _REDIS_URL)
  trap 'bash scripts/services.sh stop || true' EXIT
fi

status=0
for tier in "${tiers[@]}"; do
  echo "== tier: $tier"
  extra=()
  # The kernels tier is CPU-bound Python (Triton's interpreter) with no services or ports:
  # its tests spread over one pytest-xdist process per core (at most 4).
  cores=$(nproc)
  if [ "$tier" = kernels ]; then
    extra=(-n "$(( cores < 4 ? cores : 4 ))")
  fi
  # The integration tier spreads its test modules over two xdist processes, each module whole
  # on one process (--dist loadscope): a module's stack (the observability workload's workers,
  # control plane and Prometheus) is set up once, not on every process at once.
  if [ "$tier" = integration ] && [ "$cores" -ge 2 ]; then
    extra=(-n 2 --dist loadscope)
  fi
  # Triton runs kernels on the CPU through its interpreter; set before triton is imported.
  export TRITON_INTERPRET=1
  # The interpreter's tl.dot is numpy's matmul. OpenBLAS's Haswell and Zen sgemm kernels give
  # a row a result that depends on how many rows the matmul has (AMD EPYC here), which breaks
  # the checks that rows without an adapter equal the base model bit for bit; its Sandybridge
  # kernels do not, for the 16+ rows of a tile (tests/kernels/test_interpreter_dot.py).
  export OPENBLAS_CORETYPE=Sandybridge
  set +e
  $PY -m pytest -m "$tier" --durations=15 ${PYTEST_ARGS:-} "${extra[@]}"
  rc=$?
  set -e
  # 5 = no tests collected for this marker: a tier with no tests is an error, not a pass.
  if [ $rc -ne 0 ]; then
    echo "tier $tier failed (pytest exit $rc)"
    status=1
  fi
done
exit $status
