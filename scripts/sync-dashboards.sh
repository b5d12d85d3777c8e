#!/usr/bin/env bash
# Copy the Grafana dashboards (source of truth: deploy/grafana/*.json) into the Helm chart
# (charts/loraplane/dashboards/), which ships them as a ConfigMap through .Files.Get.
#   scripts/sync-dashboards.sh          copy
#   scripts/sync-dashboards.sh --check  fail (exit 1) if the chart's copy differs; changes nothing
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="$root/deploy/grafana"
dst="$root/charts/loraplane/dashboards"

case "${1:-}" in
  --check)
    if ! diff -r -u "$src" "$dst"; then
      echo "charts/loraplane/dashboards differs from deploy/grafana/: run scripts/sync-dashboards.sh" >&2
      exit 1
    fi
    echo "charts/loraplane/dashboards is in sync with deploy/grafana/"
    ;;
  "")
    mkdir -p "$dst"
    find "$dst" -maxdepth 1 -name '*.json' -delete
    cp "$src"/*.json "$dst"/
    echo "copied $(ls "$src"/*.json | wc -l) dashboards into charts/loraplane/dashboards/"
    ;;
  *)
    echo "usage: $0 [--check]" >&2
    exit 2
    ;;
esac
