#!/usr/bin/env bash
# Prometheus and promtool (Debian package `prometheus`) for the observability tests.
#
#   scripts/prometheus.sh install   install the package if `prometheus`/`promtool` are missing
#                                   (idempotent; its init scripts are kept from starting a daemon)
#   scripts/prometheus.sh check     promtool check rules + promtool test rules (what `make test` runs)
#   scripts/prometheus.sh start CONFIG DATA_DIR PORT   run prometheus on 127.0.0.1:PORT in the
#                                   background (pid in DATA_DIR/prometheus.pid, log beside it)
#   scripts/prometheus.sh stop DATA_DIR                 stop the one started with that DATA_DIR
#
# The integration test (tests/integration/observability/) starts its own Prometheus the same way
# from Python, with a temporary config and data dir; this script is for running one by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'prometheus: %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

install_package() {
  if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    return 0
  fi
  log "installing the Debian package prometheus"
  export DEBIAN_FRONTEND=noninteractive
  local policy=/usr/sbin/policy-rc.d created_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | as_root tee "$policy" >/dev/null
    as_root chmod +x "$policy"
    created_policy=1
  fi
  if ! as_root apt-get install -y --no-install-recommends prometheus >/dev/null; then
    as_root apt-get update >/dev/null
    as_root apt-get install -y --no-install-recommends prometheus >/dev/null
  fi
  if [ "$created_policy" = 1 ]; then as_root rm -f "$policy"; fi
}

case "${1:-}" in
  install) install_package ;;
  check)
    install_package
    promtool check rules deploy/prometheus/rules.yaml
    (cd deploy/prometheus && promtool test rules rules_test.yaml)
    ;;
  start)
    [ $# -eq 4 ] || { sed -n '2,13p' "$0" >&2; exit 2; }
    install_package
    config="$2" data="$3" port="$4"
    mkdir -p "$data"
    prometheus --config.file="$config" --storage.tsdb.path="$data" \
      --web.listen-address="127.0.0.1:$port" --web.enable-lifecycle \
      >"$data/prometheus.log" 2>&1 &
    echo $! >"$data/prometheus.pid"
    for _ in $(seq 1 100); do
      if curl -fsS "http://127.0.0.1:$port/-/ready" >/dev/null 2>&1; then
        log "ready on 127.0.0.1:$port (pid $(cat "$data/prometheus.pid"))"
        exit 0
      fi
      sleep 0.1
    done
    log "not ready after 10s; see $data/prometheus.log"
    exit 1
    ;;
  stop)
    [ $# -eq 2 ] || { sed -n '2,13p' "$0" >&2; exit 2; }
    pidfile="$2/prometheus.pid"
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      kill "$(cat "$pidfile")"
      rm -f "$pidfile"
    fi
    ;;
  *)
    sed -n '2,13p' "$0" >&2
    exit 2
    ;;
esac
