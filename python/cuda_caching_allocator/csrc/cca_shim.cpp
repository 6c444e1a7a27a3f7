// cuda-caching-allocator as a full PyTorch CUDA allocator: a c10::cuda::CUDACachingAllocator::
// CUDAAllocator over the C ABI of the package's native library (python/src/*.rs), compiled
// against the user's installed torch by torch.utils.cpp_extension at the first enable() and
// installed by install() below through changeCurrentAllocator. See docs/pytorch.md.
//
// What the native library keeps: every byte (its caches, per device), its statistics, graph and
// MemPool private pools. What this shim keeps: the live allocations' sizes, devices, streams,
// pools and (with _record_memory_history) stack contexts, the history ring of trace entries, the
// OOM observers and trace trackers, and the active pool routings (so that allocations know their
// pool for checkPoolLiveAllocations and per-pool snapshots). It never allocates device memory
// itself. Every failure of the library is raised as a Python exception carrying its message:
// torch.OutOfMemoryError when out of memory, RuntimeError otherwise.

#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/extension.h>

#include <c10/core/Allocator.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/env.h>

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace cca {

using c10::MempoolId_t;
using c10::cuda::CUDAStream;
namespace CCA = c10::cuda::CUDACachingAllocator;
using CCA::AllocatorState;
using CCA::CheckpointDelta;
using CCA::OutOfMemoryObserver;
using CCA::ShareableHandle;
using CCA::SnapshotInfo;
using CCA::StreamSegmentSize;
using c10::CachingDeviceAllocator::AllocatorTraceTracker;
using c10::CachingDeviceAllocator::AnnotationEntry;
using c10::CachingDeviceAllocator::BlockInfo;
using c10::CachingDeviceAllocator::CreateContextFn;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::SegmentInfo;
using c10::CachingDeviceAllocator::TraceEntry;

constexpr int kAbiVersion = 7;

// Numbers and addresses in error messages are formatted here, not streamed: on the GPU machine
// an error message that streamed a size_t into TORCH_CHECK crashed the process inside the
// shim's own instance of std::ostream::_M_insert<unsigned long> (SIGSEGV where PyTorch raises),
// while messages made only of strings were fine. std::to_string and snprintf do not go through
// the stream's locale facets.
template <typename T>
std::string num(T v) {
  static_assert(std::is_integral_v<T>, "num formats integers");
  return std::to_string(+v);  // + promotes int8_t device indices to a number
}
inline std::string addr(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return std::string(buf);
}
// Each message is also joined here into one std::string before it reaches TORCH_CHECK /
// TORCH_WARN, so that c10::str has a single string to pass on and builds no stream at all.
inline void append_piece(std::string& out, const char* p) { out.append(p ? p : "(null)"); }
inline void append_piece(std::string& out, const std::string& p) { out.append(p); }
template <typename... A>
std::string cat(const A&... pieces) {
  std::string out;
  (append_piece(out, pieces), ...);
  return out;
}

// Host time spent in the allocator, opt-in (CCA_HOST_TIMING=1 in the environment when the shim
// is created): nanoseconds and calls of allocate (malloc_on) and free (free_ptr), the shim's own
// work included, summed over every thread. Off, each call pays one relaxed load. It tells how
// much of a step the allocator's host path takes (docs/pytorch.md, "Host time").
struct HostTiming {
  std::atomic<bool> on{false};
  std::atomic<uint64_t> alloc_ns{0}, alloc_calls{0}, free_ns{0}, free_calls{0};
};
HostTiming g_timing;

// Adds the time since `t0` to `ns` and one to `calls` when timing is on.
class TimedScope {
 public:
  TimedScope(std::atomic<uint64_t>& ns, std::atomic<uint64_t>& calls)
      : ns_(ns), calls_(calls), on_(g_timing.on.load(std::memory_order_relaxed)) {
    if (on_) t0_ = std::chrono::steady_clock::now();
  }
  ~TimedScope() {
    if (!on_) return;
    auto d = std::chrono::steady_clock::now() - t0_;
    ns_.fetch_add(static_cast<uint64_t>(
                      std::chrono::duration_cast<std::chrono::nanoseconds>(d).count()),
                  std::memory_order_relaxed);
    calls_.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  std::atomic<uint64_t>& ns_;
  std::atomic<uint64_t>& calls_;
  bool on_;
  std::chrono::steady_clock::time_point t0_;
};

// ---- the native library's C ABI (python/src/*.rs), resolved with dlsym ----------------------

struct CPool {
  uint64_t first;
  uint64_t second;
};
struct CStat {
  int64_t current, peak, allocated, freed;
};
struct CDeviceStats {
  CStat allocation[3], segment[3], active[3], inactive_split[3], allocated_bytes[3],
      reserved_bytes[3], active_bytes[3], inactive_split_bytes[3], requested_bytes[3];
  CStat oversize_allocations, oversize_segments;
  int64_t num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free,
      max_split_size;
};
struct CSegment {
  uint64_t address, total_size, stream;
  int is_large, is_expandable;
  uint64_t num_blocks;
  CPool pool;  // the segment's private pool, (0, 0) for the default pools
};
struct CBlock {
  uint64_t address, size, requested_size;
  int state;  // 0 allocated, 1 pending free, 2 inactive
};

// One block of a checkpointed segment, as cca_restore_pool reads it (python/src/pools.rs).
struct CCheckpointBlock {
  uint64_t address, size;
  uint32_t allocated, segment_start;
};
static_assert(sizeof(CCheckpointBlock) == 24, "CcaCheckpointBlock layout");

// The layouts python/src/introspect.rs asserts too.
static_assert(sizeof(CDeviceStats) == 976, "CcaDeviceStats layout");
static_assert(sizeof(CSegment) == 56, "CcaSegment layout");
static_assert(offsetof(CSegment, pool) == 40, "CcaSegment layout");
static_assert(sizeof(CBlock) == 32, "CcaBlock layout");
static_assert(sizeof(CPool) == 16, "MempoolId layout");

using AcceptFn = bool (*)(void*, void*);
using DropFn = void (*)(void*);
using SegFn = void (*)(void*, const CSegment*);
// cca_set_segment_callback's callback: (ctx, action 0 alloc / 1 free / 2 map / 3 unmap of a
// segment or pages, 4 a block whose free waited for recorded streams is back in the cache,
// device, address, size, stream, pool).
using SegmentEventFn = void (*)(void*, int, int, uint64_t, uint64_t, void*, CPool);
using BlockFn = void (*)(void*, const CBlock*);

struct Api {
  int (*abi_version)();
  void* (*alloc)(ssize_t, int, void*);
  void (*free)(void*, ssize_t, int, void*);
  int (*free_checked)(void*, ssize_t, int, void*);
  void (*record_stream)(void*, void*);
  int (*record_stream_checked)(void*, void*);
  void (*init)(int);
  int (*check_config)();
  int (*empty_cache)(int);
  void (*reset_peak_stats)(int);
  void (*reset_accumulated_stats)(int);
  int (*set_memory_fraction)(int, double);
  int (*enable_peer_access)(int, int);
  double (*memory_fraction)(int);
  int (*device_stats)(int, CDeviceStats*);
  int (*snapshot)(int, SegFn, BlockFn, void*);
  uint64_t (*cache_info)(int);
  uint64_t (*base_allocation)(int, uint64_t, uint64_t*);
  int (*begin_with)(int, CPool, AcceptFn, void*, DropFn);
  void (*end_pool)(int, CPool);
  void (*release_pool)(int, CPool);
  int (*create_pool)(int, CPool);
  int (*pool_use_count)(int, CPool);
  int (*restore_pool)(int, CPool, const CCheckpointBlock*, size_t, void (*)(void*, uint64_t, int),
                      void*);
  int (*set_use_on_oom)(int, CPool, int);
  int (*set_no_split)(int, CPool, int);
  const char* (*last_error)();
  int (*last_error_kind)();
  int (*last_oom_sizes)(size_t*, size_t*);
  int (*set_quiet)(int);
  int (*set_segment_callback)(SegmentEventFn, void*);
  int (*config_expandable)();
  long (*settings_not_applied)(const char*, char*, size_t);
  ssize_t (*export_pages)(int, uint64_t, int*, size_t, uint64_t*, uint64_t*, int*);
  void* (*import_pages)(int, int, uint64_t, const int*, size_t, uint64_t*);
  void (*close_imported)(void*);
};

template <typename F>
void bind(void* lib, const char* name, F& slot) {
  void* sym = dlsym(lib, name);
  TORCH_CHECK(sym != nullptr, cat("cuda_caching_allocator: the native library lacks ", name,
                                  " (a library from another version of the package?)"));
  slot = reinterpret_cast<F>(sym);
}

Api load_api(const std::string& path) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(lib != nullptr,
              cat("cuda_caching_allocator: cannot load the native library ", path, ": ", dlerror()));
  Api a{};
  bind(lib, "cca_abi_version", a.abi_version);
  TORCH_CHECK(a.abi_version() == kAbiVersion,
              cat("cuda_caching_allocator: the native library ", path, " has C ABI version ",
                  num(a.abi_version()), ", this shim needs ", num(kAbiVersion),
                  " (reinstall the package)"));
  bind(lib, "cca_alloc", a.alloc);
  bind(lib, "cca_free", a.free);
  bind(lib, "cca_free_checked", a.free_checked);
  bind(lib, "cca_record_stream", a.record_stream);
  bind(lib, "cca_record_stream_checked", a.record_stream_checked);
  bind(lib, "cca_init", a.init);
  bind(lib, "cca_check_config", a.check_config);
  bind(lib, "cca_empty_cache", a.empty_cache);
  bind(lib, "cca_reset_peak_stats", a.reset_peak_stats);
  bind(lib, "cca_reset_accumulated_stats", a.reset_accumulated_stats);
  bind(lib, "cca_set_memory_fraction", a.set_memory_fraction);
  bind(lib, "cca_enable_peer_access", a.enable_peer_access);
  bind(lib, "cca_memory_fraction", a.memory_fraction);
  bind(lib, "cca_device_stats", a.device_stats);
  bind(lib, "cca_snapshot", a.snapshot);
  bind(lib, "cca_cache_info", a.cache_info);
  bind(lib, "cca_base_allocation", a.base_allocation);
  bind(lib, "cca_begin_allocate_to_pool_with", a.begin_with);
  bind(lib, "cca_end_allocate_to_pool", a.end_pool);
  bind(lib, "cca_release_pool", a.release_pool);
  bind(lib, "cca_create_pool", a.create_pool);
  bind(lib, "cca_pool_use_count", a.pool_use_count);
  bind(lib, "cca_restore_pool", a.restore_pool);
  bind(lib, "cca_set_use_on_oom", a.set_use_on_oom);
  bind(lib, "cca_set_no_split", a.set_no_split);
  bind(lib, "cca_last_error", a.last_error);
  bind(lib, "cca_last_error_kind", a.last_error_kind);
  bind(lib, "cca_last_oom_sizes", a.last_oom_sizes);
  bind(lib, "cca_set_quiet", a.set_quiet);
  bind(lib, "cca_set_segment_callback", a.set_segment_callback);
  bind(lib, "cca_config_expandable", a.config_expandable);
  bind(lib, "cca_settings_not_applied", a.settings_not_applied);
  bind(lib, "cca_export_pages", a.export_pages);
  bind(lib, "cca_import_pages", a.import_pages);
  bind(lib, "cca_close_imported", a.close_imported);
  return a;
}

CPool cpool(MempoolId_t id) { return CPool{id.first, id.second}; }

void fill(c10::CachingAllocator::Stat& to, const CStat& from) {
  to.current = from.current;
  to.peak = from.peak;
  to.allocated = from.allocated;
  to.freed = from.freed;
}

void fill(c10::CachingAllocator::StatArray& to, const CStat (&from)[3]) {
  for (size_t i = 0; i < 3; ++i) fill(to[i], from[i]);
}

// What the shim knows of one live allocation.
struct Live {
  size_t size;
  c10::DeviceIndex device;
  cudaStream_t stream;
  MempoolId_t pool;
  std::shared_ptr<c10::GatheredContext> context;
  // Streams of other devices that Tensor.record_stream named (see record_foreign_use).
  std::vector<std::pair<c10::DeviceIndex, cudaStream_t>> foreign_uses;
  // Tensor.record_stream named another stream of this device: the free may leave the block
  // waiting.
  bool recorded = false;
  // Set at the free: the key of its FREE_COMPLETED entry to come in Shim::pending_frees_ (0
  // when none was registered).
  uint64_t pending_gen = 0;
};

// A free whose block waits for recorded streams' work: what its FREE_COMPLETED entry will say
// when the library calls back (Shim::on_segment, action 4).
struct PendingFree {
  size_t size;
  cudaStream_t stream;
  MempoolId_t pool;
  std::shared_ptr<c10::GatheredContext> context;
};

// PyTorch's PYTORCH_NO_CUDA_MEMORY_CACHING (or its HIP name): every allocation goes straight to
// cudaMalloc and back to cudaFree, as PyTorch's own allocator does (forceUncachedAllocator), so
// that compute-sanitizer sees each allocation's bounds.
bool force_uncached() {
  static const bool force = [] {
    try {
      return c10::utils::check_env("PYTORCH_NO_CUDA_MEMORY_CACHING") == true ||
             c10::utils::check_env("PYTORCH_NO_HIP_MEMORY_CACHING") == true;
    } catch (...) {
      return false;
    }
  }();
  return force;
}

// torch.cuda's GPU trace (the CUDA sanitizer, torch.utils._cuda_trace callbacks): told of every
// allocation handed out and every free, as PyTorch's allocator tells it.
void gpu_trace_alloc(void* p) {
  const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
  if (C10_UNLIKELY(interp)) {
    (*interp)->trace_gpu_memory_allocation(c10::kCUDA, reinterpret_cast<uintptr_t>(p));
  }
}
void gpu_trace_free(void* p) {
  const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
  if (C10_UNLIKELY(interp)) {
    (*interp)->trace_gpu_memory_deallocation(c10::kCUDA, reinterpret_cast<uintptr_t>(p));
  }
}

// cudaMalloc for the uncached mode (PyTorch's uncached_allocate): deliberately not capture-aware,
// so that a graph capture fails loudly, as PyTorch's does.
void* uncached_alloc(size_t n) {
  void* p = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&p, n));
  gpu_trace_alloc(p);
  return p;
}

// The deleter of uncached allocations (PyTorch's uncached_delete); warns instead of throwing,
// since deleters run where exceptions must not escape.
void uncached_delete_fn(void* p) {
  if (p == nullptr) return;
  gpu_trace_free(p);
  cudaError_t e = cudaFree(p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_WARN(std::string("cuda_caching_allocator: cudaFree of an uncached allocation failed: ") +
               cudaGetErrorString(e));
  }
}

// Makes `device` current for its lifetime and puts the caller's device back as PyTorch's
// CUDAGuard does: c10::cuda::MaybeSetDevice, which makes the old device current only where its
// primary context exists and otherwise just notes it, so that a thread that never chose a device
// (the runtime answers 0) does not get a context made on GPU 0 by the restore
// (gpu/probes/device_guard.py). Errors are cleared and otherwise ignored (it runs in deleters,
// which must not throw; a failed switch makes the calls below fail, and those failures are
// handled there).
struct DeviceScope {
  c10::DeviceIndex old = -1;  // the device to put back; -1: nothing to put back
  explicit DeviceScope(int device) noexcept {
    try {
      c10::DeviceIndex noted = -1;  // PyTorch's idea of the current device (may be only noted)
      int running = -1;             // the runtime's
      if (c10::cuda::GetDevice(&noted) != cudaSuccess || cudaGetDevice(&running) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
      }
      if (noted == device && running == device) return;
      if (c10::cuda::SetDevice(static_cast<c10::DeviceIndex>(device), /*force=*/true) !=
          cudaSuccess) {
        (void)cudaGetLastError();
        return;
      }
      old = noted;
    } catch (...) {
      (void)cudaGetLastError();
    }
  }
  ~DeviceScope() {
    if (old < 0) return;
    try {
      if (c10::cuda::MaybeSetDevice(old) != cudaSuccess) (void)cudaGetLastError();
    } catch (...) {
      // hasPrimaryContext throws once PyTorch's CUDA hooks are gone (at exit).
      (void)cudaGetLastError();
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
};

// The calling thread in relaxed capture mode for its lifetime: host waits on events are then
// legal while another thread captures a graph in global mode (gpu/probes/capture_queries.cu).
struct RelaxedCapture {
  cudaStreamCaptureMode old = cudaStreamCaptureModeRelaxed;
  RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&old); }
  ~RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&old); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;
};

// An active routing of allocations into a private pool (a capture, or use_mem_pool).
struct Route {
  c10::DeviceIndex device;
  MempoolId_t pool;
  std::shared_ptr<std::function<bool(cudaStream_t)>> filter;
};

// getCheckpointState's answer: the pool's layout at the checkpoint, each segment's blocks in
// address order (from the library's snapshot), with each block's segment stream.
struct Checkpoint : AllocatorState {
  c10::DeviceIndex device;
  MempoolId_t pool;
  std::vector<CCheckpointBlock> blocks;
  std::unordered_map<uint64_t, cudaStream_t> streams;
};

void raw_delete_fn(void* ptr);

// The stack context of the allocation the calling thread is making (set by malloc_on around the
// library's alloc), given to the SEGMENT_ALLOC / SEGMENT_MAP entries that allocation causes, as
// PyTorch gives them the allocation's context.
thread_local const std::shared_ptr<c10::GatheredContext>* t_alloc_context = nullptr;

// Set by on_segment when an allocation on this thread made or mapped device memory (the library
// calls the segment callback on the allocating thread, under its lock): malloc_on then runs
// PyTorch's free-memory callbacks, as PyTorch's allocator runs them on a cache miss.
thread_local bool t_grew = false;

// Sets t_alloc_context for its lifetime and restores the one it found.
struct AllocContextScope {
  const std::shared_ptr<c10::GatheredContext>* saved;
  explicit AllocContextScope(const std::shared_ptr<c10::GatheredContext>* ctx)
      : saved(t_alloc_context) {
    t_alloc_context = ctx;
  }
  ~AllocContextScope() { t_alloc_context = saved; }
  AllocContextScope(const AllocContextScope&) = delete;
  AllocContextScope& operator=(const AllocContextScope&) = delete;
};

// The calling thread's torch.compile region stack (pushCompileContext) and user metadata
// (setUserMetadata), stamped on the trace entries the thread causes, per thread as PyTorch keeps
// them (CUDACachingAllocator.cpp: static thread_local compile_context, user_metadata). Made on
// first use and never destroyed (one small leak per thread that sets them): the allocator is
// immortal and frees reach it during exit, after the main thread's thread_local destructors ran.
struct ThreadTraceState {
  std::vector<std::string> compile_context;
  std::string user_metadata;
};
thread_local ThreadTraceState* t_trace_state = nullptr;

ThreadTraceState& thread_trace_state() {
  if (t_trace_state == nullptr) t_trace_state = new ThreadTraceState();
  return *t_trace_state;
}

class Shim : public CCA::CUDAAllocator {
 public:
  Shim(Api api, std::string config)
      : api_(api), config_(std::move(config)), expandable_(api_.config_expandable() == 1) {
    api_.set_quiet(1);
    // Every device's cache reports its segments from now on (PyTorch's SEGMENT_* entries).
    TORCH_CHECK(api_.set_segment_callback(&Shim::on_segment, this) == 0,
                cat("cuda_caching_allocator: cca_set_segment_callback: ", api_.last_error()));
  }

  // Whether the library's configuration maps pages into expandable segments.
  bool expandable() const { return expandable_; }

  // The keys of `settings` (PyTorch's syntax) that would change the library's running
  // configuration, as "key (running -> asked)" items (empty: none). False, with the library's
  // message in `text`, when the library cannot read the string.
  bool settings_not_applied(const std::string& settings, std::string& text) {
    std::vector<char> buf(512);
    long n = api_.settings_not_applied(settings.c_str(), buf.data(), buf.size());
    if (n >= 0 && static_cast<size_t>(n) >= buf.size()) {
      buf.resize(static_cast<size_t>(n) + 1);
      n = api_.settings_not_applied(settings.c_str(), buf.data(), buf.size());
    }
    if (n < 0) {
      const char* why = api_.last_error();
      text = why != nullptr ? why : "unknown error";
      return false;
    }
    text.assign(buf.data());
    return true;
  }

  // ---- c10::Allocator ----------------------------------------------------------------------

  c10::DataPtr allocate(size_t n) override {
    c10::DeviceIndex dev = c10::cuda::current_device();
    if (uncached()) {
      void* p = uncached_alloc(n);
      return {p, p, &uncached_delete_fn, c10::Device(c10::DeviceType::CUDA, dev)};
    }
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();
    void* p = n == 0 ? nullptr : malloc_on(n, dev, stream);
    return {p, p, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, dev)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return uncached() ? &uncached_delete_fn : &raw_delete_fn;
  }

  // PyTorch's bypass of the cache: PYTORCH_NO_CUDA_MEMORY_CACHING, or
  // torch._C._cuda_cudaCachingAllocator_enable(False) (caching_allocator_enable).
  bool uncached() const { return force_uncached() || !enabled_.load(std::memory_order_relaxed); }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // ---- c10::DeviceAllocator ----------------------------------------------------------------

  bool initialized() override { return initialized_.load(); }

  void emptyCache(MempoolId_t /*mempool_id*/) override {
    // The native library empties every pool whose uses were all given back, whichever id is
    // named (PyTorch's own empties only the named pool): a superset, documented.
    for (int d = 0; d < devices(); ++d) {
      if (api_.empty_cache(d) != 0) fail("torch.cuda.empty_cache()");
    }
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device(device);
    CDeviceStats c{};
    int rc = api_.device_stats(device, &c);
    TORCH_CHECK(rc >= 0, cat("cuda_caching_allocator: memory_stats: bad device ", num(device)));
    DeviceStats s;
    fill(s.allocation, c.allocation);
    fill(s.segment, c.segment);
    fill(s.active, c.active);
    fill(s.inactive_split, c.inactive_split);
    fill(s.allocated_bytes, c.allocated_bytes);
    fill(s.reserved_bytes, c.reserved_bytes);
    fill(s.active_bytes, c.active_bytes);
    fill(s.inactive_split_bytes, c.inactive_split_bytes);
    fill(s.requested_bytes, c.requested_bytes);
    fill(s.oversize_allocations, c.oversize_allocations);
    fill(s.oversize_segments, c.oversize_segments);
    s.num_alloc_retries = c.num_alloc_retries;
    s.num_ooms = c.num_ooms;
    s.num_sync_all_streams = c.num_sync_all_streams;
    s.num_device_alloc = c.num_device_alloc;
    s.num_device_free = c.num_device_free;
    s.max_split_size = c.max_split_size;
    return s;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device(device);
    api_.reset_accumulated_stats(device);
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_device(device);
    api_.reset_peak_stats(device);
  }

  // ---- CUDAAllocator -----------------------------------------------------------------------

  void* raw_alloc(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    if (uncached()) return uncached_alloc(nbytes);
    c10::DeviceIndex dev = c10::cuda::current_device();
    return malloc_on(nbytes, dev, c10::cuda::getCurrentCUDAStream(dev).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    if (uncached()) return uncached_alloc(nbytes);
    return malloc_on(nbytes, c10::cuda::current_device(), stream);
  }

  // torch.cuda.caching_allocator_delete: an unknown pointer raises, as PyTorch's "invalid device
  // pointer" (a tensor's deleter, which must not throw, only warns: free_ptr's default). While
  // the cache is bypassed a pointer the cache did not hand out goes to cudaFree, as PyTorch's
  // (a cached one made before the bypass still goes back to the cache).
  void raw_delete(void* ptr) override {
    if (ptr != nullptr && uncached()) {
      bool cached = false;
      {
        std::lock_guard<std::mutex> g(mu_);
        cached = live_.count(ptr) != 0;
      }
      if (!cached) {
        gpu_trace_free(ptr);
        C10_CUDA_CHECK(cudaFree(ptr));
        return;
      }
    }
    free_ptr(ptr, /*strict=*/true);
  }

  void init(int device_count) override {
    device_count_.store(device_count);
    TORCH_CHECK(api_.check_config() == 0, cat("cuda_caching_allocator: ", api_.last_error()));
    initialized_.store(true);
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    check_device(device);
    return api_.memory_fraction(device);
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check_device(device);
    if (api_.set_memory_fraction(device, fraction) != 0)
      fail("torch.cuda.set_per_process_memory_fraction");
  }

  std::vector<StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};
  }

  void enable(bool value) override { enabled_.store(value); }
  bool isEnabled() const override { return enabled_.load(); }

  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    check_device(device);
    // As PyTorch's: a caller passing 0 asks for a first guess, the device's free memory; the
    // answer is the larger of that and the largest free cached block. cuDNN drops every
    // algorithm whose workspace exceeds it, so the largest cached block alone (a few MiB where
    // the device has gigabytes free) would silently narrow cudnn.benchmark's choice.
    if (*largestBlock == 0) {
      c10::cuda::CUDAGuard g(device);
      size_t total = 0;
      C10_CUDA_CHECK(cudaMemGetInfo(largestBlock, &total));
    }
    *largestBlock = std::max(*largestBlock, static_cast<size_t>(api_.cache_info(device)));
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    c10::DeviceIndex dev;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = live_.find(ptr);
      TORCH_CHECK(it != live_.end(), cat("cuda_caching_allocator: getBaseAllocation: ", addr(ptr),
                                         " is not a live allocation of this allocator"));
      dev = it->second.device;
    }
    uint64_t seg_size = 0;
    uint64_t base = api_.base_allocation(dev, reinterpret_cast<uint64_t>(ptr), &seg_size);
    TORCH_CHECK(base != 0,
                cat("cuda_caching_allocator: getBaseAllocation: no segment holds ", addr(ptr)));
    if (size) *size = static_cast<size_t>(seg_size);
    return reinterpret_cast<void*>(base);
  }

  void recordStream(const c10::DataPtr& ptr, CUDAStream stream) override {
    if (!ptr.get() || ptr.get_deleter() != &raw_delete_fn) return;
    // The DataPtr carries the allocation's device (allocate() builds it so).
    if (stream.device_index() != ptr.device().index()) {
      record_foreign_use(ptr.get(), stream);
      return;
    }
    api_.record_stream(ptr.get(), stream.stream());
    if (api_.last_error_kind() != 0) fail("Tensor.record_stream");
    std::lock_guard<std::mutex> g(mu_);
    auto it = live_.find(ptr.get());
    // The library ignores the allocation's own stream: only another stream may leave the
    // block waiting.
    if (it != live_.end() && stream.stream() != it->second.stream) it->second.recorded = true;
  }

  SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    SnapshotInfo info;
    struct Builder {
      Shim* self;
      c10::DeviceIndex device;
      std::vector<SegmentInfo>* out;
      bool failed = false;  // out of memory building the lists (nothing may unwind into Rust)
    };
    const int n_devices = devices();
    // Per device: the active bytes of the segments listed (PyTorch's SNAPSHOT trace entry).
    std::vector<size_t> active(static_cast<size_t>(std::max(n_devices, 0)), 0);
    std::unique_lock<std::mutex> g(mu_);
    for (int d = 0; d < n_devices; ++d) {
      std::vector<SegmentInfo> segs;
      Builder b{this, static_cast<c10::DeviceIndex>(d), &segs};
      api_.snapshot(
          d,
          [](void* ctx, const CSegment* s) {
            auto* b = static_cast<Builder*>(ctx);
            if (b->failed) return;
            try {
            SegmentInfo si;
            si.device = b->device;
            si.address = s->address;
            si.total_size = s->total_size;
            si.stream = reinterpret_cast<void*>(s->stream);
            si.is_large = s->is_large != 0;
            si.is_expandable = s->is_expandable != 0;
            // The library's own record: an empty segment of a private pool still names it
            // (ProcessGroupNCCL's register_mem_pool / deregister_mem_pool walk the pool's
            // snapshot, empty cached segments included, as PyTorch's lists them).
            si.owner_private_pool_id = MempoolId_t{s->pool.first, s->pool.second};
            b->out->push_back(std::move(si));
            } catch (...) {
              b->failed = true;
            }
          },
          [](void* ctx, const CBlock* blk) {
            auto* b = static_cast<Builder*>(ctx);
            if (b->failed || b->out->empty()) return;
            try {
            SegmentInfo& si = b->out->back();
            BlockInfo bi;
            bi.size = blk->size;
            bi.requested_size = blk->requested_size;
            bi.allocated = blk->state == 0;
            bi.active = blk->state <= 1;
            if (bi.allocated) si.allocated_size += blk->size;
            if (bi.active) {
              si.active_size += blk->size;
              si.requested_size += blk->requested_size;
            }
            auto it = b->self->live_.find(reinterpret_cast<void*>(blk->address));
            if (bi.allocated && it != b->self->live_.end()) {
              bi.context_when_allocated = it->second.context;
            }
            si.blocks.push_back(std::move(bi));
            } catch (...) {
              b->failed = true;
            }
          },
          &b);
      TORCH_CHECK(!b.failed, "cuda_caching_allocator: memory_snapshot: out of host memory");
      for (auto& s : segs) {
        if (mempool_id != MempoolId_t{0, 0} && s.owner_private_pool_id != mempool_id) continue;
        active[static_cast<size_t>(d)] += s.active_size;
        info.segments.push_back(std::move(s));
      }
    }
    g.unlock();
    std::lock_guard<std::mutex> t(trace_mu_);
    if (traces_.size() < static_cast<size_t>(n_devices)) traces_.resize(n_devices);
    // The converter gives nanoseconds; PyTorch's snapshot divides by 1000 (`time_us`).
    auto to_unix_ns = clock_converter_.makeConverter();
    info.external_annotations.assign(annotations_.begin(), annotations_.end());
    for (auto& ae : info.external_annotations) {
      ae.time_.t_ = to_unix_ns(ae.time_.approx_t_) / 1000;
    }
    if (include_traces) {
      for (auto& ring : traces_) {
        info.device_traces.emplace_back(ring.begin(), ring.end());
        for (auto& te : info.device_traces.back()) {
          te.time_.t_ = to_unix_ns(te.time_.approx_t_) / 1000;
        }
      }
    } else {
      info.device_traces.resize(traces_.size());
    }
    // As PyTorch's: each snapshot leaves a SNAPSHOT entry (the active bytes it listed) in each
    // device's history, after the entries it returned.
    for (int d = 0; d < n_devices; ++d) {
      trace_locked(TraceEntry::SNAPSHOT, static_cast<c10::DeviceIndex>(d), nullptr,
                   active[static_cast<size_t>(d)], nullptr, mempool_id, nullptr);
    }
    info.config_metadata.garbage_collection_threshold = 0.0;
    info.config_metadata.max_split_size = 0;
    info.config_metadata.pinned_num_register_threads = 0;
    info.config_metadata.expandable_segments = expandable_;
    info.config_metadata.release_lock_on_malloc = false;
    info.config_metadata.pinned_use_host_register = false;
    info.config_metadata.graph_capture_record_stream_reuse = false;
    info.config_metadata.last_allocator_settings = config_;
    return info;
  }

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    auto shared = std::make_shared<std::function<bool(cudaStream_t)>>(std::move(filter));
    {
      std::lock_guard<std::mutex> g(mu_);
      routes_.push_back(Route{device, mempool_id, shared});
      routing_.store(true);
    }
    // The native library owns one reference to the filter and drops it when the routing ends.
    auto* held = new std::shared_ptr<std::function<bool(cudaStream_t)>>(shared);
    int rc = api_.begin_with(
        device, cpool(mempool_id),
        [](void* ctx, void* stream) -> bool {
          try {
            return (**static_cast<std::shared_ptr<std::function<bool(cudaStream_t)>>*>(ctx))(
                static_cast<cudaStream_t>(stream));
          } catch (...) {
            return false;
          }
        },
        held,
        [](void* ctx) {
          delete static_cast<std::shared_ptr<std::function<bool(cudaStream_t)>>*>(ctx);
        });
    if (rc != 0) {
      drop_route(device, mempool_id);
      fail("beginAllocateToPool (CUDA graph capture or use_mem_pool)");
    }
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    drop_route(device, mempool_id);
    api_.end_pool(device, cpool(mempool_id));
    if (api_.last_error_kind() != 0) fail("endAllocateToPool");
    flush_deferred_foreign();
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    // Called from destructors (CUDAGraph, MemPool): warn, never throw.
    api_.release_pool(device, cpool(mempool_id));
    if (api_.last_error_kind() != 0)
      TORCH_WARN(cat("cuda_caching_allocator: releasePool: ", api_.last_error()));
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    return api_.pool_use_count(device, cpool(mempool_id));
  }

  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<CCA::CUDAAllocator> allocator) override {
    TORCH_CHECK(!allocator || allocator.get() == this,
                "cuda_caching_allocator: torch.cuda.MemPool(allocator=...) with another "
                "allocator is not supported while cuda-caching-allocator is PyTorch's "
                "allocator (docs/pytorch.md, 'Not supported')");
    if (api_.create_pool(device, cpool(mempool_id)) != 0) fail("torch.cuda.MemPool");
  }

  // torch.cuda.MemPool(use_on_oom=True): an allocation of the default pools whose device
  // allocation failed takes a free block of the pool before any cache is released, as PyTorch's.
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t id, bool use_on_oom) override {
    TORCH_CHECK(api_.set_use_on_oom(device, cpool(id), use_on_oom ? 1 : 0) == 0,
                cat("cuda_caching_allocator: ", api_.last_error()));
  }

  // torch.cuda.MemPool(no_split=True): the pool's blocks are handed out
  // whole, never split (Note [No-split pools] in the crate).
  void setNoSplit(c10::DeviceIndex device, MempoolId_t id) override {
    TORCH_CHECK(api_.set_no_split(device, cpool(id), 1) == 0,
                cat("cuda_caching_allocator: ", api_.last_error()));
  }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected) override {
    std::lock_guard<std::mutex> g(mu_);
    size_t n = 0;
    for (const auto& [ptr, l] : live_) {
      if (l.device != device || l.pool != mempool_id) continue;
      if (!expected.count(ptr)) return false;
      ++n;
    }
    return n == expected.size();
  }

  // PyTorch's ExpandableSegment::ShareHeader, as written into an 'e' handle: the exporting
  // process, the bytes of each physical handle and how many follow (each as a POSIX descriptor
  // number in that process). Its padding is zeroed, so equal pages give equal handle strings
  // (PyTorch's consumer caches opened handles by their bytes).
  struct ShareHeader {
    pid_t pid;
    size_t segment_size;
    size_t num_handles;
  };
  static_assert(sizeof(ShareHeader) == 24, "PyTorch's ShareHeader layout");

  // torch.multiprocessing's sharing of a CUDA tensor, in PyTorch 2.11's handle format (version
  // 2), so a process on PyTorch's own allocator opens it as well:
  // * pages of an expandable segment (the crate's default): 'e', the header above and the
  //   descriptors of the physical pages under the block (exported once per page and kept open
  //   by the library while an exported block on the page is live: PyTorch frees a shared block
  //   only once every consumer has let go, so each has taken the descriptors by then), offset
  //   from the first page;
  // * a cuMemAlloc segment ('cca_preset:pytorch'): 'c' and the cudaIpcMemHandle_t of the whole
  //   segment, offset from its base.
  // PyTorch keeps the block allocated while another process holds it (CudaIPCSentData).
  ShareableHandle shareIpcHandle(void* ptr) override {
    c10::DeviceIndex dev;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = live_.find(ptr);
      TORCH_CHECK(it != live_.end(), cat("cuda_caching_allocator: invalid device pointer ",
                                         addr(ptr), " (shareIpcHandle)"));
      dev = it->second.device;
    }
    std::vector<int> fds(64);
    uint64_t handle_bytes = 0, offset = 0;
    int pid = 0;
    ssize_t n = 0;
    for (;;) {
      n = api_.export_pages(dev, reinterpret_cast<uint64_t>(ptr), fds.data(), fds.size(),
                            &handle_bytes, &offset, &pid);
      if (n < 0 || static_cast<size_t>(n) <= fds.size()) break;
      fds.resize(static_cast<size_t>(n));
    }
    TORCH_CHECK(n >= 0, cat("cuda_caching_allocator: shareIpcHandle: ", api_.last_error()));
    if (n > 0) {
      ShareHeader header;
      std::memset(&header, 0, sizeof(header));
      header.pid = pid;
      header.segment_size = handle_bytes;
      header.num_handles = static_cast<size_t>(n);
      std::string bytes;
      bytes.push_back(static_cast<char>(2));  // PyTorch's SHAREABLE_HANDLE_VERSION
      bytes.push_back('e');                   // SHAREABLE_CUDA_EXPANDABLE_SEGMENT
      bytes.append(reinterpret_cast<const char*>(&header), sizeof(header));
      bytes.append(reinterpret_cast<const char*>(fds.data()),
                   static_cast<size_t>(n) * sizeof(int));
      return ShareableHandle{static_cast<ptrdiff_t>(offset), std::move(bytes)};
    }
    uint64_t seg_size = 0;
    uint64_t base = api_.base_allocation(dev, reinterpret_cast<uint64_t>(ptr), &seg_size);
    TORCH_CHECK(base != 0, cat("cuda_caching_allocator: shareIpcHandle: no segment holds ",
                               addr(ptr)));
    c10::cuda::CUDAGuard guard(dev);
    cudaIpcMemHandle_t handle;
    C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base)));
    std::string bytes;
    bytes.push_back(static_cast<char>(2));  // PyTorch's SHAREABLE_HANDLE_VERSION
    bytes.push_back('c');                   // SHAREABLE_CUDA_MALLOC
    bytes.append(reinterpret_cast<const char*>(&handle), CUDA_IPC_HANDLE_SIZE);
    return ShareableHandle{static_cast<ptrdiff_t>(reinterpret_cast<uint64_t>(ptr) - base),
                           std::move(bytes)};
  }

  // The other side: opens a handle (this shim's, or PyTorch's own: raw, 'c' or 'e' with POSIX
  // descriptors) on the current device, once per handle while any tensor uses it, as PyTorch's
  // cache of opened handles does; closed when the last user lets go.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    std::lock_guard<std::recursive_mutex> g(ipc_mu_);
    auto found = ipc_opened_.find(handle);
    if (found != ipc_opened_.end()) {
      if (auto p = found->second.lock()) return p;
    }
    c10::DeviceIndex dev = c10::cuda::current_device();
    auto forget = [this](const std::string& h) {
      std::lock_guard<std::recursive_mutex> g2(ipc_mu_);
      auto it = ipc_opened_.find(h);
      if (it != ipc_opened_.end() && it->second.expired()) ipc_opened_.erase(it);
    };
    std::shared_ptr<void> sp;
    if (handle.size() != CUDA_IPC_HANDLE_SIZE && handle.size() >= 2 + sizeof(ShareHeader) &&
        handle[1] == 'e') {
      // Only PyTorch 2.11's layout (version 2) is known; a later version may lay it out anew.
      TORCH_CHECK(static_cast<unsigned char>(handle[0]) == 2,
                  cat("cuda_caching_allocator: a CUDA IPC handle of an expandable segment in "
                      "format version ",
                      num(static_cast<unsigned char>(handle[0])),
                      " (this package reads PyTorch 2.11's, version 2)"));
      ShareHeader header;
      std::memcpy(&header, handle.data() + 2, sizeof(header));
      size_t rest = handle.size() - 2 - sizeof(header);
      TORCH_CHECK(header.num_handles > 0 && header.num_handles <= rest / sizeof(int) &&
                      rest == header.num_handles * sizeof(int),
                  cat("cuda_caching_allocator: opening a CUDA IPC handle of an expandable segment "
                      "with ",
                      num(header.num_handles), " pages in ", num(rest),
                      " bytes: only POSIX file descriptors are supported (not fabric handles)"));
      std::vector<int> fds(header.num_handles);
      std::memcpy(fds.data(), handle.data() + 2 + sizeof(header), rest);
      uint64_t base = 0;
      void* token = api_.import_pages(dev, header.pid, header.segment_size, fds.data(),
                                      fds.size(), &base);
      TORCH_CHECK(token != nullptr, cat("cuda_caching_allocator: ", api_.last_error()));
      // The release runs on the opening device, as PyTorch's (whose ExpandableSegment unmaps
      // under a CUDAGuard): PyTorch's IPC storage deleter then synchronizes the device's
      // current stream, which in a thread that never chose a device would otherwise make a
      // context on GPU 0 (gpu/probes/device_guard.py).
      sp = std::shared_ptr<void>(reinterpret_cast<void*>(base),
                                 [this, handle, token, forget, dev](void*) {
                                   forget(handle);
                                   DeviceScope scope(dev);
                                   api_.close_imported(token);
                                 });
    } else {
      cudaIpcMemHandle_t h;
      if (handle.size() == CUDA_IPC_HANDLE_SIZE) {
        std::memcpy(&h, handle.data(), CUDA_IPC_HANDLE_SIZE);
      } else {
        // Version 2 is PyTorch 2.11's; 3 is accepted for its identical 'c' payload.
        TORCH_CHECK(handle.size() == CUDA_IPC_HANDLE_SIZE + 2 && handle[1] == 'c' &&
                        static_cast<unsigned char>(handle[0]) <= 3,
                    cat("cuda_caching_allocator: a CUDA IPC handle of an unknown format (",
                        num(handle.size()), " bytes)"));
        std::memcpy(&h, handle.data() + 2, CUDA_IPC_HANDLE_SIZE);
      }
      void* p = nullptr;
      C10_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
      sp = std::shared_ptr<void>(p, [handle, dev, forget](void* q) {
        forget(handle);
        DeviceScope scope(dev);
        if (cudaIpcCloseMemHandle(q) != cudaSuccess) (void)cudaGetLastError();
      });
    }
    ipc_opened_[handle] = sp;
    return sp;
  }

  bool isHistoryEnabled() override {
    std::lock_guard<std::mutex> t(trace_mu_);
    return history_enabled_;
  }

  void recordHistory(bool enabled, CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
    std::lock_guard<std::mutex> g(mu_);
    recorder_ = enabled ? context_recorder : nullptr;
    record_when_ = enabled ? when : RecordContext::NEVER;
    std::lock_guard<std::mutex> t(trace_mu_);
    history_enabled_ = enabled;
    history_on_.store(enabled, std::memory_order_relaxed);
    record_all_.store(enabled && when == RecordContext::ALL, std::memory_order_relaxed);
    max_entries_ = std::max<size_t>(alloc_trace_max_entries, 1);
    skip_.clear();
    for (const auto& s : skip_actions) skip_.insert(s);
    // As PyTorch's: turning the history off also drops what was recorded.
    if (!enabled || clearHistory) {
      for (auto& ring : traces_) ring.clear();
      annotations_.clear();
    }
  }

  // torch.profiler.record_function regions while the memory history is on (PyTorch's
  // _record_memory_history registers the callback that calls this): the snapshot's
  // external_annotations, which torch.cuda._memory_viz draws beside the trace.
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    if (!history_on_.load(std::memory_order_relaxed)) return;
    c10::DeviceIndex device = c10::cuda::current_device();
    std::lock_guard<std::mutex> t(trace_mu_);
    if (!history_enabled_) return;
    AnnotationEntry ae(device, c10::getApproximateTime());
    for (const auto& [key, value] : md) ae.recordUserMetadata(key, value);
    annotations_.push_back(std::move(ae));
    while (annotations_.size() > max_entries_) annotations_.pop_front();
  }

  // As PyTorch's (NativeCachingAllocator): regions entered or left while the history is off
  // are not kept, so the stack grows only while entries may carry it.
  void pushCompileContext(std::string& md) override {
    if (!history_on_.load(std::memory_order_relaxed)) return;
    thread_trace_state().compile_context.push_back(md);
  }

  void popCompileContext() override {
    if (!history_on_.load(std::memory_order_relaxed)) return;
    if (t_trace_state != nullptr && !t_trace_state->compile_context.empty())
      t_trace_state->compile_context.pop_back();
  }

  void setUserMetadata(const std::string& metadata) override {
    thread_trace_state().user_metadata = metadata;
  }

  std::string getUserMetadata() override {
    return t_trace_state != nullptr ? t_trace_state->user_metadata : std::string();
  }

  void attachOutOfMemoryObserver(OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(mu_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(AllocatorTraceTracker tracker) override {
    std::lock_guard<std::mutex> t(trace_mu_);
    trackers_.push_back(std::move(tracker));
  }

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    {
      c10::cuda::CUDAGuard g(dev);
      cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
      } else {
        C10_CUDA_CHECK(err);
      }
    }
    // Mapped pages (the default's expandable segments) are reachable only by the devices their
    // access was set for: grant `dev` access to `dev_to_access`'s cache, now and for later pages
    // (PyTorch: device_allocator[dev_to_access]->addPeerAccess(dev)).
    if (api_.enable_peer_access(dev_to_access, dev) != 0) fail("enablePeerAccess");
  }

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    // Expandable segments are cuMemMap'ed: without peer access, only the Peer copy works.
    if (p2p_enabled || dstDevice == srcDevice)
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  // CUDA graph trees (torch.compile(mode="reduce-overhead")): the pool's block layout now, to
  // restore before recording a new graph after replaying others (PyTorch's PrivatePoolState).
  std::shared_ptr<AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                     MempoolId_t id) override {
    auto cp = std::make_shared<Checkpoint>();
    cp->device = device;
    cp->pool = id;
    struct Walk {
      Checkpoint* cp;
      bool in_pool = false, first = false;
      cudaStream_t stream = nullptr;
      bool failed = false;  // out of host memory (nothing may unwind into Rust)
    } w{cp.get()};
    std::lock_guard<std::mutex> g(mu_);
    check_no_deferred_frees("getCheckpointState", device, id);
    api_.snapshot(
        device,
        [](void* ctx, const CSegment* s) {
          auto* w = static_cast<Walk*>(ctx);
          w->in_pool = s->pool.first == w->cp->pool.first && s->pool.second == w->cp->pool.second;
          w->stream = reinterpret_cast<cudaStream_t>(s->stream);
          w->first = true;
        },
        [](void* ctx, const CBlock* b) {
          auto* w = static_cast<Walk*>(ctx);
          if (!w->in_pool || w->failed) return;
          try {
            w->cp->blocks.push_back(CCheckpointBlock{b->address, b->size,
                                                     b->state == 0 ? 1u : 0u,
                                                     w->first ? 1u : 0u});
            w->cp->streams[b->address] = w->stream;
          } catch (...) {
            w->failed = true;
          }
          w->first = false;
        },
        &w);
    TORCH_CHECK(!w.failed, "cuda_caching_allocator: getCheckpointState: out of host memory");
    return cp;
  }

  // PyTorch's setCheckpointPoolState: every live allocation of the pool is freed (reported in
  // ptrs_freed; their tensors are dropped without freeing again), the checkpoint's layout is cut
  // again and its allocations come back at their addresses (dataptrs_allocd, with this
  // allocator's deleter, for the live tensors whose memory they are).
  CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                         std::shared_ptr<AllocatorState> pps) override {
    auto* cp = dynamic_cast<Checkpoint*>(pps.get());
    TORCH_CHECK(cp != nullptr, "cuda_caching_allocator: setCheckpointPoolState: not a "
                               "checkpoint of this allocator");
    TORCH_CHECK(cp->device == device,
                cat("cuda_caching_allocator: setCheckpointPoolState: a checkpoint of device ",
                    num(cp->device), " given for device ", num(device)));
    struct Changes {
      std::vector<void*> freed, created;
      bool lost = false;  // out of host memory listing a change (nothing may unwind into Rust)
    } ch;
    std::lock_guard<std::mutex> g(mu_);
    check_no_deferred_frees("setCheckpointPoolState", device, cp->pool);
    int rc = api_.restore_pool(
        device, cpool(cp->pool), cp->blocks.data(), cp->blocks.size(),
        [](void* ctx, uint64_t p, int created) {
          auto* c = static_cast<Changes*>(ctx);
          try {
            (created ? c->created : c->freed).push_back(reinterpret_cast<void*>(p));
          } catch (...) {
            c->lost = true;
          }
        },
        &ch);
    TORCH_CHECK(rc == 0, cat("cuda_caching_allocator: ", api_.last_error()));
    TORCH_CHECK(!ch.lost, "cuda_caching_allocator: setCheckpointPoolState: out of host memory "
                          "while listing the pool's changes; the pool was restored but this "
                          "allocator's record of its live allocations is incomplete");
    // The memory history and trace trackers see the restore's frees and allocations, as
    // PyTorch's (which makes them through its own free and alloc paths).
    CheckpointDelta cpd;
    for (void* p : ch.freed) {
      auto it = live_.find(p);
      if (it != live_.end()) {
        const Live& l = it->second;
        {
          std::lock_guard<std::mutex> t(trace_mu_);
          trace_locked(TraceEntry::FREE_REQUESTED, l.device, p, l.size, l.stream, l.pool, nullptr);
          trace_locked(TraceEntry::FREE_COMPLETED, l.device, p, l.size, l.stream, l.pool, nullptr);
        }
        live_.erase(it);
      }
      cpd.ptrs_freed.push_back(p);
    }
    std::unordered_map<uint64_t, uint64_t> sizes;
    for (const auto& b : cp->blocks) sizes[b.address] = b.size;
    for (void* p : ch.created) {
      auto a = reinterpret_cast<uint64_t>(p);
      auto size = static_cast<size_t>(sizes[a]);
      trace(TraceEntry::ALLOC, device, p, size, cp->streams[a], cp->pool, nullptr);
      live_[p] = Live{size, device, cp->streams[a], cp->pool, nullptr};
      cpd.dataptrs_allocd.emplace_back(p, p, &raw_delete_fn,
                                       c10::Device(c10::DeviceType::CUDA, device));
    }
    return cpd;
  }

  std::string name() override { return "cuda_caching_allocator"; }

  // ---- the deleter ----------------------------------------------------------------------------

  // A use on a stream of another device (a peer copy or kernel on device 1 reading a tensor
  // of device 0). The library's record_stream takes a stream handle of the tensor's own device,
  // and the default streams' handles (0, 1, 2) name a stream on every device, so passing the
  // handle on would record the use on the wrong device's stream and let the block be reused
  // under the other device's work. As PyTorch does, the stream is noted here, and the free
  // orders the block's reuse after the work queued on it at that time (free_ptr).
  void record_foreign_use(void* p, CUDAStream stream) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = live_.find(p);
    if (it == live_.end()) return;  // not ours: nothing to keep safe
    auto use = std::make_pair(stream.device_index(), stream.stream());
    auto& uses = it->second.foreign_uses;
    if (std::find(uses.begin(), uses.end(), use) == uses.end()) uses.push_back(use);
  }

  // Orders the block's reuse after the work queued on each stream of another device that `l`
  // was recorded on, without waiting on the host (PyTorch records an event on each such stream at
  // the free and reuses the block once they complete): an event recorded on the foreign stream
  // is waited for by a stream of the block's own device that serves only the waits for that
  // foreign stream (foreign_waiter), and that stream is recorded on the block in the library,
  // whose free then holds the block until an event on it completes. One waiter per foreign
  // stream keeps a block freed behind short work from queueing behind another's long work.
  // Unlike PyTorch, a synchronization of the block's whole device (torch.cuda.synchronize(d),
  // emptyCache) then also waits for the foreign work queued before the free. Returns false when
  // a use could not be ordered so (a capturing foreign stream, an event error): the caller then
  // waits on the host (wait_foreign_uses); uses recorded before that only hold the block longer.
  bool order_after_foreign_uses(void* ptr, const Live& l) {
    for (const auto& [device, stream] : l.foreign_uses) {
      cudaStream_t waiter = foreign_waiter(l.device, device, stream);
      if (waiter == nullptr) return false;
      cudaEvent_t ev = nullptr;
      {
        DeviceScope scope(device);
        RelaxedCapture relaxed;
        bool capturing = false;
        if (capture_status(stream, &capturing) != cudaSuccess || capturing ||
            cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
          (void)cudaGetLastError();
          return false;
        }
        if (cudaEventRecord(ev, stream) != cudaSuccess) {
          (void)cudaEventDestroy(ev);
          (void)cudaGetLastError();
          return false;
        }
      }
      {
        DeviceScope scope(l.device);
        // A destroyed event that a stream waits for is released once it completes (CUDA's
        // cudaEventDestroy), so the wait holds.
        cudaError_t e = cudaStreamWaitEvent(waiter, ev, 0);
        cudaError_t d = cudaEventDestroy(ev);
        if (e != cudaSuccess || d != cudaSuccess) {
          (void)cudaGetLastError();
          if (e != cudaSuccess) return false;
        }
      }
      // The returned status, not the thread's last error: that record is gone while the thread
      // exits, and a failure must not read as success here.
      if (api_.record_stream_checked(ptr, waiter) != 0) return false;
    }
    return true;
  }

  // The stream of `device` that waits for the work of `foreign` (a stream of device
  // `foreign_device`) on behalf of freed blocks (order_after_foreign_uses); made at first need
  // and kept for the process's life. Past kMaxWaiters foreign streams (a program making streams
  // without end), one stream of `device` serves the rest. nullptr when it cannot be made.
  cudaStream_t foreign_waiter(c10::DeviceIndex device, c10::DeviceIndex foreign_device,
                              cudaStream_t foreign) {
    constexpr size_t kMaxWaiters = 64;
    if (device < 0) return nullptr;
    std::lock_guard<std::mutex> g(waiters_mu_);
    auto key = std::make_tuple(device, foreign_device, foreign);
    auto it = foreign_waiters_.find(key);
    if (it == foreign_waiters_.end() && foreign_waiters_.size() >= kMaxWaiters) {
      key = std::make_tuple(device, static_cast<c10::DeviceIndex>(-1), cudaStream_t{nullptr});
      it = foreign_waiters_.find(key);
    }
    if (it != foreign_waiters_.end()) return it->second;
    cudaStream_t s = nullptr;
    DeviceScope scope(device);
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    foreign_waiters_.emplace(key, s);
    return s;
  }

  // Whether `stream` (a stream of the current device; the legacy default stream for nullptr,
  // which never captures) is capturing a graph, in `capturing`; the query's error, cleared from
  // the runtime, when it fails.
  static cudaError_t capture_status(cudaStream_t stream, bool* capturing) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaError_t e = stream != nullptr ? cudaStreamIsCapturing(stream, &status) : cudaSuccess;
    if (e != cudaSuccess) (void)cudaGetLastError();
    *capturing = status != cudaStreamCaptureStatusNone;
    return e;
  }

  // Waits until the work queued on each stream `l` was recorded on (another device's) is done,
  // where order_after_foreign_uses could not order the reuse by events, so that the block never
  // reaches the library's cache under the other device's work. Returns false when a wait could
  // not be made (the caller then keeps the block out of use for good); `exiting` is set when the
  // CUDA runtime is shutting down.
  static bool wait_foreign_uses(const Live& l, bool* exiting) {
    for (const auto& [device, stream] : l.foreign_uses) {
      DeviceScope scope(device);
      RelaxedCapture relaxed;
      bool capturing = false;
      cudaError_t q = capture_status(stream, &capturing);
      if (q != cudaSuccess) {
        // At exit the query fails as the runtime unloads: quietly, as the wait would.
        *exiting = q == cudaErrorCudartUnloading;
        return false;
      }
      cudaError_t e = capturing ? cudaErrorStreamCaptureUnsupported : cudaStreamSynchronize(stream);
      if (e != cudaSuccess) {
        *exiting = e == cudaErrorCudartUnloading;
        (void)cudaGetLastError();
        return false;
      }
    }
    return true;
  }

  void free_ptr(void* ptr, bool strict = false) {
    if (!ptr) return;
    TimedScope timed(g_timing.free_ns, g_timing.free_calls);
    Live l;
    // Under context "all", PyTorch's free entries carry the free's own stack (gathered outside
    // the lock: gathering may take the GIL); under "alloc", the allocation's.
    std::shared_ptr<c10::GatheredContext> free_ctx;
    if (record_all_.load(std::memory_order_relaxed)) {
      CreateContextFn recorder = nullptr;
      {
        std::lock_guard<std::mutex> g(mu_);
        if (record_when_ == RecordContext::ALL) recorder = recorder_;
      }
      if (recorder) free_ctx = recorder();
    }
    bool awaits = false, deferred = false, ordered = false;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = live_.find(ptr);
      if (it == live_.end()) {
        TORCH_CHECK(!strict, cat("cuda_caching_allocator: invalid device pointer ", addr(ptr),
                                 ": not a live allocation of this allocator"));
        TORCH_WARN(cat("cuda_caching_allocator: free of ", addr(ptr),
                       ", which is not a live allocation of this allocator (ignored)"));
        return;
      }
      l = std::move(it->second);
      live_.erase(it);
      const bool keep = record_when_ == RecordContext::ALLOC || record_when_ == RecordContext::ALL;
      std::shared_ptr<c10::GatheredContext> ctx;
      if (keep) ctx = free_ctx ? free_ctx : l.context;
      // As PyTorch's: FREE_COMPLETED goes with FREE_REQUESTED, side by side, unless the block
      // may wait for recorded streams' work; then it comes when the block is back (the
      // library's segment callback, action 4, or release() when it did not wait after all).
      awaits = l.recorded || !l.foreign_uses.empty();
      {
        std::lock_guard<std::mutex> t(trace_mu_);
        trace_locked(TraceEntry::FREE_REQUESTED, l.device, ptr, l.size, l.stream, l.pool, ctx);
        if (awaits && (history_enabled_ || !trackers_.empty())) {
          // Keyed by a generation too: once the library has the block back, another thread may
          // allocate and free the same address before this free's entry is written (release(),
          // rc 0), and each free must find its own entry.
          try {
            const uint64_t gen = ++next_free_gen_;
            pending_frees_.emplace(std::make_tuple(l.device, ptr, gen),
                                   PendingFree{l.size, l.stream, l.pool, keep ? l.context : nullptr});
            l.pending_gen = gen;
          } catch (const std::bad_alloc&) {
            // Out of host memory (the allocation has left live_: a throw here would lose the
            // block): the entry comes now rather than not at all.
            trace_locked(TraceEntry::FREE_COMPLETED, l.device, ptr, l.size, l.stream, l.pool,
                         std::move(ctx));
          }
        } else if (!awaits) {
          trace_locked(TraceEntry::FREE_COMPLETED, l.device, ptr, l.size, l.stream, l.pool,
                       std::move(ctx));
        }
      }
      if (!l.foreign_uses.empty()) {
        // Still under mu_, which beginAllocateToPool takes and which PyTorch calls before it
        // begins a capture (CUDAGraph::capture_begin): no capture through PyTorch begins on
        // the foreign stream between the capture check and the event record. While a routing
        // is underway on the foreign device, the free waits for it to end, as PyTorch's
        // deferred blocks wait for their device's captures (flush_deferred_foreign).
        if (foreign_device_routed(l)) {
          // Out of host memory for the list (the allocation has left live_: a throw here would
          // lose the block), the free does not wait for the routing: release() then waits on
          // the host, and keeps the block out of use if a stream it waits for is capturing.
          try {
            deferred_foreign_.reserve(deferred_foreign_.size() + 1);
            deferred = true;
          } catch (const std::bad_alloc&) {
          }
          if (deferred) deferred_foreign_.emplace_back(ptr, std::move(l));
        } else {
          ordered = order_after_foreign_uses(ptr, l);
        }
      }
    }
    gpu_trace_free(ptr);
    if (!deferred) release(ptr, l, awaits, ordered);
  }

  // Hands a freed allocation back to the library. `ordered`: its uses on other devices' streams
  // were ordered by events (order_after_foreign_uses); otherwise they are waited for here.
  void release(void* ptr, const Live& l, bool awaits, bool ordered) {
    if (!l.foreign_uses.empty() && !ordered) {
      bool exiting = false;
      if (!wait_foreign_uses(l, &exiting)) {
        // The other device's work may still use the block: never hand it out again (at exit,
        // when the runtime is unloading, quietly).
        if (!exiting) {
          TORCH_WARN("cuda_caching_allocator: free: waiting for the work of a stream of another "
                     "device that Tensor.record_stream named failed (or that stream is "
                     "capturing a graph); the block is kept out of use for good");
        }
        if (l.pending_gen != 0) {
          std::lock_guard<std::mutex> t(trace_mu_);
          pending_frees_.erase(std::make_tuple(l.device, ptr, l.pending_gen));
        }
        return;
      }
    }
    if (!awaits) {
      api_.free(ptr, static_cast<ssize_t>(l.size), l.device, l.stream);
      if (api_.last_error_kind() != 0)
        TORCH_WARN(cat("cuda_caching_allocator: free: ", api_.last_error()));
      return;
    }
    // 1: the block waits (the library calls back when it is back); 0: back now; -1: an error,
    // after which a block left waiting still calls back.
    int rc = api_.free_checked(ptr, static_cast<ssize_t>(l.size), l.device, l.stream);
    if (rc < 0) TORCH_WARN(cat("cuda_caching_allocator: free: ", api_.last_error()));
    if (rc == 0 && l.pending_gen != 0) {
      complete_pending_free(l.device, ptr, l.pending_gen, /*contain=*/false);
    }
  }

  // FREE_COMPLETED for a free whose block waited (free_ptr registered it in pending_frees_):
  // the entry of generation `gen`, or for the library's callback (gen 0), the newest entry of
  // the address, the only one whose block can be waiting (an older one belongs to a free whose
  // block came back at once, release() about to write it). As PyTorch's free_block, it carries
  // the context of the allocation during which the library found the block back (under context
  // "alloc" or "all"), else the freed allocation's.
  void complete_pending_free(c10::DeviceIndex device, void* ptr, uint64_t gen, bool contain) {
    std::lock_guard<std::mutex> t(trace_mu_);
    auto it = pending_frees_.end();
    if (gen != 0) {
      it = pending_frees_.find(std::make_tuple(device, ptr, gen));
    } else {
      auto after = pending_frees_.upper_bound(
          std::make_tuple(device, ptr, std::numeric_limits<uint64_t>::max()));
      if (after != pending_frees_.begin()) {
        auto newest = std::prev(after);
        if (std::get<0>(newest->first) == device && std::get<1>(newest->first) == ptr) {
          it = newest;
        }
      }
    }
    if (it == pending_frees_.end()) return;
    PendingFree f = std::move(it->second);
    pending_frees_.erase(it);
    auto ctx = t_alloc_context != nullptr && *t_alloc_context ? *t_alloc_context : f.context;
    trace_locked(TraceEntry::FREE_COMPLETED, device, ptr, f.size, f.stream, f.pool,
                 std::move(ctx), contain);
  }

  // Refuses a checkpoint of `pool` on `device` while a free of that pool waits in
  // deferred_foreign_: the library still counts its block as allocated, so the checkpoint would
  // bring back an allocation no tensor holds. mu_ held.
  void check_no_deferred_frees(const char* what, c10::DeviceIndex device, MempoolId_t pool) {
    for (const auto& [ptr, l] : deferred_foreign_) {
      if (l.device != device || l.pool != pool || l.foreign_uses.empty()) continue;
      TORCH_CHECK(false, cat("cuda_caching_allocator: ", what, ": the freed tensor at ", addr(ptr),
                             " of this pool was used on a stream of device ",
                             num(l.foreign_uses.front().first),
                             " (Tensor.record_stream), where a graph capture or use_mem_pool is "
                             "underway; its block goes back to the pool when that ends"));
    }
  }

  // Whether a routing (a capture or a use_mem_pool) is underway on a device of `l`'s foreign
  // uses. mu_ held.
  bool foreign_device_routed(const Live& l) const {
    for (const auto& r : routes_) {
      for (const auto& use : l.foreign_uses) {
        if (use.first == r.device) return true;
      }
    }
    return false;
  }

  // The frees deferred by free_ptr whose foreign devices have no routing underway any more go
  // back to the library, their uses ordered by events under mu_ as free_ptr orders them.
  void flush_deferred_foreign() {
    std::vector<std::pair<void*, Live>> ready;
    std::vector<bool> ordered;
    {
      std::lock_guard<std::mutex> g(mu_);
      for (auto it = deferred_foreign_.begin(); it != deferred_foreign_.end();) {
        if (foreign_device_routed(it->second)) {
          ++it;
          continue;
        }
        ordered.push_back(order_after_foreign_uses(it->first, it->second));
        ready.push_back(std::move(*it));
        it = deferred_foreign_.erase(it);
      }
    }
    for (size_t i = 0; i < ready.size(); ++i) {
      release(ready[i].first, ready[i].second, /*awaits=*/true, ordered[i]);
    }
  }

 private:
  // PyTorch's assertValidDevice: a device index outside [0, device count) raises, as PyTorch's
  // per-device entry points do, where the library answers for a device whose cache was never
  // made (zeros, fraction 1.0) and torch.cuda.memory_stats(5) on a one-GPU machine would read as
  // an empty device instead of an error.
  void check_device(c10::DeviceIndex device) {
    TORCH_CHECK(device >= 0 && device < devices(),
                cat("Invalid device argument ", num(device), ": did you call init?"));
  }

  // The number of devices: init()'s, or CUDA's when PyTorch has not called init() yet.
  int devices() {
    int n = device_count_.load();
    if (n <= 0) {
      n = static_cast<int>(c10::cuda::device_count());
      device_count_.store(n);
    }
    return n;
  }

  [[noreturn]] void fail(const char* what) {
    std::string msg = api_.last_error();
    TORCH_CHECK(false, cat("cuda_caching_allocator: ", what, ": ",
                           msg.empty() ? std::string("failed") : msg));
  }

  // The library's segment events (cca_set_segment_callback), called with the device cache's lock
  // held, so that a tracker sees a segment before any thread can use it and its SEGMENT_FREE
  // before the memory goes back to the driver (NCCL's registration hooks deregister there, as
  // PyTorch records SEGMENT_FREE before cudaFree). Takes only trace_mu_: snapshot() holds mu_
  // while it calls into the library. Nothing may leave it by exception (it returns into Rust).
  static void on_segment(void* self, int action, int device, uint64_t address, uint64_t size,
                         void* stream, CPool pool) noexcept {
    static const TraceEntry::Action kActions[] = {
        TraceEntry::SEGMENT_ALLOC, TraceEntry::SEGMENT_FREE, TraceEntry::SEGMENT_MAP,
        TraceEntry::SEGMENT_UNMAP};
    if (action == 4) {
      // A free that waited for recorded streams is complete: its FREE_COMPLETED entry.
      try {
        static_cast<Shim*>(self)->complete_pending_free(static_cast<c10::DeviceIndex>(device),
                                                        reinterpret_cast<void*>(address),
                                                        /*gen=*/0, /*contain=*/true);
      } catch (...) {
        std::fprintf(stderr, "cuda_caching_allocator: a free_completed trace entry was lost\n");
      }
      return;
    }
    if (action < 0 || action > 3) return;
    try {
      std::shared_ptr<c10::GatheredContext> ctx;
      const bool grows = action == 0 || action == 2;
      if (grows) t_grew = true;
      if (grows && t_alloc_context != nullptr) ctx = *t_alloc_context;
      static_cast<Shim*>(self)->trace(kActions[action], static_cast<c10::DeviceIndex>(device),
                                      reinterpret_cast<void*>(address), size,
                                      static_cast<cudaStream_t>(stream),
                                      MempoolId_t{pool.first, pool.second}, std::move(ctx),
                                      /*contain=*/true);
    } catch (...) {
      // Out of memory building the entry: the event is lost, the cache goes on.
      std::fprintf(stderr, "cuda_caching_allocator: a %s trace entry was lost\n",
                   action_name(kActions[action]));
    }
  }

  // PyTorch's FreeCudaMemoryCallbacksRegistry: true when a callback freed something. PyTorch's
  // allocator runs them on every cache miss, before it allocates more; the shim runs them after
  // an allocation that made or mapped device memory (the library's misses that reach the
  // driver; the blocks given back serve the next ones) and when the library is out of memory.
  // Called with no lock held: the callbacks free through free_ptr.
  static bool run_free_memory_callbacks() {
    bool freed = false;
    for (const auto& name : c10::FreeCudaMemoryCallbacksRegistry()->Keys()) {
      freed |= c10::FreeCudaMemoryCallbacksRegistry()->Create(name)->Execute();
    }
    return freed;
  }

  void drop_route(c10::DeviceIndex device, MempoolId_t pool) {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = routes_.rbegin(); it != routes_.rend(); ++it) {
      if (it->device == device && it->pool == pool) {
        routes_.erase(std::next(it).base());
        break;
      }
    }
    routing_.store(!routes_.empty());
  }

  // The pool an allocation on `stream` goes to: the newest routing whose filter admits it, as
  // the native library decides.
  MempoolId_t pool_for(c10::DeviceIndex device, cudaStream_t stream) {
    std::vector<Route> routes;
    {
      std::lock_guard<std::mutex> g(mu_);
      routes = routes_;
    }
    for (auto it = routes.rbegin(); it != routes.rend(); ++it) {
      if (it->device == device && (*it->filter)(stream)) return it->pool;
    }
    return {0, 0};
  }

  // PyTorch's name of a trace action (the names _record_memory_history's skip_actions use).
  static const char* action_name(TraceEntry::Action a) {
    switch (a) {
      case TraceEntry::ALLOC: return "alloc";
      case TraceEntry::FREE_REQUESTED: return "free_requested";
      case TraceEntry::FREE_COMPLETED: return "free_completed";
      case TraceEntry::SEGMENT_ALLOC: return "segment_alloc";
      case TraceEntry::SEGMENT_FREE: return "segment_free";
      case TraceEntry::SEGMENT_MAP: return "segment_map";
      case TraceEntry::SEGMENT_UNMAP: return "segment_unmap";
      case TraceEntry::SNAPSHOT: return "snapshot";
      case TraceEntry::OOM: return "oom";
    }
    return "";
  }

  // Hands a trace entry to the trackers and appends it to the device's history ring. Takes
  // trace_mu_ (callers may hold mu_; nothing holding trace_mu_ calls into the library). As
  // PyTorch's record_trace, every tracker sees every entry and skip_actions thin only the
  // history. `contain` (the segment callback, which returns into Rust): a tracker that throws is
  // reported on stderr and the others still run.
  void trace(TraceEntry::Action action, c10::DeviceIndex device, void* addr, size_t size,
             cudaStream_t stream, MempoolId_t pool, std::shared_ptr<c10::GatheredContext> ctx,
             bool contain = false) {
    std::lock_guard<std::mutex> t(trace_mu_);
    trace_locked(action, device, addr, size, stream, pool, std::move(ctx), contain);
  }

  // trace() with trace_mu_ held by the caller (entries that must sit side by side, as a free's
  // FREE_REQUESTED and FREE_COMPLETED, which PyTorch's memory viewer merges when adjacent).
  void trace_locked(TraceEntry::Action action, c10::DeviceIndex device, void* addr, size_t size,
                    cudaStream_t stream, MempoolId_t pool,
                    std::shared_ptr<c10::GatheredContext> ctx, bool contain = false) {
    if (!history_enabled_ && trackers_.empty()) return;
    TraceEntry te(action, device, reinterpret_cast<size_t>(addr), size, stream, pool,
                  c10::getApproximateTime(), std::move(ctx),
                  t_trace_state == nullptr || t_trace_state->compile_context.empty()
                      ? std::string("N/A")
                      : t_trace_state->compile_context.back(),
                  t_trace_state != nullptr ? t_trace_state->user_metadata : std::string());
    for (auto& tracker : trackers_) {
      if (!contain) {
        tracker(te);
        continue;
      }
      // Not TORCH_WARN: a Python warning handler would take the GIL under the cache's lock.
      try {
        tracker(te);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "cuda_caching_allocator: a trace tracker failed on a %s entry: %s\n",
                     action_name(action), e.what());
      } catch (...) {
        std::fprintf(stderr, "cuda_caching_allocator: a trace tracker failed on a %s entry\n",
                     action_name(action));
      }
    }
    if (!history_enabled_ || device < 0) return;
    if (!skip_.empty() && skip_.count(action_name(action))) return;
    if (static_cast<size_t>(device) >= traces_.size()) traces_.resize(device + 1);
    auto& ring = traces_[device];
    ring.push_back(std::move(te));
    while (ring.size() > max_entries_) ring.pop_front();
  }

  void* malloc_on(size_t n, c10::DeviceIndex dev, cudaStream_t stream) {
    TimedScope timed(g_timing.alloc_ns, g_timing.alloc_calls);
    MempoolId_t pool = routing_.load() ? pool_for(dev, stream) : MempoolId_t{0, 0};
    std::shared_ptr<c10::GatheredContext> ctx;
    CreateContextFn recorder = nullptr;
    RecordContext when = RecordContext::NEVER;
    {
      std::lock_guard<std::mutex> g(mu_);
      recorder = recorder_;
      when = record_when_;
    }
    if (recorder && when != RecordContext::NEVER) ctx = recorder();
    void* p = nullptr;
    std::string msg;
    bool oom = false;
    // PyTorch's sizes of a failed request: its OOM trace entry has the rounded size
    // (params.size()), its observers the device allocation it tried (alloc_size).
    size_t oom_rounded = n, oom_segment = n;
    for (int attempt = 0; attempt < 2; ++attempt) {
      {
        // Segment entries keep the stack only where PyTorch's do (context "alloc" or "all").
        AllocContextScope scope(when == RecordContext::ALLOC || when == RecordContext::ALL
                                    ? &ctx
                                    : nullptr);
        t_grew = false;
        p = api_.alloc(static_cast<ssize_t>(n), dev, stream);
      }
      if (p != nullptr) {
        // torch.multiprocessing's cuda_ipc_collect gives back the blocks of shared tensors
        // whose other processes have let go of them (PyTorch's CudaIPCSentDataLimbo).
        if (t_grew) {
          t_grew = false;
          try {
            run_free_memory_callbacks();
          } catch (const std::exception& e) {
            // The allocation stands; a callback's failure must not leak it.
            TORCH_WARN(cat("cuda_caching_allocator: a free-memory callback failed: ", e.what()));
          } catch (...) {
            TORCH_WARN("cuda_caching_allocator: a free-memory callback failed");
          }
        }
        break;
      }
      // Read before the callbacks: their frees clear the library's last error.
      msg = api_.last_error();
      oom = api_.last_error_kind() == 1;
      if (oom && api_.last_oom_sizes(&oom_rounded, &oom_segment) != 0) {
        oom_rounded = oom_segment = n;  // a request of 1 EiB or more: no report
      }
      // Out of memory: PyTorch's free-memory callbacks (torch.multiprocessing's cuda_ipc_collect
      // gives back shared blocks other processes have let go of) may free some; then once more.
      if (attempt == 1 || !oom || !run_free_memory_callbacks()) break;
    }
    if (p == nullptr) {
      std::vector<OutOfMemoryObserver> observers;
      size_t device_free = 0, device_total = 0;
      if (oom) {
        c10::cuda::CUDAGuard g(dev);
        if (cudaMemGetInfo(&device_free, &device_total) != cudaSuccess) (void)cudaGetLastError();
      }
      {
        std::lock_guard<std::mutex> g(mu_);
        if (oom) {
          // As PyTorch's: the OOM entry's address field carries the device's free bytes
          // (memory_snapshot's "device_free").
          // The stack only where PyTorch's trace keeps one (context "alloc" or "all").
          trace(TraceEntry::OOM, dev, reinterpret_cast<void*>(device_free), oom_rounded, stream,
                pool,
                when == RecordContext::ALLOC || when == RecordContext::ALL ? ctx : nullptr);
          observers = oom_observers_;
        }
      }
      if (oom) {
        // As PyTorch's: with a memory fraction set, observers get the cap as the total.
        const double fraction = api_.memory_fraction(dev);
        size_t total_seen = device_total;
        if (fraction < 1.0) {
          total_seen = static_cast<size_t>(fraction * static_cast<double>(device_total));
        }
        for (auto& o : observers) o(dev, oom_segment, total_seen, device_free);
        TORCH_CHECK_WITH(OutOfMemoryError, false, cat("cuda_caching_allocator: ", msg));
      }
      TORCH_CHECK(false, cat("cuda_caching_allocator: allocation of ", num(n),
                             " bytes on device ", num(dev), " failed: ", msg));
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      trace(TraceEntry::ALLOC, dev, p, n, stream, pool,
            when == RecordContext::ALLOC || when == RecordContext::ALL ? ctx : nullptr);
      live_[p] = Live{n, dev, stream, pool, std::move(ctx)};
    }
    // Outside the lock: the GPU trace's callbacks take the GIL.
    gpu_trace_alloc(p);
    return p;
  }

  Api api_;
  std::string config_;
  bool expandable_;
  std::atomic<int> device_count_{0};
  std::atomic<bool> initialized_{false};
  std::atomic<bool> enabled_{true};
  std::atomic<bool> routing_{false};
  // Copies of history_enabled_ and (record_when_ == ALL) read without a lock on hot paths.
  std::atomic<bool> history_on_{false};
  std::atomic<bool> record_all_{false};
  std::mutex mu_;
  // Guards foreign_waiters_; taken after mu_ where both are held (order_after_foreign_uses runs
  // under mu_), and nothing holding it takes mu_ or calls into the library.
  std::mutex waiters_mu_;
  // The streams that order freed blocks after other devices' work, by (the block's device, the
  // foreign stream's device, the foreign stream) (foreign_waiter).
  std::map<std::tuple<c10::DeviceIndex, c10::DeviceIndex, cudaStream_t>, cudaStream_t>
      foreign_waiters_;
  // Handles opened by getIpcDevPtr, by handle bytes.
  // Recursive: a shared_ptr whose construction fails runs its deleter, which takes it, at once.
  std::recursive_mutex ipc_mu_;
  std::unordered_map<std::string, std::weak_ptr<void>> ipc_opened_;
  std::unordered_map<void*, Live> live_;
  std::vector<Route> routes_;
  // Frees with uses on streams of a device where a routing was underway (free_ptr), until it
  // ends (flush_deferred_foreign).
  std::vector<std::pair<void*, Live>> deferred_foreign_;
  // Guards traces_, annotations_, history_enabled_, max_entries_, skip_ and trackers_ (the rest
  // is mu_'s): the segment callback takes it under the library's lock, so nothing holding it
  // calls into the library, and it is taken after mu_ where both are.
  std::mutex trace_mu_;
  std::vector<std::deque<TraceEntry>> traces_;
  std::deque<AnnotationEntry> annotations_;
  // Turns the trace entries' approximate clock into Unix time in snapshots, as PyTorch's
  // snapshot does (its clock_converter); started with the shim.
  c10::ApproximateClockToUnixTimeConverter clock_converter_;
  bool history_enabled_ = false;
  CreateContextFn recorder_ = nullptr;
  RecordContext record_when_ = RecordContext::NEVER;
  size_t max_entries_ = 1;
  std::unordered_set<std::string> skip_;
  std::vector<OutOfMemoryObserver> oom_observers_;
  std::vector<AllocatorTraceTracker> trackers_;
  // Frees whose blocks wait for recorded streams, by (device, address, generation): their
  // FREE_COMPLETED entries to come (complete_pending_free). Registered only while a history or
  // a tracker is on. Guarded by trace_mu_, as the generation counter is.
  std::map<std::tuple<c10::DeviceIndex, void*, uint64_t>, PendingFree> pending_frees_;
  uint64_t next_free_gen_ = 0;
};

// The allocator is immortal, as PyTorch's own is: at exit, torch's static destructors and the
// last tensors' deleters (raw_delete_fn) still call into it after this library's statics and the
// shared_ptr PyTorch holds have gone, and the memory history's contexts hold Python frames that
// must not be destroyed after the interpreter. A destroyed Shim there corrupted the heap at exit
// ("corrupted double-linked list" after the conformance script's last check, H100).
Shim* g_shim = nullptr;

void raw_delete_fn(void* ptr) {
  if (g_shim) g_shim->free_ptr(ptr);
}

// `settings` without its `key:value` items for `key` (items split at the commas outside
// brackets, as PyTorch's tokenizer reads `roundup_power2_divisions:[...]`).
std::string without_key(const std::string& settings, const std::string& key) {
  std::vector<std::string> items;
  std::string item;
  int depth = 0;
  for (char c : settings) {
    if (c == '[') ++depth;
    if (c == ']' && depth > 0) --depth;
    if (c == ',' && depth == 0) {
      items.push_back(item);
      item.clear();
    } else {
      item += c;
    }
  }
  items.push_back(item);
  std::string out;
  for (const auto& it : items) {
    auto colon = it.find(':');
    std::string k = it.substr(0, colon);
    k.erase(0, k.find_first_not_of(" \t"));
    k.erase(k.find_last_not_of(" \t") + 1);
    if (k == key || it.find_first_not_of(" \t") == std::string::npos) continue;
    if (!out.empty()) out += ',';
    out += it;
  }
  return out;
}

// Sets `expandable_segments` in PyTorch's own allocator settings to what this allocator does, as
// PYTORCH_CUDA_ALLOC_CONF tells them of PyTorch's allocator, so that PyTorch treats it alike:
// under expandable segments ProcessGroupNCCL leaves TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK
// off (shouldAllCommunicatorsRegisterAllTensors), since a segment registered whole would stay
// registered over pages unmapped and mapped again under it; with fixed segments (the `pytorch`
// preset) it registers them as for PyTorch's. The settings read so far are parsed again with the
// key replaced (parseArgs resets the keys it does not find).
void sync_pytorch_expandable(bool expandable) {
  using c10::CachingAllocator::AcceleratorAllocatorConfig;
  const std::string key = expandable ? "expandable_segments:True" : "expandable_segments:False";
  try {
    if (AcceleratorAllocatorConfig::use_expandable_segments() == expandable) return;
    std::string settings =
        without_key(AcceleratorAllocatorConfig::last_allocator_settings(), "expandable_segments");
    if (!settings.empty()) settings += ',';
    AcceleratorAllocatorConfig::instance().parseArgs(settings + key);
    return;
  } catch (const std::exception&) {
    // The last settings are a string PyTorch refused half-way (it keeps them as the last ones
    // before parsing): keep of them what PyTorch's host allocator reads, and the key. The
    // device allocator's tuning keys, which PyTorch's own allocator alone reads, go back to
    // their defaults while this one is installed.
  }
  try {
    std::string settings = key;
    if (AcceleratorAllocatorConfig::pinned_use_background_threads()) {
      settings += ",pinned_use_background_threads:True";
    }
    AcceleratorAllocatorConfig::instance().parseArgs(settings);
  } catch (const std::exception& e) {
    TORCH_WARN(cat("cuda_caching_allocator: could not set expandable_segments in PyTorch's "
                   "allocator settings to what this allocator does (NCCL's tensor registration "
                   "hook stays as set): ",
                   e.what()));
  }
}

// Where on_allocator_settings puts its warning: PyTorch's binding of setAllocatorSettings
// (torch._C._accelerator_setAllocatorSettings) does not turn a TORCH_WARN into a Python warning
// (it reaches stderr only), so the package's Python wrapper of that binding asks for the text
// here (settings_warnings_to_python) and raises a UserWarning with it. Other callers get the
// TORCH_WARN.
thread_local bool t_settings_to_python = false;
thread_local std::string t_settings_pending;

// PyTorch's device configuration hook, called by c10::CachingAllocator::setAllocatorSettings
// (torch.cuda.memory._set_allocator_settings) after PyTorch parsed the string into its own
// settings. The devices' caches take their configuration once, at enable(): PyTorch's
// expandable_segments is set back to what they do, and the keys that would have changed them are
// named in a warning rather than left silently unapplied.
void on_allocator_settings(const std::string& env) {
  if (g_shim == nullptr) return;
  sync_pytorch_expandable(g_shim->expandable());
  std::string text;
  std::string msg;
  if (!g_shim->settings_not_applied(env, text)) {
    msg = cat("cuda_caching_allocator: allocator settings '", env,
              "' were applied to PyTorch's own settings only; this allocator cannot read them: ",
              text);
  } else if (!text.empty()) {
    msg = cat("cuda_caching_allocator: allocator settings '", env,
              "' were applied to PyTorch's own settings only; this allocator takes its "
              "configuration once, when enable() installs it, and keeps it. Not applied: ",
              text,
              ". Pass these keys to cuda_caching_allocator.torch.enable(config=...) instead "
              "(PyTorch's expandable_segments stays ",
              g_shim->expandable() ? "True" : "False", ", as this allocator runs).");
  }
  if (msg.empty()) return;
  if (t_settings_to_python) {
    t_settings_pending = std::move(msg);
  } else {
    TORCH_WARN(msg);
  }
}

// Chains on_allocator_settings after the device configuration hook PyTorch registered (CUDA's
// parser of its own keys), once.
void hook_allocator_settings() {
  using c10::CachingAllocator::AcceleratorAllocatorConfig;
  static bool hooked = false;
  if (hooked) return;
  hooked = true;
  auto& hook = AcceleratorAllocatorConfig::getConfigParserHook();
  std::function<void(const std::string&)> previous = hook;
  hook = [previous](const std::string& env) {
    try {
      if (previous) previous(env);
    } catch (...) {
      // CUDA's parser refused the string after PyTorch's generic one had already set
      // expandable_segments from it: set it back before the error goes on.
      if (g_shim != nullptr) sync_pytorch_expandable(g_shim->expandable());
      throw;
    }
    on_allocator_settings(env);
  };
}

// The library and configuration g_shim was created with.
std::string g_shim_library, g_shim_config;

std::shared_ptr<CCA::CUDAAllocator> create(const std::string& library, const std::string& config) {
  TORCH_CHECK(!g_shim, "cuda_caching_allocator: the allocator was already created");
  g_shim = new Shim(load_api(library), config);
  g_shim_library = library;
  g_shim_config = config;
  const char* timing = std::getenv("CCA_HOST_TIMING");
  g_timing.on.store(timing != nullptr && std::string(timing) == "1");
  // A no-op deleter: PyTorch's reference never destroys it.
  return std::shared_ptr<CCA::CUDAAllocator>(g_shim, [](CCA::CUDAAllocator*) {});
}

// Creates the allocator and makes it PyTorch's CUDA allocator, as
// torch._C._cuda_changeCurrentAllocator does.
//
// Note [A refused install leaves nothing]: PyTorch refuses the swap once its current allocator
// is initialized (CUDAPluggableAllocator.cpp, changeCurrentAllocator: "Can't swap an already
// initialized allocator"), which any CUDA initialisation in PyTorch does. The allocator object is
// made once per process (it is immortal, g_shim); made for a swap PyTorch then refused, it
// stayed, so a second enable() failed with "the allocator was already created" instead of
// PyTorch's reason, and its constructor had fixed the library's configuration. PyTorch's check
// is now made first, in PyTorch's words, before anything is made; an object left by a swap
// refused anyway (CUDA initialised by another thread in between) is the one a later call
// installs.
void install(const std::string& library, const std::string& config) {
  CCA::CUDAAllocator* current = CCA::allocator.load();
  TORCH_CHECK(current == nullptr || !current->initialized(),
              "Can't swap an already initialized allocator");
  std::shared_ptr<CCA::CUDAAllocator> made;
  if (g_shim != nullptr && current != g_shim) {
    TORCH_CHECK(library == g_shim_library && config == g_shim_config,
                cat("cuda_caching_allocator: the allocator was already created with library '",
                    g_shim_library, "' and configuration '", g_shim_config,
                    "' (by an install PyTorch refused); it cannot change in this process"));
    made = std::shared_ptr<CCA::CUDAAllocator>(g_shim, [](CCA::CUDAAllocator*) {});
  } else {
    made = create(library, config);
  }
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(made);
  // Only here, where the allocator becomes PyTorch's (gpu/ab_shim.cpp creates one beside
  // PyTorch's own, whose behaviour the settings would change).
  sync_pytorch_expandable(g_shim->expandable());
  hook_allocator_settings();
}

}  // namespace cca

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cuda-caching-allocator as a c10::cuda::CUDACachingAllocator::CUDAAllocator";
  m.def("create", &cca::create, "Loads the native library and returns the allocator object "
        "(torch._C._cuda_CUDAAllocator) for torch._C._cuda_changeCurrentAllocator",
        pybind11::arg("library"), pybind11::arg("config"));
  m.def("install", &cca::install, "Loads the native library and makes the allocator PyTorch's "
        "CUDA allocator", pybind11::arg("library"), pybind11::arg("config"));
  m.def("abi_version", []() { return cca::kAbiVersion; });
  m.def("settings_warnings_to_python", [](bool on) {
    std::string pending = std::move(cca::t_settings_pending);
    cca::t_settings_pending.clear();
    cca::t_settings_to_python = on;
    return pending;
  }, "Routes this thread's allocator-settings warning to the caller (on) or to TORCH_WARN (off); "
     "returns the warning kept since the last call (empty: none)", pybind11::arg("on"));
  m.def("sync_pytorch_expandable", []() {
    if (cca::g_shim != nullptr) cca::sync_pytorch_expandable(cca::g_shim->expandable());
  }, "Sets PyTorch's own expandable_segments to what the installed allocator does (after a "
     "settings string PyTorch's generic parser applied before refusing it)");
  m.def("pytorch_expandable", []() {
    return c10::CachingAllocator::AcceleratorAllocatorConfig::use_expandable_segments();
  }, "PyTorch's own expandable_segments setting (ProcessGroupNCCL reads it)");
  m.def("host_time", []() {
    auto& t = cca::g_timing;
    return pybind11::make_tuple(t.on.load(), t.alloc_ns.load(), t.alloc_calls.load(),
                                t.free_ns.load(), t.free_calls.load());
  }, "(on, allocate ns, allocate calls, free ns, free calls) of the opt-in host timing");
}
