#!/usr/bin/env bash
# Fetch the wheels listed in scripts/gpu_wheels.txt into .whl/ for the lent GPU machine (it reaches
# no registry; the device tool carries .whl with carry=[".whl"]). Run here, where pip reaches one:
#   bash scripts/gpu_wheels.sh [DIR]          # DIR defaults to .whl (ignored by git)
# Wheels are for CPython 3.12 on manylinux x86-64 (the device README's pip flags); a package with
# no wheel on the registry (antlr4-python3-runtime 4.9.3 is an sdist) is built here into a
# py3-none-any wheel. Other versions of a listed package are removed from DIR: two versions of one
# package stop the whole install there.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PY:-python3}
LIST=scripts/gpu_wheels.txt
LIMIT_MIB=60   # of the 64 MiB a device call may carry
PLATFORM=(--python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p "$DIR"
while read -r line; do
  spec=$(echo "${line%%#*}" | tr -d '[:space:]')
  [ -z "$spec" ] && continue
  name=${spec%%==*}
  version=${spec#*==}
  stem=$(echo "$name" | tr '[:upper:]-.' '[:lower:]__')   # wheel file names: hydra_core-1.3.8-...
  for old in "$DIR/$stem"-*.whl; do
    [ -e "$old" ] || continue
    case "$(basename "$old")" in "$stem-$version-"*) ;; *) echo "removing $old"; rm -f "$old" ;; esac
  done
  if ls "$DIR/$stem-$version-"*.whl >/dev/null 2>&1; then
    echo "have $spec"
  elif $PY -m pip download -q --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$DIR" "$spec"; then
    echo "downloaded $spec"
  else
    echo "no wheel of $spec on the registry: building a pure-Python one"
    $PY -m pip wheel -q --no-deps --no-binary=:all: -w "$DIR" "$spec"
    built=$(ls "$DIR/$stem-$version-"*.whl)
    case "$built" in *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
      *) echo "error: $built is not pure Python: it would not run there" >&2; exit 1 ;; esac
  fi
done < "$LIST"
size=$(du -sm "$DIR" | cut -f1)
echo "$DIR: $(ls "$DIR" | wc -l) wheels, ${size} MiB"
if [ "$size" -gt "$LIMIT_MIB" ]; then
  echo "error: $DIR is over ${LIMIT_MIB} MiB: a device call carries at most 64 MiB" >&2
  exit 1
fi
