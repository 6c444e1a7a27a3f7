#!/usr/bin/env bash
# Builds the GPU suite HERE (a machine with Rust, no GPU needed) and stages it for the device
# machine: release test binary, examples (cudarc migration, framework storage, ports,
# pinned_bench, gpu_bench), the `cca` CLI built with CUDA support (features cli,cuda), the PyTorch package as
# a wheel (maturin, installed there with `pip install --no-deps --no-index`) and its native library
# alone (libcca_torch.so, for the ctypes phases), the shipped traces, gpu/*.py, gpu/*.cpp and gpu/run.sh,
# stripped to fit the device tool's 64 MiB transfer limit.
#
#   gpu/build.sh [DEST]        # DEST defaults to /work/main/gpu-bin
#
# Honours CARGO_TARGET_DIR. Then, on the device machine, from the checkout that carries DEST:
# `bash gpu-bin/run.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-/work/main/gpu-bin}
FEATURES=cuda,cublas
TARGET=$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import sys, json; print(json.load(sys.stdin)["target_directory"])')

cargo build --release --features "$FEATURES" --examples
cargo build --release --features cli,cuda --bin cca
cargo build --release --features cuda,trace-io --example gpu_bench
command -v maturin >/dev/null 2>&1 || python3 -m pip install --quiet 'maturin>=1.5,<2'
WHEELS=$(mktemp -d)
maturin build --release --strip -m python/Cargo.toml -o "$WHEELS"
TEST_BIN=$(cargo test --release --features "$FEATURES" --test all --no-run --message-format=json 2>/dev/null |
  python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "all":
        print(m["executable"])')
[ -x "$TEST_BIN" ] || { echo "no test binary found" >&2; exit 1; }

mkdir -p "$DEST"
find "$DEST" -mindepth 1 -maxdepth 1 -type f -delete
rm -rf "$DEST/traces"
cp "$TEST_BIN" "$DEST/cuda_tests"
cp "$TARGET/release/examples/cudarc_migration" "$TARGET/release/examples/framework_storage" \
  "$TARGET/release/examples/ports" "$TARGET/release/examples/pinned_bench" \
  "$TARGET/release/examples/gpu_bench" \
  "$TARGET/release/cca" "$DEST/"
cp "$WHEELS"/cuda_caching_allocator-*.whl "$DEST/"
cp "$TARGET/release/lib_cca.so" "$DEST/libcca_torch.so"
rm -rf "$WHEELS"
strip --strip-debug "$DEST/cuda_tests" "$DEST/cudarc_migration" "$DEST/framework_storage" \
  "$DEST/ports" "$DEST/pinned_bench" "$DEST/gpu_bench" "$DEST/libcca_torch.so"
strip "$DEST/cca"
cp gpu/*.py gpu/*.cpp gpu/run.sh gpu/ports.sh "$DEST/"
mkdir -p "$DEST/probes"
cp gpu/probes/*.py gpu/probes/*.cu "$DEST/probes/"
rm -rf "$DEST/python"
mkdir -p "$DEST/python"
cp -r python/cuda_caching_allocator python/tests "$DEST/python/"
mkdir -p "$DEST/traces"
cp examples/traces/*.csv.gz examples/traces/reference.json "$DEST/traces/"
{
  echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo '+dirty')"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) features $FEATURES (cca: cli,cuda)"
} > "$DEST/BUILD_INFO"
du -sh "$DEST"
ls -la "$DEST"
KIB=$(du -sk "$DEST" | cut -f1)
if [ "$KIB" -gt $((48 * 1024)) ]; then
  echo "staged $((KIB / 1024)) MiB: too close to the device tool's 64 MiB limit" >&2
  exit 1
fi
