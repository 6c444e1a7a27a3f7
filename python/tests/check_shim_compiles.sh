#!/usr/bin/env bash
# Compiles the C++ shim (python/cuda_caching_allocator/csrc/cca_shim.cpp) against PyTorch 2.11's
# own headers, as torch.utils.cpp_extension would on a user's machine, without installing torch:
# the headers come from PyPI's torch 2.11.0 wheel (its include/ folder only) and the CUDA
# runtime's from nvidia-cuda-runtime / nvidia-cuda-crt 13.0. -fsyntax-only: every template is
# instantiated and every virtual of CUDAAllocator must be overridden (the class is instantiated),
# but nothing is linked. The downloads are cached under the target folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
TORCH_VERSION=${CCA_SHIM_TORCH_VERSION:-2.11.0}
CACHE="${CARGO_TARGET_DIR:-$PWD/target}/torch-headers-$TORCH_VERSION"
t0=$SECONDS
if [ ! -f "$CACHE/ok" ]; then
  rm -rf "$CACHE"
  mkdir -p "$CACHE/dl"
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$CACHE/dl" \
    "torch==$TORCH_VERSION" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*"
  (cd "$CACHE" && python3 - <<'PY'
import glob, zipfile
for whl in glob.glob("dl/*.whl"):
    with zipfile.ZipFile(whl) as z:
        for n in z.namelist():
            if "/include/" in n:
                z.extract(n, ".")
PY
  )
  rm -rf "$CACHE/dl"
  touch "$CACHE/ok"
fi
echo "headers ready in $((SECONDS - t0)) s"
PYINC=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
${CXX:-c++} -std=c++17 -fsyntax-only -Wall -Werror -DTORCH_EXTENSION_NAME=cca_shim \
  -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI=1 \
  -isystem "$CACHE/torch/include" -isystem "$CACHE/torch/include/torch/csrc/api/include" \
  -isystem "$CACHE/nvidia/cu13/include" -isystem "$PYINC" \
  python/cuda_caching_allocator/csrc/cca_shim.cpp
echo "shim compiles against torch $TORCH_VERSION headers ($((SECONDS - t0)) s)"
# The GPU suite's A/B allocator (gpu/ab_shim.cpp, clients.py --ab) against the same headers.
${CXX:-c++} -std=c++17 -fsyntax-only -Wall -Werror -DTORCH_EXTENSION_NAME=ab_shim \
  -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI=1 \
  -isystem "$CACHE/torch/include" -isystem "$CACHE/torch/include/torch/csrc/api/include" \
  -isystem "$CACHE/nvidia/cu13/include" -isystem "$PYINC" \
  gpu/ab_shim.cpp
echo "gpu/ab_shim.cpp compiles against torch $TORCH_VERSION headers ($((SECONDS - t0)) s)"
