// A/B allocator for gpu/clients.py --ab: one process, two allocators, switched between steps.
//
// Step times of separate processes moved by ±20 % between repeats on the GPU hosts (native's own
// step from 114 to 169 ms within one call, docs/gpu-results.md), so #11's "median step within
// native + 2 %" could be neither shown nor refused from them. Here PyTorch's native caching
// allocator and the crate's (the package's shim object, created but not installed) live in one
// process behind this CUDAAllocator; the client runs every input twice in a row, once under each
// allocator (in ABBA order), and compares the two times of the same input, taken a step apart.
//
// Routing: `allocate` and `raw_alloc*` go to the allocator of the current mode (`set_mode`,
// called between steps after a device synchronization). A tensor's DataPtr carries its owner's
// deleter, so its free goes home whatever the mode is then; `recordStream` is routed by that
// deleter; `raw_delete` by a table of the raw pointers each allocator handed out. Everything
// else (statistics, history, graph pools) goes to the crate's allocator, except `init`,
// `emptyCache`, the peak and accumulated resets and the memory fraction, which go to both.
// With CCA_HOST_TIMING=1 at `install`, `allocate` times each call of either side (steady_clock,
// two reads per call, the same scope for both), so a step's allocation time under native and
// under the crate compare on the same inputs; frees go to each side's own deleter and are not
// timed here (the crate's shim times its own, `host_time`).
// A measuring tool, not a product feature: the package never installs it.
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/extension.h>

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace ab {

using c10::MempoolId_t;
using c10::cuda::CUDAStream;
namespace CCA = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::AllocatorTraceTracker;
using c10::CachingDeviceAllocator::CreateContextFn;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::RecordContext;

class Ab;
Ab* g_ab = nullptr;
void raw_delete_fn(void* ptr);

class Ab : public CCA::CUDAAllocator {
 public:
  // `native` is PyTorch's own allocator object (static, never destroyed), `crate` the package's.
  Ab(CCA::CUDAAllocator* native, std::shared_ptr<CCA::CUDAAllocator> crate)
      : native_(native), crate_(std::move(crate)) {
    const char* t = std::getenv("CCA_HOST_TIMING");
    timing_ = t != nullptr && std::string(t) == "1";
  }

  // 0: native, 1: the crate.
  void set_mode(int mode) { mode_.store(mode, std::memory_order_relaxed); }
  int mode() const { return mode_.load(std::memory_order_relaxed); }
  CCA::CUDAAllocator* side(int which) { return which == 0 ? native_ : crate_.get(); }
  CCA::CUDAAllocator* current() { return side(mode()); }

  c10::DataPtr allocate(size_t n) override {
    if (!timing_) return current()->allocate(n);
    int m = mode();
    auto t0 = std::chrono::steady_clock::now();
    c10::DataPtr d = side(m)->allocate(n);
    auto t1 = std::chrono::steady_clock::now();
    alloc_ns_[m].fetch_add(
        static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count()),
        std::memory_order_relaxed);
    alloc_calls_[m].fetch_add(1, std::memory_order_relaxed);
    return d;
  }
  // (timing on, native ns, native calls, crate ns, crate calls) of `allocate` so far.
  std::tuple<bool, uint64_t, uint64_t, uint64_t, uint64_t> host_alloc() const {
    return {timing_, alloc_ns_[0].load(), alloc_calls_[0].load(), alloc_ns_[1].load(),
            alloc_calls_[1].load()};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete_fn; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    crate_->copy_data(dest, src, count);
  }

  bool initialized() override { return native_->initialized() && crate_->initialized(); }
  void emptyCache(MempoolId_t id) override {
    native_->emptyCache(id);
    crate_->emptyCache(id);
  }
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    return crate_->getDeviceStats(device);
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    native_->resetAccumulatedStats(device);
    crate_->resetAccumulatedStats(device);
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    native_->resetPeakStats(device);
    crate_->resetPeakStats(device);
  }

  void* raw_alloc(size_t nbytes) override { return remember(current()->raw_alloc(nbytes)); }
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    return remember(current()->raw_alloc_with_stream(nbytes, stream));
  }
  void raw_delete(void* ptr) override {
    if (!ptr) return;
    int owner = 1;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = raw_.find(ptr);
      if (it != raw_.end()) {
        owner = it->second;
        raw_.erase(it);
      }
    }
    side(owner)->raw_delete(ptr);
  }
  void init(int device_count) override {
    native_->init(device_count);
    crate_->init(device_count);
  }
  double getMemoryFraction(c10::DeviceIndex device) override {
    return crate_->getMemoryFraction(device);
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    native_->setMemoryFraction(fraction, device);
    crate_->setMemoryFraction(fraction, device);
  }
  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex d) override {
    return crate_->getExpandableSegmentSizes(d);
  }
  void enable(bool value) override {
    native_->enable(value);
    crate_->enable(value);
  }
  bool isEnabled() const override { return crate_->isEnabled(); }
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    current()->cacheInfo(device, largestBlock);
  }
  void* getBaseAllocation(void* ptr, size_t* size) override {
    return crate_->getBaseAllocation(ptr, size);
  }
  void recordStream(const c10::DataPtr& ptr, CUDAStream stream) override {
    if (!ptr.get()) return;
    auto deleter = ptr.get_deleter();
    if (deleter == native_->raw_deleter()) {
      native_->recordStream(ptr, stream);
    } else if (deleter == crate_->raw_deleter()) {
      crate_->recordStream(ptr, stream);
    }
    // Other deleters (from_blob, this class's raw deleter) own no cached block: as PyTorch's
    // own allocator, nothing to record.
  }
  CCA::SnapshotInfo snapshot(MempoolId_t id, bool include_traces) override {
    return crate_->snapshot(id, include_traces);
  }
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    crate_->beginAllocateToPool(device, id, std::move(filter));
  }
  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t id) override {
    crate_->endAllocateToPool(device, id);
  }
  void releasePool(c10::DeviceIndex device, MempoolId_t id) override {
    crate_->releasePool(device, id);
  }
  CCA::ShareableHandle shareIpcHandle(void* ptr) override { return crate_->shareIpcHandle(ptr); }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    return crate_->getIpcDevPtr(std::move(handle));
  }
  bool isHistoryEnabled() override { return crate_->isHistoryEnabled(); }
  void recordHistory(bool enabled, CreateContextFn context_recorder, size_t max_entries,
                     RecordContext when, bool clear,
                     const std::vector<std::string>& skip_actions) override {
    crate_->recordHistory(enabled, context_recorder, max_entries, when, clear, skip_actions);
  }
  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override {
    native_->attachOutOfMemoryObserver(observer);
    crate_->attachOutOfMemoryObserver(std::move(observer));
  }
  void attachAllocatorTraceTracker(AllocatorTraceTracker tracker) override {
    native_->attachAllocatorTraceTracker(tracker);
    crate_->attachAllocatorTraceTracker(std::move(tracker));
  }
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    crate_->enablePeerAccess(dev, dev_to_access);
  }
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    return crate_->memcpyAsync(dst, dstDevice, src, srcDevice, count, stream, p2p_enabled);
  }
  std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          MempoolId_t id) override {
    return crate_->getCheckpointState(device, id);
  }
  CCA::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<CCA::AllocatorState> pps) override {
    return crate_->setCheckpointPoolState(device, std::move(pps));
  }
  std::string name() override { return "ab(native, " + crate_->name() + ")"; }

 private:
  void* remember(void* p) {
    if (p) {
      std::lock_guard<std::mutex> g(mu_);
      raw_[p] = mode();
    }
    return p;
  }

  CCA::CUDAAllocator* native_;
  std::shared_ptr<CCA::CUDAAllocator> crate_;
  std::atomic<int> mode_{0};
  bool timing_ = false;
  std::atomic<uint64_t> alloc_ns_[2] = {0, 0};
  std::atomic<uint64_t> alloc_calls_[2] = {0, 0};
  std::mutex mu_;
  std::unordered_map<void*, int> raw_;
};

void raw_delete_fn(void* ptr) {
  if (g_ab) g_ab->raw_delete(ptr);
}

// Installs the A/B allocator over PyTorch's native one (which must not be initialized yet, as
// for any allocator change) and the crate's object from the package's shim (`create`).
void install(std::shared_ptr<CCA::CUDAAllocator> crate) {
  TORCH_CHECK(!g_ab, "ab: already installed");
  CCA::CUDAAllocator* native = CCA::get();
  TORCH_CHECK(native != nullptr && native != crate.get(), "ab: no native allocator");
  // Immortal, as both allocators it routes to.
  g_ab = new Ab(native, std::move(crate));
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(
      std::shared_ptr<CCA::CUDAAllocator>(g_ab, [](CCA::CUDAAllocator*) {}));
}

Ab& get() {
  TORCH_CHECK(g_ab, "ab: not installed");
  return *g_ab;
}

}  // namespace ab

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "PyTorch's native allocator and the crate's in one process, switched between steps";
  m.def("install", &ab::install, pybind11::arg("crate"));
  m.def("set_mode", [](int mode) { ab::get().set_mode(mode); }, pybind11::arg("mode"));
  m.def("mode", []() { return ab::get().mode(); });
  m.def(
      "host_alloc",
      []() {
        auto [on, n_ns, n_calls, c_ns, c_calls] = ab::get().host_alloc();
        return pybind11::make_tuple(on, n_ns, n_calls, c_ns, c_calls);
      },
      "(timing on, native ns, native calls, crate ns, crate calls) of the timed allocations");
  m.def(
      "stats",
      [](int which, int device) {
        auto s = ab::get().side(which)->getDeviceStats(static_cast<c10::DeviceIndex>(device));
        auto all = static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE);
        pybind11::dict d;
        d["reserved_bytes.all.peak"] = s.reserved_bytes[all].peak;
        d["reserved_bytes.all.current"] = s.reserved_bytes[all].current;
        d["allocated_bytes.all.peak"] = s.allocated_bytes[all].peak;
        d["allocated_bytes.all.current"] = s.allocated_bytes[all].current;
        d["allocation.all.allocated"] = s.allocation[all].allocated;
        d["num_device_alloc"] = s.num_device_alloc;
        d["num_device_free"] = s.num_device_free;
        d["num_sync_all_streams"] = s.num_sync_all_streams;
        return d;
      },
      pybind11::arg("which"), pybind11::arg("device") = 0,
      "Statistics of one side (0: native, 1: the crate) on one device");
}
