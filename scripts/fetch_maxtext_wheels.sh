#!/usr/bin/env bash
# Recreate .whl/ (repo root) from scripts/maxtext_wheels.txt: the wheels carried to the
# offline GPU machine for maxtext==0.2.5 (CPython 3.12, x86_64 manylinux, jax 0.11.2).
# Idempotent: wheels already present are kept (pip skips them); wheels in .whl/ that are
# not in the list are removed so that .whl/ holds exactly one version of each package.
# Usage: scripts/fetch_maxtext_wheels.sh        (PYTHON=python3.12 to pick the interpreter)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LIST="$ROOT/scripts/maxtext_wheels.txt"
DEST="$ROOT/.whl"
PYTHON="${PYTHON:-python3}"
mkdir -p "$DEST"

norm() { echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g'; }

mapfile -t SPECS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$LIST" | grep -v '^$')
declare -A WANT=()
for spec in "${SPECS[@]}"; do
  name="${spec%%==*}"; ver="${spec#*==}"
  WANT["$(norm "$name")-$ver"]=1
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 \
    -d "$DEST" "$spec"
done

# Drop wheels that are not in the list (e.g. older versions left from a previous run).
for w in "$DEST"/*.whl; do
  b="$(basename "$w")"
  key="$(norm "$(echo "$b" | cut -d- -f1)")-$(echo "$b" | cut -d- -f2)"
  if [[ -z "${WANT[$key]:-}" ]]; then
    echo "removing $b (not in $(basename "$LIST"))"
    rm -f "$w"
  fi
done

n=$(ls "$DEST"/*.whl | wc -l)
if [[ "$n" -ne "${#SPECS[@]}" ]]; then
  echo "error: ${#SPECS[@]} specs but $n wheels in $DEST" >&2
  exit 1
fi
echo "$n wheels, $(du -cb "$DEST"/*.whl | tail -1 | cut -f1) bytes in $DEST"
