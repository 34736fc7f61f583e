#!/usr/bin/env bash
# Recreate .whl/ (repo root) from scripts/maxtext_wheels.txt: the wheels carried to the
# offline GPU machine for maxtext==0.2.5 (CPython 3.12, x86_64 manylinux, jax 0.11.2).
# Every line of the list pins a sha256: pip downloads with --require-hashes, and every
# wheel in .whl/ (also one left from an earlier run) is then checked with sha256sum; a
# line without a hash, or a wheel whose hash differs, stops the script (exit 1) and the
# mismatching wheel is deleted.
# Idempotent: wheels already present are kept (pip skips them); wheels in .whl/ that are
# not in the list are removed so that .whl/ holds exactly one version of each package.
# Usage: scripts/fetch_maxtext_wheels.sh        (PYTHON=python3.12 to pick the interpreter)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LIST="$ROOT/scripts/maxtext_wheels.txt"
DEST="$ROOT/.whl"
PYTHON="${PYTHON:-python3}"

norm() { echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g'; }

# name==version --hash=sha256:HEX [--hash=sha256:HEX ...], comments and blank lines dropped.
mapfile -t LINES < <(sed -e 's/#.*//' -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' "$LIST" | grep -v '^$')
declare -A WANT=()
for line in "${LINES[@]}"; do
  spec="${line%% *}"
  name="${spec%%==*}"; ver="${spec#*==}"
  hashes=$(grep -oE -- '--hash=sha256:[0-9a-f]{64}' <<< "$line" | sed 's/--hash=sha256://' | tr '\n' ' ' || true)
  if [[ -z "$hashes" ]]; then
    echo "error: no sha256 for $spec in $(basename "$LIST"): add --hash=sha256:HEX" >&2
    exit 1
  fi
  WANT["$(norm "$name")-$ver"]="$hashes"
done
mkdir -p "$DEST"

"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --require-hashes \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 \
  -d "$DEST" -r "$LIST"

# Drop wheels that are not in the list (e.g. older versions left from a previous run);
# check the others' hashes.
bad=0
for w in "$DEST"/*.whl; do
  [[ -e "$w" ]] || continue
  b="$(basename "$w")"
  key="$(norm "$(echo "$b" | cut -d- -f1)")-$(echo "$b" | cut -d- -f2)"
  if [[ -z "${WANT[$key]:-}" ]]; then
    echo "removing $b (not in $(basename "$LIST"))"
    rm -f "$w"
    continue
  fi
  got="$(sha256sum "$w" | cut -d' ' -f1)"
  if [[ " ${WANT[$key]}" != *" $got "* ]]; then
    echo "error: $b has sha256 $got, not the pinned ${WANT[$key]% }; deleted" >&2
    rm -f "$w"
    bad=1
  fi
done
[[ "$bad" -eq 0 ]] || exit 1

n=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)
if [[ "$n" -ne "${#LINES[@]}" ]]; then
  echo "error: ${#LINES[@]} specs but $n wheels in $DEST" >&2
  exit 1
fi
echo "$n wheels, $(du -cb "$DEST"/*.whl | tail -1 | cut -f1) bytes in $DEST, sha256 checked"
