#!/usr/bin/env bash
# Runs the whole GPU suite on the device machine in one go; staged next to the binaries by
# gpu/build.sh. Logs go to $OUT (the device tool's output folder), a summary is printed last.
#
#   bash gpu-bin/run.sh [PHASE...]    # phases: tests example torch safety sanitizer (the default:
#                                     # all five), and on request: multigpu (only the multi-GPU and
#                                     # context tests; they fail with fewer than 2 GPUs), replay
#                                     # (cca replay --device cuda on the shipped traces;
#                                     # CCA_REPLAY_DEVICE=N picks the GPU, default 0), cold (cold
#                                     # replays beside PyTorch's own allocator), ports
#                                     # (examples/ports: plain vs cached, memcheck; ports.sh),
#                                     # package (pip-installs the staged wheel into a venv and runs
#                                     # the PyTorch conformance script and the safety probes
#                                     # through it), install (only the wheel's pip install),
#                                     # package_client (after package: the GPT-2
#                                     # client through the installed package), clients (after
#                                     # package: the #11 client suite, gpu/clients.py), record
#                                     # (native runs of the clients recording PyTorch's memory
#                                     # history as snapshot pickles), hostpair (after package or
#                                     # install: host ns per allocate + free through PyTorch,
#                                     # gpu/host_pair.py), ab (after package or install:
#                                     # clients.py --ab, native and the crate in one process),
#                                     # bench (gpu_bench --device
#                                     # cuda), pairs (gpu_bench --pairs-rounds: the
#                                     # cached pair alone, interleaved rounds), pinned (the pinned host cache benchmark beside
#                                     # PyTorch's host cache), probes (after package or
#                                     # install: gpu/probes/torch_review.py and, on 2 GPUs,
#                                     # gpu/probes/nccl_register.py; CCA_SKIP_IPC=1 leaves
#                                     # out the CUDA IPC probes, which with the others do not
#                                     # fit in one 600 s device call), ipc (only the CUDA IPC
#                                     # probes), probes_two (only the probes that need 2 GPUs)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/cca-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
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
GPU_TESTS=${CCA_GPU_TESTS:-"cuda:: cuda_streams:: cuda_capture:: cuda_port:: cuda_pinned:: interop_review2:: interop_review3:: pinned_review::"}
# The GPU tests are #[ignore]d (cargo test on a machine without a GPU lists them as ignored):
# --include-ignored runs them. The multi_gpu tests fail on one GPU, so they are left out there.
GPU_TEST_ARGS="--include-ignored --test-threads=1"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [ "$NGPU" -lt 2 ]; then
  GPU_TEST_ARGS="$GPU_TEST_ARGS --skip multi_gpu"
  echo "$NGPU GPU: the multi_gpu tests are left out (--skip multi_gpu)" | tee -a "$S"
fi
BUDGET=${CCA_GPU_BUDGET_S:-570}   # stay inside the device tool's 600 s per command
left() { echo $(( BUDGET - SECONDS > 30 ? BUDGET - SECONDS : 30 )); }

for phase in $PHASES; do
  case $phase in
  tests) # The test suite, single-threaded (several tests read device-wide free memory).
    step tests timeout 240 "$HERE/cuda_tests" $GPU_TESTS $GPU_TEST_ARGS --nocapture
    grep -E '^test result|FAILED|panicked' "$OUT/tests.log" | tee -a "$S" ;;
  example) # The migration example (cached vs uncached results, cuBLAS).
    step example timeout 60 "$HERE/cudarc_migration"
    grep -E 'axpy|cuBLAS' "$OUT/example.log" | tee -a "$S"
    step example_framework timeout 60 "$HERE/framework_storage"
    tail -5 "$OUT/example_framework.log" | tee -a "$S" ;;
  torch) # PyTorch: GPT-2 training with the native allocator and with ours, compared.
    step torch timeout 300 python3 "$HERE/torch_client.py" --so "$HERE/libcca_torch.so" --json "$OUT/torch.json"
    sed -n '/== PyTorch comparison ==/,$p' "$OUT/torch.log" | tee -a "$S" ;;
  safety) # PyTorch stream and graph safety probes (record_stream race, graph capture), native
    # against the plugin installed by cuda_caching_allocator.torch.enable(), with a control arm.
    step safety timeout 300 python3 "$HERE/python/tests/torch_safety.py" \
      --library "$HERE/libcca_torch.so" --json "$OUT/safety.json"
    grep -E '^== |^   |control arm' "$OUT/safety.log" | cut -c1-300 | tee -a "$S" ;;
  sanitizer) # The suite and the example under compute-sanitizer memcheck, in the time left.
    # API-error reports are off: the OOM tests fail cuMemAlloc on purpose (3 reports otherwise);
    # memory-access errors, leaks of device allocations excepted, still fail the run.
    # CCA_SANITIZER_S caps the suite's time; CCA_SANITIZER_EXAMPLE=0 leaves the example out.
    cap=$(left); [ -n "${CCA_SANITIZER_S:-}" ] && [ "$CCA_SANITIZER_S" -lt "$cap" ] && cap=$CCA_SANITIZER_S
    CCA_UNDER_SANITIZER=1 step sanitizer timeout "$cap" compute-sanitizer --tool memcheck \
      --report-api-errors no --error-exitcode 99 "$HERE/cuda_tests" $GPU_TESTS $GPU_TEST_ARGS
    grep -E '^test |^test result|ERROR SUMMARY|FAILED|panicked' "$OUT/sanitizer.log" | tee -a "$S"
    if [ "${CCA_SANITIZER_EXAMPLE:-1}" != 0 ]; then
      step sanitizer_example timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 \
        "$HERE/cudarc_migration"
      grep -E 'ERROR SUMMARY' "$OUT/sanitizer_example.log" | tee -a "$S"
    fi ;;
  multigpu) # Only the multi-GPU tests and the context-binding test (with fewer than 2 GPUs the
    # multi-GPU tests fail, saying that they need 2).
    step multigpu timeout 200 "$HERE/cuda_tests" multi_gpu current_context --include-ignored \
      --test-threads=1 --nocapture
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
  cold) # Cold replays side by side (#11): PyTorch's own allocator (native, native expandable,
    # through native_replay.py) against cca replay --device cuda under several configurations,
    # fresh process each, interleaved, CCA_COLD_REPS repeats (default 3).
    step cold timeout "$(left)" python3 "$HERE/cold_replay.py" --cca "$HERE/cca" --traces "$HERE/traces" \
      --reps "${CCA_COLD_REPS:-3}" --jsonl "$OUT/cold.jsonl"
    grep -E '^\|' "$OUT/cold.log" | tee -a "$S" ;;
  ports) # The port pairs: plain cudarc vs cached outputs compared, cached under memcheck.
    step ports timeout "$(left)" bash "$HERE/ports.sh"
    tail -n 30 "$OUT/ports.log" | tee -a "$S" ;;
  install) # Only the pip install of the staged wheel that `package` starts with (for `clients`
    # alone, without the conformance and safety runs).
    step package_install python3 -m pip install --no-deps --no-index --no-build-isolation \
      --force-reinstall "$HERE"/cuda_caching_allocator-*.whl ;;
  package) # The PyTorch package from the staged wheel (no Rust, no network), pip-installed into
    # the Python that has torch (as a user would), the C++ shim compiled at the first enable(),
    # then python/tests/torch_conformance.py (one PASS/FAIL line per PyTorch API) and the safety
    # probes through the package.
    step package_install python3 -m pip install --no-deps --no-index --no-build-isolation \
      --force-reinstall "$HERE"/cuda_caching_allocator-*.whl
    export CCA_SHIM_BUILD_DIR=/tmp/cca-shim-build
    step conformance timeout 420 python3 "$HERE/python/tests/torch_conformance.py" --out "$OUT"
    grep -E '^(PASS|FAIL) |passed, .* failed|^torch ' "$OUT/conformance.log" | cut -c1-400 | tee -a "$S"
    PKG_LIB=$(cd /tmp && python3 -c 'import importlib.util as u; print(u.find_spec("cuda_caching_allocator._cca").origin)')
    step package_safety timeout 300 python3 "$HERE/python/tests/torch_safety.py" \
      --library "$PKG_LIB" --json "$OUT/package_safety.json"
    grep -E '^== |^   |control arm' "$OUT/package_safety.log" | cut -c1-300 | tee -a "$S" ;;
  package_client) # After `package`: the GPT-2 client with its cca runs through the installed
    # package (shim route), compared with native as in the torch phase.
    PKG_LIB=$(cd /tmp && python3 -c 'import importlib.util as u; print(u.find_spec("cuda_caching_allocator._cca").origin)')
    CCA_CLIENT_PACKAGE=1 CCA_SHIM_BUILD_DIR=/tmp/cca-shim-build step package_client timeout 400 \
      python3 "$HERE/torch_client.py" --so "$PKG_LIB" --json "$OUT/package_client.json"
    grep -E 'package route' "$OUT/package_client.log" | sort | uniq -c | tee -a "$S"
    sed -n '/== PyTorch comparison ==/,$p' "$OUT/package_client.log" | tee -a "$S" ;;
  clients) # After `package` or `install`: the real-client suite of #11 (gpu/clients.py), each allocator in
    # its own process; CCA_CLIENTS picks the workloads (default: sidestream generate ckpt; ddp
    # and fsdp need 2 GPUs), CCA_CLIENT_REPS the interleaved repeats, CCA_CLIENT_ARGS more
    # clients.py arguments (e.g. "--steps 20 --warmup 6").
    PKG_DIR=$(cd /tmp && python3 -c 'import importlib.util as u, os; print(os.path.dirname(os.path.dirname(u.find_spec("cuda_caching_allocator").origin)))')
    CCA_SHIM_BUILD_DIR=/tmp/cca-shim-build step clients timeout "$(left)" python3 \
      "$HERE/clients.py" --python-dir "$PKG_DIR" --workloads ${CCA_CLIENTS:-sidestream generate ckpt} \
      --json "$OUT/clients.json" ${CCA_CLIENT_ARGS:-}
    grep -E '^== |^\||FAILED' "$OUT/clients.log" | cut -c1-300 | tee -a "$S" ;;
  ab) # After `package` or `install`: clients.py --ab, PyTorch native and one crate configuration
    # in one process (gpu/ab_shim.cpp), every input under both; CCA_CLIENTS picks the workloads,
    # CCA_CLIENT_REPS the processes per workload, CCA_CLIENT_ARGS more arguments (e.g.
    # "--allocators cca-default cca-no-fast --host-timing").
    PKG_DIR=$(cd /tmp && python3 -c 'import importlib.util as u, os; print(os.path.dirname(os.path.dirname(u.find_spec("cuda_caching_allocator").origin)))')
    CCA_SHIM_BUILD_DIR=/tmp/cca-shim-build step ab timeout "$(left)" python3 \
      "$HERE/clients.py" --ab --python-dir "$PKG_DIR" --workloads ${CCA_CLIENTS:-sidestream generate ckpt} \
      --json "$OUT/ab.json" ${CCA_CLIENT_ARGS:-}
    grep -E '^== |^\||FAILED' "$OUT/ab.log" | cut -c1-600 | tee -a "$S" ;;
  hostpair) # After `package` or `install`: host ns per allocate + free through PyTorch's own
    # entry point, native against the crate's configurations (gpu/host_pair.py), one thread and
    # across two threads; CCA_HOSTPAIR_REPS interleaved repeats (default 3).
    PKG_DIR=$(cd /tmp && python3 -c 'import importlib.util as u, os; print(os.path.dirname(os.path.dirname(u.find_spec("cuda_caching_allocator").origin)))')
    CCA_SHIM_BUILD_DIR=/tmp/cca-shim-build step hostpair timeout "$(left)" python3 \
      "$HERE/host_pair.py" --python-dir "$PKG_DIR" --reps "${CCA_HOSTPAIR_REPS:-3}" --json "$OUT/host_pair.json"
    grep -E '^\||FAILED' "$OUT/hostpair.log" | cut -c1-300 | tee -a "$S" ;;
  record) # PyTorch native runs of the single-GPU clients with PyTorch's memory history on, each
    # dumped as a snapshot pickle (gzipped) under $OUT/traces: our own traces of these workloads,
    # for cca replay on SimDevice. Needs no package (native only).
    step record timeout "$(left)" python3 "$HERE/clients.py" --python-dir "$HERE/python" \
      --workloads ${CCA_CLIENTS:-sidestream generate ckpt} --record "$OUT/traces"
    gzip -f "$OUT"/traces/*.pickle 2>/dev/null
    ls -la "$OUT/traces" | tee -a "$S" ;;
  bench) # Host-side timings (gpu_bench --device cuda): pairs, 1-16 threads, replays, for pytorch
    # and the default, each without and with the fast path.
    step bench timeout "$(left)" "$HERE/gpu_bench" --device cuda --traces "$HERE/traces" \
      --json "$OUT/bench.json"
    grep -E '^\||own streams' "$OUT/bench.log" | tee -a "$S" ;;
  pairs) # The cached pair alone (#11, goal 5): gpu_bench --pairs-rounds, pytorch+fast and the
    # default interleaved round by round (CCA_PAIR_ROUNDS rounds, default 9).
    step pairs timeout "$(left)" "$HERE/gpu_bench" --device cuda \
      --pairs-rounds "${CCA_PAIR_ROUNDS:-9}" --json "$OUT/pairs.json"
    sed -n '/^over/,$p' "$OUT/pairs.log" | tee -a "$S" ;;
  pinned) # The pinned host cache (#16): alloc+free, bandwidth cached vs freshly pinned, the
    # double-buffered pipeline, the mixed workload; then PyTorch's own caching host allocator on
    # that workload.
    step pinned timeout "$(( $(left) < 300 ? $(left) : 300 ))" "$HERE/pinned_bench"
    grep -E '^(==|--)|pair|GB/s|cached /|host pages|^goal|^(default|tight|frugal|power)| MiB:' "$OUT/pinned.log" | tee -a "$S"
    step pinned_torch timeout "$(( $(left) < 200 ? $(left) : 200 ))" python3 "$HERE/pinned_torch.py" --json "$OUT/pinned_torch.json"
    grep -vE '^\s*$' "$OUT/pinned_torch.log" | tail -20 | tee -a "$S" ;;
  probes|probes_two|ipc) # After `package` or `install`: the PyTorch package's review probes
    # (gpu/probes/torch_review.py, each in its own process; the peer probes need 2 GPUs) and, on 2
    # GPUs, NCCL's user-buffer registration through the segment trace entries
    # (gpu/probes/nccl_register.py: native, native expandable, the crate's default and preset).
    # probes_two: only what needs 2 GPUs (the peer probes, device_guard, nccl_register), which
    # with the one-GPU probes does not fit in one device call.
    export CCA_SHIM_BUILD_DIR=/tmp/cca-shim-build
    P="$HERE/probes/torch_review.py"
    ONE="trace_time/native trace_time/cca annotations/native annotations/cca bad_delete/native bad_delete/cca tracker/native tracker/cca tracker/cca/cca_preset:pytorch pool_snapshot_empty/native pool_snapshot_empty/cca runtime_settings/native runtime_settings/cca runtime_settings/cca/cca_preset:pytorch compile_context/native compile_context/cca graph_tree_checkpoint/native graph_tree_checkpoint/cca graph_tree_checkpoint/cca/cca_preset:pytorch use_on_oom/native use_on_oom/cca use_on_oom/cca/cca_preset:pytorch use_on_oom_order/native use_on_oom_order/cca/cca_preset:pytorch no_split/native no_split/cca no_split/cca/cca_preset:pytorch free_completed/native free_completed/cca free_completed/cca/cca_preset:pytorch gpu_trace/native gpu_trace/cca caching_disabled/native caching_disabled/cca no_caching_env/native no_caching_env/cca oom_device_free/native oom_device_free/cca oom_sizes/native oom_sizes/cca oom_sizes/cca/cca_preset:pytorch oom_state_context/native oom_state_context/cca snapshot_entry/native snapshot_entry/cca reset_peak_moves/cca pool_route_no_capture/native pool_route_no_capture/cca pool_route_no_capture/cca-pluggable enable_after_init/cca enable_after_init/cca-pluggable fork_child/native fork_child/cca fork_child/cca-pluggable empty_cache_in_pool/cca oom_capture/cca oom_pool/cca cache_info/cca oom_observer_fraction/cca foreign_stream_alloc/cca"
    TWO="record_stream_peer/native record_stream_peer/cca record_stream_peer/cca/cca_preset:pytorch peer_copy/cca peer_copy/cca/cca_preset:pytorch record_stream_capture/cca record_stream_capture/cca/cca_preset:pytorch checkpoint_deferred_free/native checkpoint_deferred_free/cca checkpoint_deferred_free/cca/cca_preset:pytorch"
    [ "$phase" = probes_two ] && ONE=""
    [ "$phase" = ipc ] && ONE="" && TWO=""
    [ "$NGPU" -ge 2 ] && ONE="$ONE $TWO"
    for a in $ONE; do
      n=${a//[\/:]/_}
      step "review_$n" timeout 150 python3 "$P" ${a//\// }
      grep -E '^(PASS|FAIL)' "$OUT/review_$n.log" | cut -c1-300 | tee -a "$S"
    done
    [ "$phase" = probes_two ] || [ "${CCA_SKIP_IPC:-0}" = 1 ] || for a in cca/native cca/cca native/cca cca/native/default cca/cca/default native-expandable/cca native-expandable/native cca/native-expandable/default; do
      n=${a//[\/:]/_}
      step "cuda_ipc_$n" timeout 150 python3 "$HERE/probes/cuda_ipc.py" ${a//\// }
      grep -E '^(PASS|FAIL)' "$OUT/cuda_ipc_$n.log" | cut -c1-300 | tee -a "$S"
    done
    if [ "$NGPU" -ge 2 ] && [ "$phase" != ipc ]; then
      # A release in a thread that never chose a device must not make a context on GPU 0.
      for a in native/native native/cca native/cca/cca_preset:pytorch native-expandable/native native-expandable/cca; do
        n=${a//[\/:]/_}
        step "device_guard_$n" timeout 150 python3 "$HERE/probes/device_guard.py" ${a//\// }
        grep -E '^(PASS|FAIL|INCONCLUSIVE)' "$OUT/device_guard_$n.log" | cut -c1-300 | tee -a "$S"
      done
      for a in native native-expandable cca cca/cca_preset:pytorch cca/flip cca/cca_preset:pytorch/flip; do
        n=${a//[\/:]/_}
        step "nccl_register_$n" timeout 200 python3 "$HERE/probes/nccl_register.py" ${a//\// }
        grep -E '^(PASS|FAIL)' "$OUT/nccl_register_$n.log" | cut -c1-600 | tee -a "$S"
      done
    fi ;;
  *) echo "unknown phase $phase (tests example torch safety sanitizer multigpu replay cold ports install package package_client clients ab hostpair record bench pinned probes probes_two ipc)" | tee -a "$S" ;;
  esac
done
