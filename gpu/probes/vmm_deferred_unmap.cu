// Driver probe for #11: can a page move's `cuMemUnmap` leave the allocating thread? A move today
// is unmap (old address) + map (new address) + set access, all on the thread that allocates.
// A handle may be mapped at two addresses at once (vmm_alias_host.cu), so the move could map and
// grant access at the new address first and hand the old address's unmap to a helper thread.
// That pays only if the helper's unmaps do not hold up the allocating thread: its own map and
// access calls (the driver may serialize VMM calls across threads, vmm_threads.cu), and its
// kernel launches. Prints one line per measurement.
// Build: nvcc -O2 -o vmm_deferred_unmap vmm_deferred_unmap.cu -lcuda -lpthread
#include <cuda.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s; cuGetErrorName(r_, &s); printf("FAIL %s -> %s (line %d)\n", #x, s, __LINE__); } } while (0)
static double now_us() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v.empty() ? 0 : v[v.size() / 2]; }
static const size_t MB = 1 << 20, PAGE = 2 * MB;
static const int N = 256;  // pages moved per round (512 MiB)
static CUcontext ctx;
static CUmemAccessDesc acc;

// The helper: unmaps the addresses queued to it, one call each, until told to stop.
struct Helper {
  std::mutex m;
  std::condition_variable cv;
  std::deque<CUdeviceptr> q;
  bool stop = false;
  std::atomic<int> done{0};
  std::thread th;
  void start() {
    th = std::thread([this] {
      CK(cuCtxSetCurrent(ctx));
      for (;;) {
        CUdeviceptr a;
        {
          std::unique_lock<std::mutex> l(m);
          cv.wait(l, [this] { return stop || !q.empty(); });
          if (q.empty()) return;
          a = q.front(); q.pop_front();
        }
        CK(cuMemUnmap(a, PAGE));
        done.fetch_add(1);
      }
    });
  }
  void push(CUdeviceptr a) { { std::lock_guard<std::mutex> l(m); q.push_back(a); } cv.notify_one(); }
  void wait_for(int n) { while (done.load() < n) std::this_thread::yield(); }
  void finish() { { std::lock_guard<std::mutex> l(m); stop = true; } cv.notify_one(); th.join(); }
};

// Writes a pattern through `from`'s pages and reads it back through `to`'s (or the same).
static bool check(CUdeviceptr at, unsigned pattern) {
  CK(cuMemsetD32(at, pattern, N * PAGE / 4)); CK(cuCtxSynchronize());
  unsigned a = 0, b = 0;
  CK(cuMemcpyDtoH(&a, at + 64, 4)); CK(cuMemcpyDtoH(&b, at + (size_t)(N - 1) * PAGE + 4096, 4));
  return a == pattern && b == pattern;
}

int main() {
  CK(cuInit(0));
  CUdevice dev; CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  acc = {}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr va[2];
  CK(cuMemAddressReserve(&va[0], N * PAGE, 0, 0, 0)); CK(cuMemAddressReserve(&va[1], N * PAGE, 0, 0, 0));
  std::vector<CUmemGenericAllocationHandle> h(N);
  for (int i = 0; i < N; i++) {
    CK(cuMemCreate(&h[i], PAGE, &prop, 0));
    CK(cuMemMap(va[0] + i * PAGE, PAGE, 0, h[i], 0));
    CK(cuMemSetAccess(va[0] + i * PAGE, PAGE, &acc, 1));
  }
  int at = 0;  // where the pages are mapped now
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr scratch; CK(cuMemAlloc(&scratch, 1 << 20));
  // Launch work alone: 4,000 small async memsets, enqueue time per call (the host's launch
  // pace in a step), no VMM calls anywhere.
  auto launches = [&](int n) {
    double t = now_us();
    for (int i = 0; i < n; i++) CK(cuMemsetD8Async(scratch + (i % 1024) * 1024, (unsigned char)i, 1024, s));
    return (now_us() - t) / n;
  };
  CK(cuStreamSynchronize(s));
  std::vector<double> inl, alias_cc, helper_cc, launch_alone, launch_beside, helper_rate, map_only;
  bool ok = check(va[at], 0x11111111);
  for (int round = 0; round < 6; round++) {
    // A. Today: per page unmap old, map new, set access, all on this thread.
    {
      int to = 1 - at;
      double t = now_us();
      for (int i = 0; i < N; i++) {
        CK(cuMemUnmap(va[at] + i * PAGE, PAGE));
        CK(cuMemMap(va[to] + i * PAGE, PAGE, 0, h[i], 0));
        CK(cuMemSetAccess(va[to] + i * PAGE, PAGE, &acc, 1));
      }
      inl.push_back((now_us() - t) / N);
      at = to;
      ok &= check(va[at], 0x22222222 + round);
    }
    // B. Map first, the helper unmaps the old address at once (both threads in VMM calls).
    {
      int to = 1 - at;
      Helper hp; hp.start();
      double t = now_us();
      for (int i = 0; i < N; i++) {
        CK(cuMemMap(va[to] + i * PAGE, PAGE, 0, h[i], 0));
        CK(cuMemSetAccess(va[to] + i * PAGE, PAGE, &acc, 1));
        hp.push(va[at] + i * PAGE);
      }
      helper_cc.push_back((now_us() - t) / N);
      hp.wait_for(N); hp.finish();
      at = to;
      ok &= check(va[at], 0x33333333 + round);
    }
    // C. Map first on this thread alone (the helper idle): the critical path's floor.
    {
      int to = 1 - at;
      double t = now_us();
      for (int i = 0; i < N; i++) {
        CK(cuMemMap(va[to] + i * PAGE, PAGE, 0, h[i], 0));
        CK(cuMemSetAccess(va[to] + i * PAGE, PAGE, &acc, 1));
      }
      map_only.push_back((now_us() - t) / N);
      // Alias check: written through the new address, read through the old one still mapped.
      CK(cuMemsetD32(va[to], 0x44444444 + round, N * PAGE / 4)); CK(cuCtxSynchronize());
      unsigned old = 0; CK(cuMemcpyDtoH(&old, va[at] + 5 * PAGE + 8, 4));
      ok &= old == 0x44444444u + round;
      // D. Then launches while the helper unmaps the old addresses (one step's Python and
      // kernel work beside the deferred unmaps), against launches alone.
      launch_alone.push_back(launches(4000));
      CK(cuStreamSynchronize(s));
      Helper hp; hp.start();
      double t0 = now_us();
      for (int i = 0; i < N; i++) hp.push(va[at] + i * PAGE);
      launch_beside.push_back(launches(4000));
      hp.wait_for(N);
      helper_rate.push_back((now_us() - t0) / N);
      hp.finish();
      CK(cuStreamSynchronize(s));
      at = to;
      ok &= check(va[at], 0x55555555 + round);
    }
    // A'. The inline move once more at the end of the round (drift control).
    {
      int to = 1 - at;
      double t = now_us();
      for (int i = 0; i < N; i++) {
        CK(cuMemUnmap(va[at] + i * PAGE, PAGE));
        CK(cuMemMap(va[to] + i * PAGE, PAGE, 0, h[i], 0));
        CK(cuMemSetAccess(va[to] + i * PAGE, PAGE, &acc, 1));
      }
      inl.push_back((now_us() - t) / N);
      at = to;
      ok &= check(va[at], 0x66666666 + round);
    }
  }
  printf("pages per round %d (2 MiB handles), 6 rounds, medians in us per page or per launch\n", N);
  printf("A  move inline (unmap + map + access, one thread): %.1f us/page (%zu samples)\n", median(inl), inl.size());
  printf("B  map + access, helper unmapping at the same time: %.1f us/page on the allocating thread\n", median(helper_cc));
  printf("C  map + access only (helper idle): %.1f us/page\n", median(map_only));
  printf("D  launch enqueue alone %.2f us, beside the helper's unmaps %.2f us; helper %.1f us/unmap\n",
         median(launch_alone), median(launch_beside), median(helper_rate));
  printf("data and alias checks: %s\n", ok ? "ok" : "WRONG");
  for (int i = 0; i < N; i++) { CK(cuMemUnmap(va[at] + i * PAGE, PAGE)); CK(cuMemRelease(h[i])); }
  return ok ? 0 : 1;
}
