#!/usr/bin/env bash
# Refuse to start an install that cannot finish: the venv (CUDA torch from PyPI) needs
# about 6 GiB where the repo lives and pip unpacks wheels under TMPDIR.
#   scripts/preflight.sh [min_free_gib]
set -euo pipefail
need_gib="${1:-${LORAPLANE_MIN_FREE_GIB:-8}}"
status=0
dirs=("$PWD")
# pip's TMPDIR counts only where it is another filesystem.
[ "$(df -P "$PWD" | awk 'NR==2 {print $1}')" = "$(df -P "${TMPDIR:-/tmp}" | awk 'NR==2 {print $1}')" ] \
  || dirs+=("${TMPDIR:-/tmp}")
for dir in "${dirs[@]}"; do
  free_kib=$(df -Pk "$dir" | awk 'NR==2 {print $4}')
  free_gib=$((free_kib / 1024 / 1024))
  if [ "$free_gib" -lt "$need_gib" ]; then
    echo "preflight: only ${free_gib} GiB free on the filesystem of $dir; the install needs ${need_gib} GiB." >&2
    echo "  Free space there (old clones, pip-unpack-*/go-build* leftovers under ${TMPDIR:-/tmp}), or set" >&2
    echo "  LORAPLANE_MIN_FREE_GIB if you know this install needs less." >&2
    status=1
  fi
done
exit $status
