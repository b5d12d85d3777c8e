# Sourced by bench/run_gpu*.sh: the environment of a device run and its `step` runner.
#   OUT (default bench/results/latest) gets run.log; LORAPLANE_COMMIT names the tree (the
#   device's copy may report a stale git HEAD); ONLY="a b" runs those steps alone.
set -u
OUT="${OUT:-bench/results/latest}"
mkdir -p "$OUT"
export PYTHONPATH="worker/src:controlplane/src:operator/src${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0
export LORAPLANE_COMMIT="${LORAPLANE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
PY="${PYTHON:-python3}"
LOG="$OUT/run.log"
: > "$LOG"
T0=$(date +%s)
steps() {  # steps NAME...: the script's step names; an ONLY naming another stops it (rc 2)
  local name
  for name in ${ONLY:-}; do
    if [[ " $* " != *" $name "* ]]; then
      echo "ONLY: unknown step '$name' (steps: $*)" >&2; exit 2
    fi
  done
}
step() {  # step NAME SECONDS CMD...: time-capped, its output in $LOG; a failure keeps the rest
  local name="$1" secs="$2"; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
    echo "=== $name skipped (ONLY=$ONLY)" | tee -a "$LOG"; return 0
  fi
  echo "=== $name (cap ${secs}s, t=$(( $(date +%s) - T0 ))s)" | tee -a "$LOG"
  timeout --signal=TERM --kill-after=15 "$secs" "$@" >>"$LOG" 2>&1
  echo "=== $name rc=$? (t=$(( $(date +%s) - T0 ))s)" | tee -a "$LOG"
}
