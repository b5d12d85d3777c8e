#!/usr/bin/env bash
# Copy the CRDs (source of truth: crds/) into the Helm chart (charts/loraplane/crds/).
#   scripts/sync-crds.sh          copy
#   scripts/sync-crds.sh --check  fail (exit 1) if the chart's copy differs; changes nothing
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="$root/crds"
dst="$root/charts/loraplane/crds"

case "${1:-}" in
  --check)
    if ! diff -r -u "$src" "$dst"; then
      echo "charts/loraplane/crds differs from crds/: run scripts/sync-crds.sh" >&2
      exit 1
    fi
    echo "charts/loraplane/crds is in sync with crds/"
    ;;
  "")
    mkdir -p "$dst"
    find "$dst" -maxdepth 1 -name '*.yaml' -delete
    cp "$src"/*.yaml "$dst"/
    echo "copied $(ls "$src"/*.yaml | wc -l) CRDs into charts/loraplane/crds/"
    ;;
  *)
    echo "usage: $0 [--check]" >&2
    exit 2
    ;;
esac
