#!/usr/bin/env bash
# CI for the PyTorch package (no GPU, no torch install): builds the wheel with maturin, installs
# it into a fresh virtual environment with no network and no build step (as on the GPU machine),
# runs test_package.py there, then checks that the C++ shim compiles against PyTorch 2.11's
# headers (check_shim_compiles.sh), and checks gpu/clients.py's bookkeeping (gpu/test_clients.py).
# Honours CARGO_TARGET_DIR; scratch goes under the target dir.
set -euo pipefail
cd "$(dirname "$0")/../.."
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
WORK="$TARGET/python-ci"
rm -rf "$WORK/wheels" "$WORK/venv"
mkdir -p "$WORK"
t0=$SECONDS
command -v maturin >/dev/null 2>&1 || python3 -m pip install --quiet 'maturin>=1.5,<2'
maturin build -m python/Cargo.toml -o "$WORK/wheels"
echo "wheel built in $((SECONDS - t0)) s: $(ls "$WORK"/wheels)"
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install --quiet --no-deps --no-index "$WORK"/wheels/cuda_caching_allocator-*.whl
(cd "$WORK" && "$WORK/venv/bin/python" "$OLDPWD/python/tests/test_package.py")
bash python/tests/check_shim_compiles.sh
# The GPU client suite's bookkeeping (A/B schedule and pairing, thread labels): no torch needed.
python3 gpu/test_clients.py
echo "python package CI: $((SECONDS - t0)) s"
