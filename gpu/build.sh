#!/usr/bin/env bash
# Builds the GPU suite HERE (a machine with Rust, no GPU needed) and stages it for the device
# machine: release test binary, examples (cudarc migration, PyTorch plugin .so), gpu/*.py and
# gpu/run.sh, stripped of debug info to fit the device tool's 64 MiB transfer limit.
#
#   gpu/build.sh [DEST]        # DEST defaults to /work/main/gpu-bin
#
# Then, on the device machine, from the checkout that carries DEST: `bash gpu-bin/run.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-/work/main/gpu-bin}
FEATURES=cuda,cublas

cargo build --release --features "$FEATURES" --examples
TEST_BIN=$(cargo test --release --features "$FEATURES" --test all --no-run --message-format=json 2>/dev/null |
  python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "all":
        print(m["executable"])')
[ -x "$TEST_BIN" ] || { echo "no test binary found" >&2; exit 1; }

mkdir -p "$DEST"
find "$DEST" -mindepth 1 -maxdepth 1 -type f -delete
cp "$TEST_BIN" "$DEST/cuda_tests"
cp target/release/examples/cudarc_migration target/release/examples/libtorch_plugin.so "$DEST/"
strip --strip-debug "$DEST/cuda_tests" "$DEST/cudarc_migration" "$DEST/libtorch_plugin.so"
cp gpu/*.py gpu/run.sh "$DEST/"
{
  echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo '+dirty')"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) features $FEATURES"
} > "$DEST/BUILD_INFO"
du -sh "$DEST"
ls -la "$DEST"
