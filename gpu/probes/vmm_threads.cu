// Driver probe for #11: do the virtual-memory calls run in parallel when several host threads
// make them, and do they hold up another thread's stream work while they run? If a growth's
// pages could be created, mapped and granted access by helper threads at once, "pages made off
// the critical path" would cut a cold start's time; if the driver serializes the calls, it
// cannot. Prints one line per measurement.
// Build: nvcc -O2 -o vmm_threads vmm_threads.cu -lcuda -lpthread
#include <cuda.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s; cuGetErrorName(r_, &s); printf("FAIL %s -> %s (line %d)\n", #x, s, __LINE__); } } while (0)
static double now_us() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static double p50(std::vector<double> v) { std::sort(v.begin(), v.end()); return v.empty() ? 0 : v[v.size() / 2]; }
static double p99(std::vector<double> v) { std::sort(v.begin(), v.end()); return v.empty() ? 0 : v[v.size() * 99 / 100]; }
static CUmemAllocationProp prop;
static CUmemAccessDesc acc;
static const size_t MB = 1 << 20, PAGE = 2 * MB;
static CUcontext ctx;

// Per-phase totals of one thread's share: create, map, set access (then unmap, release).
struct Share { double create = 0, map = 0, access = 0, unmap = 0, release = 0; };

static void make_pages(CUdeviceptr base, int n, Share* out, std::vector<CUmemGenericAllocationHandle>* hs) {
  CK(cuCtxSetCurrent(ctx));
  hs->resize(n);
  double t = now_us();
  for (int i = 0; i < n; i++) CK(cuMemCreate(&(*hs)[i], PAGE, &prop, 0));
  out->create = now_us() - t; t = now_us();
  for (int i = 0; i < n; i++) CK(cuMemMap(base + (size_t)i * PAGE, PAGE, 0, (*hs)[i], 0));
  out->map = now_us() - t; t = now_us();
  for (int i = 0; i < n; i++) CK(cuMemSetAccess(base + (size_t)i * PAGE, PAGE, &acc, 1));
  out->access = now_us() - t;
}

static void drop_pages(CUdeviceptr base, int n, Share* out, std::vector<CUmemGenericAllocationHandle>* hs) {
  CK(cuCtxSetCurrent(ctx));
  double t = now_us();
  for (int i = 0; i < n; i++) CK(cuMemUnmap(base + (size_t)i * PAGE, PAGE));
  out->unmap = now_us() - t; t = now_us();
  for (int i = 0; i < n; i++) CK(cuMemRelease((*hs)[i]));
  out->release = now_us() - t;
}

int main() {
  CK(cuInit(0));
  CUdevice dev; CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  prop = {}; prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  acc = {}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const int TOTAL = 1024;  // 2 GiB of 2 MiB pages per round
  CUdeviceptr va; CK(cuMemAddressReserve(&va, (size_t)TOTAL * PAGE, 0, 0, 0));
  // 1. The same 1,024 pages made by 1, 2, 4, 8 threads, each its own slice of one range.
  for (int rep = 0; rep < 2; rep++) {
    for (int T : {1, 2, 4, 8}) {
      int per = TOTAL / T;
      std::vector<Share> sh(T);
      std::vector<std::vector<CUmemGenericAllocationHandle>> hs(T);
      std::vector<std::thread> th;
      double t = now_us();
      for (int k = 0; k < T; k++) th.emplace_back(make_pages, va + (size_t)k * per * PAGE, per, &sh[k], &hs[k]);
      for (auto& x : th) x.join();
      double made = now_us() - t;
      // Check the pages hold data (the whole range, written and read back in one place).
      CK(cuMemsetD32(va, 0x5a5a5a5a, (size_t)TOTAL * PAGE / 4)); CK(cuCtxSynchronize());
      unsigned probe = 0; CK(cuMemcpyDtoH(&probe, va + (size_t)(TOTAL - 1) * PAGE + 64, 4));
      th.clear(); t = now_us();
      for (int k = 0; k < T; k++) th.emplace_back(drop_pages, va + (size_t)k * per * PAGE, per, &sh[k], &hs[k]);
      for (auto& x : th) x.join();
      double dropped = now_us() - t;
      double c = 0, m = 0, a = 0, u = 0, r = 0;
      for (auto& s : sh) { c = std::max(c, s.create); m = std::max(m, s.map); a = std::max(a, s.access); u = std::max(u, s.unmap); r = std::max(r, s.release); }
      printf("threads %d (round %d): make %.1f ms (%.1f us/page), drop %.1f ms (%.1f us/page); slowest thread: create %.1f map %.1f access %.1f unmap %.1f release %.1f ms; data %s\n",
             T, rep, made / 1e3, made / TOTAL, dropped / 1e3, dropped / TOTAL, c / 1e3, m / 1e3, a / 1e3, u / 1e3, r / 1e3,
             probe == 0x5a5a5a5a ? "ok" : "WRONG");
    }
  }
  // 2. Does a helper thread making pages hold up the main thread's stream work? The main thread
  // enqueues small async memsets on its own stream and times each enqueue, alone and while a
  // helper makes and drops pages in a loop.
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr buf; CK(cuMemAlloc(&buf, 1 << 20));
  auto launches = [&](int n) {
    std::vector<double> v; v.reserve(n);
    for (int i = 0; i < n; i++) {
      double t = now_us(); CK(cuMemsetD32Async(buf, i, 1 << 18, s)); v.push_back(now_us() - t);
      if (i % 64 == 63) CK(cuStreamSynchronize(s));
    }
    CK(cuStreamSynchronize(s));
    return v;
  };
  auto alone = launches(4000);
  std::atomic<bool> stop{false};
  std::atomic<long> helper_pages{0};
  std::thread helper([&] {
    CK(cuCtxSetCurrent(ctx));
    std::vector<CUmemGenericAllocationHandle> hs;
    Share sh;
    while (!stop.load()) {
      make_pages(va, 64, &sh, &hs);
      drop_pages(va, 64, &sh, &hs);
      helper_pages += 64;
    }
  });
  double t = now_us();
  auto busy = launches(4000);
  double busy_ms = (now_us() - t) / 1e3;
  stop = true; helper.join();
  printf("enqueue of an async memset, us: alone p50 %.2f p99 %.2f; while a helper makes pages p50 %.2f p99 %.2f (%ld pages made and dropped in %.1f ms)\n",
         p50(alone), p99(alone), p50(busy), p99(busy), helper_pages.load(), busy_ms);
  // 3. The same for page making on the main thread while a helper enqueues work (the other way
  // round): per-page cost of make + drop alone and beside a launching thread.
  {
    std::vector<CUmemGenericAllocationHandle> hs; Share sh;
    double t0 = now_us(); make_pages(va, 256, &sh, &hs); drop_pages(va, 256, &sh, &hs); double lone = (now_us() - t0) / 256;
    std::atomic<bool> stop2{false};
    std::thread launcher([&] { CK(cuCtxSetCurrent(ctx)); while (!stop2.load()) { CK(cuMemsetD32Async(buf, 1, 1 << 18, s)); CK(cuStreamSynchronize(s)); } });
    t0 = now_us(); make_pages(va, 256, &sh, &hs); drop_pages(va, 256, &sh, &hs); double beside = (now_us() - t0) / 256;
    stop2 = true; launcher.join();
    printf("make + drop one page, us: alone %.1f, beside a launching thread %.1f\n", lone, beside);
  }
  CK(cuMemFree(buf)); CK(cuStreamDestroy(s));
  CK(cuMemAddressFree(va, (size_t)TOTAL * PAGE));
  printf("done\n");
  return 0;
}
