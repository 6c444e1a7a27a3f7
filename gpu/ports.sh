#!/usr/bin/env bash
# The port pairs on a GPU (phase `ports` of gpu/run.sh; staged next to the `ports` example by
# gpu/build.sh): runs the plain-cudarc and the cached version of every program of
# examples/ports, compares their outputs line by line, and runs every cached version under
# compute-sanitizer memcheck. Prints one line per program and a last line
# `ports: N programs, N identical, N clean under memcheck`; exits non-zero on any difference,
# failure or memcheck error.
#
#   bash gpu-bin/ports.sh [NAME...]     # logs under $OUT/ports (default /tmp/cca-gpu-out/ports)
#
# NCCL and cuDNN ship as Python wheels next to PyTorch: their library folders are added to
# LD_LIBRARY_PATH, and a `libnccl.so` link is made for cudarc's loader (which looks for
# `libnccl.so`, not the wheel's `libnccl.so.2`).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/cca-gpu-out}
LOG="$OUT/ports"
mkdir -p "$LOG"
BIN="$HERE/ports"
[ -x "$BIN" ] || { echo "no ports binary at $BIN (gpu/build.sh stages it)"; exit 1; }

LIBS=$(mktemp -d)
EXTRA=""
for lib in $(python3 - 2>/dev/null <<'PY'
import glob, os
try:
    import nvidia
    for root in nvidia.__path__:
        for d in glob.glob(os.path.join(root, "*", "lib")):
            print(d)
except ImportError:
    pass
PY
); do
  EXTRA="${EXTRA:+$EXTRA:}$lib"
  [ -e "$lib/libnccl.so.2" ] && ln -sf "$lib/libnccl.so.2" "$LIBS/libnccl.so"
done
export LD_LIBRARY_PATH="$LIBS${EXTRA:+:$EXTRA}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

NAMES=${*:-$("$BIN" list)}
total=0 same=0 clean=0 rc=0
for name in $NAMES; do
  total=$((total + 1))
  timeout 120 "$BIN" plain "$name" >"$LOG/$name.plain" 2>&1
  prc=$?
  timeout 120 "$BIN" cached "$name" >"$LOG/$name.cached" 2>&1
  crc=$?
  if [ $prc -eq 0 ] && [ $crc -eq 0 ] && cmp -s "$LOG/$name.plain" "$LOG/$name.cached"; then
    verdict="identical ($(grep -c checksum "$LOG/$name.cached") checksums)"
    same=$((same + 1))
  else
    verdict="DIFFERENT (plain rc=$prc, cached rc=$crc)"
    diff "$LOG/$name.plain" "$LOG/$name.cached" | head -20 >"$LOG/$name.diff"
    rc=1
  fi
  # API-error reports off: driver_error fails an allocation of twice the device on purpose.
  timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 99 \
    "$BIN" cached "$name" >"$LOG/$name.memcheck" 2>&1
  mrc=$?
  if [ $mrc -eq 0 ]; then
    clean=$((clean + 1))
    mem="memcheck clean"
  else
    mem="memcheck rc=$mrc: $(grep -m1 -E 'ERROR SUMMARY|Invalid|failed' "$LOG/$name.memcheck")"
    rc=1
  fi
  echo "$name: $verdict; $mem"
done
rm -rf "$LIBS"
echo "ports: $total programs, $same identical, $clean clean under memcheck"
exit $rc
