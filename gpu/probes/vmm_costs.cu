// Driver probe for #11: what the virtual-memory calls cost on this GPU, per call, and whether
// one large physical handle can be mapped in 2 MiB pieces at offsets (so physical memory is
// created in few calls and still reused page by page). Prints one line per measurement.
// Build: nvcc -O2 -o vmm_costs vmm_costs.cu -lcuda
#include <cuda.h>
#include <chrono>
#include <cstdio>
#include <vector>
#include <algorithm>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s; cuGetErrorName(r_, &s); printf("FAIL %s -> %s (line %d)\n", #x, s, __LINE__); } } while (0)
static double now_us() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static double p50(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
static CUmemAllocationProp prop;
static CUmemAccessDesc acc;
static const size_t MB = 1 << 20;

static CUresult create(CUmemGenericAllocationHandle* h, size_t sz) { return cuMemCreate(h, sz, &prop, 0); }

int main() {
  CK(cuInit(0));
  CUdevice dev; CK(cuDeviceGet(&dev, 0));
  CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  prop = {}; prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  acc = {}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  size_t gran; CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  printf("granularity %zu\n", gran);
  CUdeviceptr va; size_t VA = 64ull << 30; CK(cuMemAddressReserve(&va, VA, 0, 0, 0));
  // 1. create / map / set_access / unmap / release per size.
  for (size_t mb : {2, 20, 64, 256, 1024, 4096}) {
    std::vector<double> c, m, a, u, r;
    int reps = mb >= 1024 ? 3 : 8;
    for (int i = 0; i < reps; i++) {
      CUmemGenericAllocationHandle h; double t = now_us(); CK(create(&h, mb * MB)); c.push_back(now_us() - t);
      t = now_us(); CK(cuMemMap(va, mb * MB, 0, h, 0)); m.push_back(now_us() - t);
      t = now_us(); CK(cuMemSetAccess(va, mb * MB, &acc, 1)); a.push_back(now_us() - t);
      t = now_us(); CK(cuMemUnmap(va, mb * MB)); u.push_back(now_us() - t);
      t = now_us(); CK(cuMemRelease(h)); r.push_back(now_us() - t);
    }
    printf("size %5zu MiB: create %.1f map %.1f set_access %.1f unmap %.1f release %.1f us (p50)\n", mb, p50(c), p50(m), p50(a), p50(u), p50(r));
  }
  for (size_t mb : {2, 20, 64, 256, 1024, 4096}) {
    std::vector<double> al, fr; int reps = mb >= 1024 ? 3 : 8;
    for (int i = 0; i < reps; i++) {
      CUdeviceptr p; double t = now_us(); CK(cuMemAlloc(&p, mb * MB)); al.push_back(now_us() - t);
      t = now_us(); CK(cuMemFree(p)); fr.push_back(now_us() - t);
    }
    printf("cuMemAlloc %5zu MiB: alloc %.1f free %.1f us (p50)\n", mb, p50(al), p50(fr));
  }
  // 2. one 1 GiB handle mapped as 512 pieces of 2 MiB at offsets, in reverse order.
  {
    size_t big = 1024 * MB, page = 2 * MB; int n = big / page;
    CUmemGenericAllocationHandle h; CK(create(&h, big));
    double t = now_us();
    int ok = 0;
    for (int i = 0; i < n; i++) { CUresult r = cuMemMap(va + (size_t)(n - 1 - i) * page, page, (size_t)i * page, h, 0); ok += r == CUDA_SUCCESS; if (r != CUDA_SUCCESS && i == 0) { const char* s; cuGetErrorName(r, &s); printf("offset map refused: %s\n", s); } }
    double tm = now_us() - t;
    printf("offset maps: %d/%d succeeded, %.2f us per map\n", ok, n, tm / n);
    t = now_us(); CK(cuMemSetAccess(va, big, &acc, 1)); double ta = now_us() - t;
    printf("set_access over 512 pieces of one handle: %.1f us in all (%.2f per piece)\n", ta, ta / n);
    // data check: memset pieces, read back
    CK(cuMemsetD32(va, 0xabcd1234, big / 4)); CK(cuCtxSynchronize());
    std::vector<unsigned> host(16); CK(cuMemcpyDtoH(host.data(), va + 100 * page + 4096, 64));
    printf("data check piece 100: %s\n", host[0] == 0xabcd1234 ? "ok" : "WRONG");
    // unmap one piece in the middle, then a range spanning 8 pieces, then remap at another place
    t = now_us(); CUresult r1 = cuMemUnmap(va + 10 * page, page); double tu1 = now_us() - t;
    t = now_us(); CUresult r8 = cuMemUnmap(va + 20 * page, 8 * page); double tu8 = now_us() - t;
    const char *s1, *s8; cuGetErrorName(r1, &s1); cuGetErrorName(r8, &s8);
    printf("unmap one piece: %s %.1f us; unmap a range of 8 pieces in one call: %s %.1f us\n", s1, tu1, s8, tu8);
    // remap piece (offset of page index n-1-10) elsewhere
    CUdeviceptr far = va + 40ull * 1024 * MB;
    t = now_us(); CK(cuMemMap(far, page, (size_t)(n - 1 - 10) * page, h, 0)); double trm = now_us() - t;
    t = now_us(); CK(cuMemSetAccess(far, page, &acc, 1)); double tra = now_us() - t;
    CK(cuMemcpyDtoH(host.data(), far + 4096, 64));
    printf("remap piece elsewhere: map %.1f set_access %.1f us, data %s\n", trm, tra, host[0] == 0xabcd1234 ? "kept" : "LOST");
    CK(cuMemUnmap(far, page));
    // remaining unmapping: per piece
    t = now_us(); int un = 0;
    for (int i = 0; i < n; i++) { size_t a = va + (size_t)i * page; if ((i >= 10 && i < 11) || (i >= 20 && i < 28)) continue; un += cuMemUnmap(a, page) == CUDA_SUCCESS; }
    printf("unmapped %d pieces, %.2f us each\n", un, (now_us() - t) / un);
    CK(cuMemRelease(h));
  }
  // 3. set_access over a range of 32 separate 2 MiB handles vs 32 pieces of one 64 MiB handle vs one 64 MiB mapping; map of a 64 MiB run of one handle in one call
  {
    size_t page = 2 * MB; int n = 32; std::vector<CUmemGenericAllocationHandle> hs(n);
    for (auto& h : hs) CK(create(&h, page));
    for (int i = 0; i < n; i++) CK(cuMemMap(va + i * page, page, 0, hs[i], 0));
    double t = now_us(); CK(cuMemSetAccess(va, n * page, &acc, 1)); double ta = now_us() - t;
    for (int i = 0; i < n; i++) CK(cuMemUnmap(va + i * page, page));
    for (auto& h : hs) CK(cuMemRelease(h));
    CUmemGenericAllocationHandle h; CK(create(&h, n * page));
    for (int i = 0; i < n; i++) CK(cuMemMap(va + i * page, page, (size_t)i * page, h, 0));
    t = now_us(); CK(cuMemSetAccess(va, n * page, &acc, 1)); double tb = now_us() - t;
    for (int i = 0; i < n; i++) CK(cuMemUnmap(va + i * page, page));
    // pieces mapped then access set per piece
    for (int i = 0; i < n; i++) CK(cuMemMap(va + i * page, page, (size_t)i * page, h, 0));
    t = now_us(); for (int i = 0; i < n; i++) CK(cuMemSetAccess(va + i * page, page, &acc, 1)); double tc = now_us() - t;
    for (int i = 0; i < n; i++) CK(cuMemUnmap(va + i * page, page));
    t = now_us(); CK(cuMemMap(va, n * page, 0, h, 0)); double tm = now_us() - t;
    t = now_us(); CK(cuMemSetAccess(va, n * page, &acc, 1)); double td = now_us() - t;
    CK(cuMemUnmap(va, n * page));
    // half of the handle mapped in one call at an offset
    t = now_us(); CK(cuMemMap(va, 16 * page, 16 * page, h, 0)); double th = now_us() - t;
    t = now_us(); CK(cuMemSetAccess(va, 16 * page, &acc, 1)); double tha = now_us() - t;
    CK(cuMemUnmap(va, 16 * page));
    CK(cuMemRelease(h));
    printf("set_access over 32 MiB-2 handles %.1f us; over 32 pieces of one handle %.1f; per piece x32 %.1f; one 64 MiB mapping: map %.1f set_access %.1f; half-handle run at offset: map %.1f set_access %.1f\n", ta, tb, tc, tm, td, th, tha);
  }
  // 4. set_access on a range containing already-accessible pieces plus new ones
  {
    size_t page = 2 * MB; CUmemGenericAllocationHandle h; CK(create(&h, 64 * page));
    std::vector<double> v;
    for (int i = 0; i < 64; i++) { CK(cuMemMap(va + i * page, page, (size_t)i * page, h, 0)); double t = now_us(); CK(cuMemSetAccess(va + i * page, page, &acc, 1)); v.push_back(now_us() - t); }
    printf("set_access per 2 MiB piece of a 128 MiB handle, mapped one by one: p50 %.1f us\n", p50(v));
    for (int i = 0; i < 64; i++) CK(cuMemUnmap(va + i * page, page));
    CK(cuMemRelease(h));
  }
  CK(cuMemAddressFree(va, VA));
  printf("done\n");
  return 0;
}
