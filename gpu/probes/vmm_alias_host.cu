// Driver probe for #11 and #16: two questions whose answers decide designs.
//
//  A. Aliasing (#11): can one physical handle be mapped whole at two virtual ranges at once, with
//     both views seeing the same bytes, and what does the second view cost? If it can, free memory
//     stranded inside a large, partly used handle can be reached through a new view instead of
//     creating memory (large handles for cold speed, 2 MiB reuse for memory).
//  B. Host memory through the virtual-memory API (#16): cuMemCreate with CU_MEM_LOCATION_TYPE_HOST
//     gives page-locked host pages that are mapped like device pages; can the host read and write
//     them, do asynchronous copies from them run at pinned bandwidth and stay asynchronous (also
//     when one copy spans several handles mapped side by side), and what do create / map / access
//     / remap cost? If all holds, a pinned cache can move host pages the way expandable segments
//     move device pages, instead of pinning new slabs.
//  C. cuMemHostRegister (#16): cost of registering touched memory (1, 4, 16 touch threads) against
//     cuMemHostAlloc, and whether one copy may span two registrations side by side.
//
// Prints one line per measurement; "FAIL" lines name the call and its error.
// Build: nvcc -O2 -o vmm_alias_host vmm_alias_host.cu -lcuda -lpthread
#include <cuda.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#define CK(x) ck((x), #x, __LINE__)
static bool ck(CUresult r, const char* what, int line) {
  if (r == CUDA_SUCCESS) return true;
  const char* s = "?";
  cuGetErrorName(r, &s);
  printf("FAIL %s -> %s (line %d)\n", what, s, line);
  return false;
}
static double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static double p50(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
static const size_t MB = 1 << 20;

// Runs f in a child process; true when it exits 0 (a segfault in f does not kill the probe).
template <class F>
static bool in_child(F f) {
  fflush(stdout);
  pid_t p = fork();
  if (p == 0) _exit(f() ? 0 : 1);
  int st = 0;
  waitpid(p, &st, 0);
  return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

static void touch(char* p, size_t n, int threads) {
  std::vector<std::thread> ts;
  size_t chunk = (n / threads + 4095) / 4096 * 4096;
  for (int t = 0; t < threads; t++)
    ts.emplace_back([=] {
      size_t lo = t * chunk, hi = std::min(n, lo + chunk);
      for (size_t i = lo; i < hi; i += 4096) p[i] = (char)i;
    });
  for (auto& t : ts) t.join();
}

// Copies n bytes host -> device `reps` times on stream s; returns GB/s and the p50 time for the
// call to return (an asynchronous copy returns long before it completes).
static void bw(const char* label, void* host, CUdeviceptr dev, size_t n, CUstream s) {
  std::vector<double> ret;
  CK(cuMemcpyHtoDAsync(dev, host, n, s));
  CK(cuStreamSynchronize(s));
  int reps = 10;
  double t0 = now_us();
  for (int i = 0; i < reps; i++) {
    double t = now_us();
    CK(cuMemcpyHtoDAsync(dev, host, n, s));
    ret.push_back(now_us() - t);
  }
  CK(cuStreamSynchronize(s));
  double total = now_us() - t0;
  double td0 = now_us();
  for (int i = 0; i < reps; i++) CK(cuMemcpyDtoHAsync(host, dev, n, s));
  CK(cuStreamSynchronize(s));
  double tdt = now_us() - td0;
  printf("%s: htod %.2f GB/s (call returns in %.1f us p50, a copy takes %.1f us), dtoh %.2f GB/s\n", label,
         reps * n / total / 1e3, p50(ret), total / reps, reps * n / tdt / 1e3);
}

int main() {
  if (!CK(cuInit(0))) return 1;
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CUstream s;
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUmemAllocationProp dprop = {};
  dprop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  dprop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  dprop.location.id = 0;
  CUmemAccessDesc dacc = {};
  dacc.location = dprop.location;
  dacc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr va;
  size_t VA = 64ull << 30;
  CK(cuMemAddressReserve(&va, VA, 0, 0, 0));

  // ---- A. aliasing ---------------------------------------------------------------------------
  printf("== A. one device handle mapped at two virtual ranges\n");
  {
    size_t sz = 64 * MB;
    CUmemGenericAllocationHandle h;
    CK(cuMemCreate(&h, sz, &dprop, 0));
    CUdeviceptr v1 = va, v2 = va + 128 * MB;
    bool m1 = CK(cuMemMap(v1, sz, 0, h, 0)) && CK(cuMemSetAccess(v1, sz, &dacc, 1));
    double t = now_us();
    bool m2 = CK(cuMemMap(v2, sz, 0, h, 0));
    double tm = now_us() - t;
    t = now_us();
    m2 = m2 && CK(cuMemSetAccess(v2, sz, &dacc, 1));
    double ta = now_us() - t;
    printf("second view of a mapped 64 MiB handle: %s (map %.1f us, set_access %.1f us)\n", m1 && m2 ? "ok" : "REFUSED", tm, ta);
    if (m1 && m2) {
      std::vector<unsigned> hb(1024);
      CK(cuMemsetD32(v1, 0x11111111u, sz / 4));
      CK(cuMemsetD32(v2 + 32 * MB, 0x22222222u, 1024));
      CK(cuCtxSynchronize());
      CK(cuMemcpyDtoH(hb.data(), v2 + 4 * MB, 4096));
      bool a = hb[0] == 0x11111111u && hb[1023] == 0x11111111u;
      CK(cuMemcpyDtoH(hb.data(), v1 + 32 * MB, 4096));
      bool b = hb[0] == 0x22222222u && hb[1023] == 0x22222222u;
      printf("writes through view 1 seen through view 2: %s; through view 2 seen through view 1: %s\n", a ? "yes" : "NO", b ? "yes" : "NO");
      // a kernel-free copy between the two views of the same bytes
      CK(cuMemcpyDtoD(v2 + 48 * MB, v1 + 32 * MB, 4096));
      CK(cuMemcpyDtoH(hb.data(), v1 + 48 * MB, 4096));
      printf("copy view1 -> view2 region, read back through view 1: %s\n", hb[0] == 0x22222222u ? "ok" : "WRONG");
      // drop view 1 and the handle: view 2 keeps the memory
      CK(cuMemUnmap(v1, sz));
      CK(cuMemRelease(h));
      CK(cuMemcpyDtoH(hb.data(), v2 + 4 * MB, 4096));
      printf("after unmapping view 1 and releasing the handle, view 2 still reads: %s\n", hb[0] == 0x11111111u ? "ok" : "WRONG");
      CK(cuMemUnmap(v2, sz));
    }
    // cost of an extra view over p50 of 8, and of views of handles of other sizes
    for (size_t mb : {2, 64, 256}) {
      CUmemGenericAllocationHandle g;
      CK(cuMemCreate(&g, mb * MB, &dprop, 0));
      CK(cuMemMap(va, mb * MB, 0, g, 0));
      CK(cuMemSetAccess(va, mb * MB, &dacc, 1));
      std::vector<double> vm, vs, vu;
      for (int i = 0; i < 8; i++) {
        CUdeviceptr w = va + 1024 * MB + (size_t)i * 512 * MB;
        double t0 = now_us();
        CK(cuMemMap(w, mb * MB, 0, g, 0));
        vm.push_back(now_us() - t0);
        t0 = now_us();
        CK(cuMemSetAccess(w, mb * MB, &dacc, 1));
        vs.push_back(now_us() - t0);
      }
      for (int i = 0; i < 8; i++) {
        double t0 = now_us();
        CK(cuMemUnmap(va + 1024 * MB + (size_t)i * 512 * MB, mb * MB));
        vu.push_back(now_us() - t0);
      }
      CK(cuMemUnmap(va, mb * MB));
      CK(cuMemRelease(g));
      printf("extra view of a %zu MiB handle: map %.1f, set_access %.1f, unmap %.1f us (p50 of 8)\n", mb, p50(vm), p50(vs), p50(vu));
    }
    // a view stitched from the tail of one handle and the head of another
    {
      CUmemGenericAllocationHandle h1, h2;
      CK(cuMemCreate(&h1, 64 * MB, &dprop, 0));
      CK(cuMemCreate(&h2, 64 * MB, &dprop, 0));
      CUdeviceptr a1 = va, a2 = va + 256 * MB, st = va + 512 * MB;
      CK(cuMemMap(a1, 64 * MB, 0, h1, 0));
      CK(cuMemMap(a2, 64 * MB, 0, h2, 0));
      CK(cuMemSetAccess(a1, 64 * MB, &dacc, 1));
      CK(cuMemSetAccess(a2, 64 * MB, &dacc, 1));
      CK(cuMemMap(st, 64 * MB, 0, h1, 0));
      CK(cuMemMap(st + 64 * MB, 64 * MB, 0, h2, 0));
      CK(cuMemSetAccess(st, 128 * MB, &dacc, 1));
      CK(cuMemsetD32(st + 40 * MB, 0x33333333u, (48 * MB) / 4));  // tail of h1 + head of h2
      CK(cuCtxSynchronize());
      std::vector<unsigned> hb(4);
      CK(cuMemcpyDtoH(hb.data(), a1 + 63 * MB, 16));
      bool x = hb[0] == 0x33333333u;
      CK(cuMemcpyDtoH(hb.data(), a2 + 10 * MB, 16));
      bool y = hb[0] == 0x33333333u;
      printf("one memset over a stitched view (tail of handle 1 + head of handle 2) lands in both originals: %s\n", x && y ? "yes" : "NO");
      CK(cuMemUnmap(st, 128 * MB));
      CK(cuMemUnmap(a1, 64 * MB));
      CK(cuMemUnmap(a2, 64 * MB));
      CK(cuMemRelease(h1));
      CK(cuMemRelease(h2));
    }
  }

  // ---- B. host pages through the virtual-memory API ------------------------------------------
  printf("== B. cuMemCreate(CU_MEM_LOCATION_TYPE_HOST)\n");
  {
    CUmemAllocationProp hprop = {};
    hprop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    hprop.location.type = CU_MEM_LOCATION_TYPE_HOST;
    hprop.location.id = 0;
    size_t gmin = 0, grec = 0;
    CK(cuMemGetAllocationGranularity(&gmin, &hprop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CK(cuMemGetAllocationGranularity(&grec, &hprop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    printf("host granularity: minimum %zu, recommended %zu\n", gmin, grec);
    int numa_id = -1;
    CK(cuDeviceGetAttribute(&numa_id, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev));
    printf("device's host NUMA id %d\n", numa_id);
    CUmemAccessDesc hacc[2] = {};
    hacc[0] = dacc;
    hacc[1].location.type = CU_MEM_LOCATION_TYPE_HOST;
    hacc[1].location.id = 0;
    hacc[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUdeviceptr hva = va + 8192 * MB;
    for (size_t mb : {2, 64, 1024}) {
      std::vector<double> c, m, a, u, r;
      int reps = mb >= 1024 ? 2 : 6;
      bool ok = true;
      for (int i = 0; i < reps && ok; i++) {
        CUmemGenericAllocationHandle h;
        double t = now_us();
        ok = CK(cuMemCreate(&h, mb * MB, &hprop, 0));
        c.push_back(now_us() - t);
        if (!ok) break;
        t = now_us();
        CK(cuMemMap(hva, mb * MB, 0, h, 0));
        m.push_back(now_us() - t);
        t = now_us();
        CK(cuMemSetAccess(hva, mb * MB, hacc, 2));
        a.push_back(now_us() - t);
        t = now_us();
        CK(cuMemUnmap(hva, mb * MB));
        u.push_back(now_us() - t);
        t = now_us();
        CK(cuMemRelease(h));
        r.push_back(now_us() - t);
      }
      printf("host handle %4zu MiB: create %.1f map %.1f set_access(device+host) %.1f unmap %.1f release %.1f us (p50)\n", mb, p50(c), p50(m), p50(a), p50(u), p50(r));
    }
    // 64 MiB assembled from 32 host handles of 2 MiB, side by side
    size_t n = 64 * MB, page = 2 * MB;
    int np = n / page;
    std::vector<CUmemGenericAllocationHandle> hs(np);
    bool ok = true;
    for (auto& h : hs) ok = ok && CK(cuMemCreate(&h, page, &hprop, 0));
    for (int i = 0; ok && i < np; i++) ok = CK(cuMemMap(hva + i * page, page, 0, hs[i], 0));
    bool dev_only = ok && CK(cuMemSetAccess(hva, n, &dacc, 1));
    bool both = ok && CK(cuMemSetAccess(hva, n, hacc, 2));
    printf("access over 32 host handles: device only %s, device+host %s\n", dev_only ? "ok" : "refused", both ? "ok" : "refused");
    if (ok) {
      unsigned char* hp = (unsigned char*)(uintptr_t)hva;
      bool cpu = in_child([&] {
        for (size_t i = 0; i < n; i += 4096) hp[i] = (unsigned char)(i >> 12);
        return hp[4096 * 7] == 7;
      });
      printf("host writes and reads through the mapped pointer: %s\n", cpu ? "ok" : "FAULT");
      CUmemorytype mt = (CUmemorytype)0;
      CK(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, hva));
      printf("pointer memory type: %d (1 host, 2 device, 4 unified)\n", (int)mt);
      if (cpu) {
        for (size_t i = 0; i < n; i++) hp[i] = (unsigned char)(i * 131 + 7);
        CUdeviceptr d;
        CK(cuMemAlloc(&d, n));
        CK(cuMemcpyHtoDAsync(d, hp, n, s));
        CK(cuStreamSynchronize(s));
        std::vector<unsigned char> back(n);
        CK(cuMemcpyDtoH(back.data(), d, n));
        bool same = true;
        for (size_t i = 0; i < n; i += 997) same = same && back[i] == (unsigned char)(i * 131 + 7);
        printf("copy spanning 32 host handles to the device, checked: %s\n", same ? "ok" : "WRONG");
        bw("host-VMM 64 MiB (32 x 2 MiB handles)", hp, d, n, s);
        void* fresh = nullptr;
        double t = now_us();
        CK(cuMemHostAlloc(&fresh, n, CU_MEMHOSTALLOC_PORTABLE));
        double tpin = now_us() - t;
        memset(fresh, 1, n);
        printf("cuMemHostAlloc 64 MiB: %.1f us\n", tpin);
        bw("cuMemHostAlloc(PORTABLE) 64 MiB", fresh, d, n, s);
        void* pageable = malloc(n);
        memset(pageable, 1, n);
        bw("pageable malloc 64 MiB", pageable, d, n, s);
        free(pageable);
        CK(cuMemFreeHost(fresh));
        // move one host page: unmap it, map it at the end, access; data kept
        std::vector<double> mv;
        for (int i = 0; i < 8; i++) {
          double t0 = now_us();
          CK(cuMemUnmap(hva + i * page, page));
          CK(cuMemMap(hva + n + i * page, page, 0, hs[i], 0));
          CK(cuMemSetAccess(hva + n + i * page, page, hacc, 2));
          mv.push_back(now_us() - t0);
        }
        bool kept = in_child([&] { return hp[n + 3 * page + 5] == (unsigned char)((3 * page + 5) * 131 + 7); });
        printf("move a 2 MiB host page (unmap, map elsewhere, access): %.1f us p50; data kept and host-readable: %s\n", p50(mv), kept ? "yes" : "NO");
        for (int i = 0; i < 8; i++) CK(cuMemUnmap(hva + n + i * page, page));
        for (int i = 8; i < np; i++) CK(cuMemUnmap(hva + i * page, page));
        CK(cuMemFree(d));
      } else {
        for (int i = 0; i < np; i++) CK(cuMemUnmap(hva + i * page, page));
      }
    }
    for (auto& h : hs) if (ok) CK(cuMemRelease(h));
  }

  // ---- C. cuMemHostRegister --------------------------------------------------------------------
  printf("== C. cuMemHostRegister over touched memory\n");
  {
    CUdeviceptr d;
    CK(cuMemAlloc(&d, 64 * MB));
    for (size_t mb : {64, 1024}) {
      for (int th : {1, 4, 16}) {
        size_t n = mb * MB;
        char* p = (char*)mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        double t = now_us();
        touch(p, n, th);
        double tt = now_us() - t;
        t = now_us();
        bool ok = CK(cuMemHostRegister(p, n, CU_MEMHOSTREGISTER_PORTABLE));
        double tr = now_us() - t;
        t = now_us();
        if (ok) CK(cuMemHostUnregister(p));
        double tu = now_us() - t;
        munmap(p, n);
        printf("register %4zu MiB: touch with %2d threads %.1f us, register %.1f us, unregister %.1f us\n", mb, th, tt, tr, tu);
      }
      void* q = nullptr;
      double t = now_us();
      CK(cuMemHostAlloc(&q, mb * MB, CU_MEMHOSTALLOC_PORTABLE));
      double ta = now_us() - t;
      t = now_us();
      CK(cuMemFreeHost(q));
      printf("cuMemHostAlloc %4zu MiB: %.1f us, cuMemFreeHost %.1f us\n", mb, ta, now_us() - t);
    }
    // 2 MiB registrations, per call
    {
      size_t n = 64 * MB, page = 2 * MB;
      char* p = (char*)mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      touch(p, n, 4);
      std::vector<double> rv, uv;
      for (size_t o = 0; o < n; o += page) {
        double t = now_us();
        CK(cuMemHostRegister(p + o, page, CU_MEMHOSTREGISTER_PORTABLE));
        rv.push_back(now_us() - t);
      }
      printf("2 MiB registrations side by side: %.1f us p50 each\n", p50(rv));
      bw("64 MiB copy spanning 32 separate 2 MiB registrations", p, d, n, s);
      for (size_t o = 0; o < n; o += page) {
        double t = now_us();
        CK(cuMemHostUnregister(p + o));
        uv.push_back(now_us() - t);
      }
      printf("2 MiB unregistrations: %.1f us p50 each\n", p50(uv));
      CK(cuMemHostRegister(p, n, CU_MEMHOSTREGISTER_PORTABLE));
      bw("64 MiB copy from one 64 MiB registration", p, d, n, s);
      CK(cuMemHostUnregister(p));
      munmap(p, n);
    }
    CK(cuMemFree(d));
  }
  CK(cuMemAddressFree(va, VA));
  printf("done\n");
  return 0;
}
