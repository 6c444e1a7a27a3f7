#!/usr/bin/env bash
# Runs the whole GPU suite on the device machine in one go; staged next to the binaries by
# gpu/build.sh. Logs go to $OUT (the device tool's output folder), a summary is printed last.
#
#   bash gpu-bin/run.sh [PHASE...]    # phases: tests example torch safety sanitizer (the default:
#                                     # all five), and on request: multigpu (only the multi-GPU and
#                                     # context tests), replay (cca replay --device cuda on the
#                                     # shipped traces; CCA_REPLAY_DEVICE=N picks the GPU, default 0),
#                                     # pinned (the pinned host cache benchmark and PyTorch's
#                                     # caching host allocator on the same mixed workload)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/cca-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CCA_TEST_CUDA=1 RUST_BACKTRACE=1
S="$OUT/summary.txt"
{
  echo "== cuda-caching-allocator GPU run"
  date -u +%Y-%m-%dT%H:%M:%SZ
  cat "$HERE/BUILD_INFO"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$S"

step() { # name, command...
  local name=$1; shift
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($((SECONDS - t0)) s)" | tee -a "$S"
  return $rc
}

PHASES=${*:-tests example torch safety sanitizer}
GPU_TESTS=${CCA_GPU_TESTS:-"cuda:: cuda_streams:: cuda_capture:: cuda_port:: cuda_pinned::"}
BUDGET=${CCA_GPU_BUDGET_S:-570}   # stay inside the device tool's 600 s per command
left() { echo $(( BUDGET - SECONDS > 30 ? BUDGET - SECONDS : 30 )); }

for phase in $PHASES; do
  case $phase in
  tests) # The test suite, single-threaded (several tests read device-wide free memory).
    step tests timeout 240 "$HERE/cuda_tests" $GPU_TESTS --test-threads=1 --nocapture
    grep -E '^test result|FAILED|panicked' "$OUT/tests.log" | tee -a "$S" ;;
  example) # The migration example (cached vs uncached results, cuBLAS).
    step example timeout 60 "$HERE/cudarc_migration"
    grep -E 'axpy|cuBLAS' "$OUT/example.log" | tee -a "$S"
    step example_framework timeout 60 "$HERE/framework_storage"
    tail -5 "$OUT/example_framework.log" | tee -a "$S" ;;
  torch) # PyTorch: GPT-2 training with the native allocator and with ours, compared.
    step torch timeout 300 python3 "$HERE/torch_client.py" --so "$HERE/libtorch_plugin.so" --json "$OUT/torch.json"
    sed -n '/== PyTorch comparison ==/,$p' "$OUT/torch.log" | tee -a "$S" ;;
  safety) # PyTorch stream and graph safety probes (record_stream race, graph capture), native
    # against the plugin installed by cuda_caching_allocator.torch.enable(), with a control arm.
    step safety timeout 300 python3 "$HERE/python/tests/torch_safety.py" \
      --library "$HERE/libtorch_plugin.so" --json "$OUT/safety.json"
    grep -E '^== |^   |control arm' "$OUT/safety.log" | cut -c1-300 | tee -a "$S" ;;
  sanitizer) # The suite and the example under compute-sanitizer memcheck, in the time left.
    # API-error reports are off: the OOM tests fail cuMemAlloc on purpose (3 reports otherwise);
    # memory-access errors, leaks of device allocations excepted, still fail the run.
    CCA_UNDER_SANITIZER=1 step sanitizer timeout "$(left)" compute-sanitizer --tool memcheck \
      --report-api-errors no --error-exitcode 99 "$HERE/cuda_tests" $GPU_TESTS --test-threads=1
    grep -E '^test |^test result|ERROR SUMMARY|FAILED|panicked' "$OUT/sanitizer.log" | tee -a "$S"
    step sanitizer_example timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 \
      "$HERE/cudarc_migration"
    grep -E 'ERROR SUMMARY' "$OUT/sanitizer_example.log" | tee -a "$S" ;;
  multigpu) # Only the multi-GPU tests and the context-binding test (with fewer than 2 GPUs the
    # multi-GPU tests print that they need 2 and pass).
    step multigpu timeout 200 "$HERE/cuda_tests" multi_gpu current_context --test-threads=1 --nocapture
    grep -E '^test |^test result|FAILED|panicked|skipped|multi-GPU' "$OUT/multigpu.log" | tee -a "$S" ;;
  replay) # cca replay on a real GPU: the three shipped traces under pytorch and default, as text
    # (with PyTorch's figures from reference.json) in replay.log and as one JSON array in
    # replay.json, then one compare; few files, so that all of $OUT comes back.
    dev="cuda:${CCA_REPLAY_DEVICE:-0}"
    tmp=$(mktemp)
    : >"$OUT/replay.log"
    echo "[" >"$OUT/replay.json"
    sep=""
    for t in "$HERE"/traces/*.csv.gz; do
      name=$(basename "$t" .csv.gz)
      for preset in pytorch default; do
        t0=$SECONDS
        timeout 120 "$HERE/cca" replay "$t" --device "$dev" --preset "$preset" >"$tmp" 2>&1
        rc=$?
        { echo "== cca replay $name --device $dev --preset $preset: rc=$rc"; cat "$tmp"; echo; } >>"$OUT/replay.log"
        echo "replay $name $preset: rc=$rc ($((SECONDS - t0)) s)" | tee -a "$S"
        grep -E '^(configuration|device) |peak (allocated|reserved)|device allocs|OOMs|host ns|wall' \
          "$tmp" | sed 's/^/    /' | tee -a "$S"
        if timeout 120 "$HERE/cca" replay "$t" --device "$dev" --preset "$preset" --json >"$tmp" 2>>"$OUT/replay.log"; then
          { printf '%s' "$sep"; cat "$tmp"; } >>"$OUT/replay.json"
          sep=","
        fi
      done
    done
    echo "]" >>"$OUT/replay.json"
    t0=$SECONDS
    timeout 180 "$HERE/cca" compare "$HERE/traces/gpt2_train.csv.gz" --device "$dev" >"$tmp" 2>&1
    rc=$?
    { echo "== cca compare gpt2_train --device $dev: rc=$rc"; cat "$tmp"; } >>"$OUT/replay.log"
    echo "replay compare gpt2_train: rc=$rc ($((SECONDS - t0)) s)" | tee -a "$S"
    sed 's/^/    /' "$tmp" | tee -a "$S"
    rm -f "$tmp" ;;
  pinned) # The pinned host cache (#16): alloc+free, bandwidth cached vs freshly pinned, the
    # double-buffered pipeline, the mixed workload; then PyTorch's own caching host allocator on
    # that workload.
    step pinned timeout 300 "$HERE/pinned_bench"
    grep -E '^(==|--)|^pair|GB/s|cached /|^(default|tight|frugal|power)' "$OUT/pinned.log" | tee -a "$S"
    step pinned_torch timeout 200 python3 "$HERE/pinned_torch.py" --json "$OUT/pinned_torch.json"
    grep -vE '^\s*$' "$OUT/pinned_torch.log" | tail -20 | tee -a "$S" ;;
  *) echo "unknown phase $phase (tests example torch sanitizer multigpu replay pinned)" | tee -a "$S" ;;
  esac
done
