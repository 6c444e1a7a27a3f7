// Driver probe for #11: can one cuMemUnmap call unmap a run of separately created handles mapped
// side by side, what does that cost against one call per handle, and do the virtual-memory calls
// cost more while the GPU is busy with a kernel (as in a training step)? Also checks that the
// handles keep their bytes after a range unmap (mapped again elsewhere, read back).
// Build: nvcc -O2 -o vmm_range_unmap vmm_range_unmap.cu -lcuda
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <vector>
#include <algorithm>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s; cuGetErrorName(r_, &s); printf("FAIL %s -> %s (line %d)\n", #x, s, __LINE__); } } while (0)
static double now_us() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static double p50(std::vector<double> v) { std::sort(v.begin(), v.end()); return v.empty() ? 0 : v[v.size() / 2]; }
static const size_t MB = 1 << 20;
static const size_t PAGE = 2 * MB;

// Spins for about `cycles` clock cycles and writes one word, so the GPU stays busy on its own
// memory while the host makes virtual-memory calls.
__global__ void spin(long long cycles, int* out) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
  if (threadIdx.x == 0) *out = 1;
}

// Each 4-byte word of a page gets `seed + page index`.
__global__ void fill(unsigned* p, size_t words_per_page, unsigned seed) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t k = i; k < words_per_page * 64; k += stride) p[k] = seed + (unsigned)(k / words_per_page);
}

struct Run { double map_us, access_us, unmap_each_us, unmap_range_us; bool range_ok; };

int main() {
  CK(cuInit(0));
  CUdevice dev; CK(cuDeviceGet(&dev, 0));
  CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUmemAllocationProp prop = {}; prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  CUmemAccessDesc acc = {}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr va; const size_t VA = 8ull << 30; CK(cuMemAddressReserve(&va, VA, 0, 0, 0));
  int* flag; cudaMalloc(&flag, sizeof(int));
  cudaStream_t busy; cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking);
  int clock_khz = 0; cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);

  for (int loaded = 0; loaded < 2; loaded++) {
    for (int n : {8, 32, 128}) {
      std::vector<double> mp, ac, ue, ur; bool all_ok = true;
      for (int rep = 0; rep < 5; rep++) {
        if (loaded) spin<<<1, 32, 0, busy>>>((long long)clock_khz * 1000 /* ~1 s */, flag);
        std::vector<CUmemGenericAllocationHandle> hs(n);
        for (auto& h : hs) CK(cuMemCreate(&h, PAGE, &prop, 0));
        // one call per handle, access per handle (what the crate does today)
        double t = now_us();
        for (int i = 0; i < n; i++) CK(cuMemMap(va + i * PAGE, PAGE, 0, hs[i], 0));
        mp.push_back((now_us() - t) / n);
        t = now_us();
        for (int i = 0; i < n; i++) CK(cuMemSetAccess(va + i * PAGE, PAGE, &acc, 1));
        ac.push_back((now_us() - t) / n);
        t = now_us();
        for (int i = 0; i < n; i++) CK(cuMemUnmap(va + i * PAGE, PAGE));
        ue.push_back((now_us() - t) / n);
        // map again, then one unmap over the whole run
        for (int i = 0; i < n; i++) CK(cuMemMap(va + i * PAGE, PAGE, 0, hs[i], 0));
        CK(cuMemSetAccess(va, n * PAGE, &acc, 1));
        t = now_us();
        CUresult r = cuMemUnmap(va, n * PAGE);
        ur.push_back((now_us() - t) / n);
        if (r != CUDA_SUCCESS) {
          const char* s; cuGetErrorName(r, &s);
          if (rep == 0) printf("range unmap of %d handles refused: %s\n", n, s);
          all_ok = false;
          for (int i = 0; i < n; i++) cuMemUnmap(va + i * PAGE, PAGE);
        }
        for (auto& h : hs) CK(cuMemRelease(h));
        if (loaded) cudaStreamSynchronize(busy);
      }
      printf("%s n=%3d: per handle p50 us: map %.1f, set_access %.1f, unmap one by one %.1f, "
             "unmap in one call %.2f (%s)\n",
             loaded ? "GPU busy" : "GPU idle", n, p50(mp), p50(ac), p50(ue), p50(ur),
             all_ok ? "accepted" : "REFUSED");
    }
  }

  // Do the handles keep their bytes after a range unmap? Fill 64 pages, unmap them in one call,
  // map each at another place in reverse order, read every page's first and last word.
  {
    const int n = 64; std::vector<CUmemGenericAllocationHandle> hs(n);
    for (auto& h : hs) CK(cuMemCreate(&h, PAGE, &prop, 0));
    for (int i = 0; i < n; i++) CK(cuMemMap(va + i * PAGE, PAGE, 0, hs[i], 0));
    CK(cuMemSetAccess(va, n * PAGE, &acc, 1));
    size_t wpp = PAGE / 4;
    fill<<<256, 256>>>((unsigned*)va, wpp, 1000u);
    cudaDeviceSynchronize();
    CUresult r = cuMemUnmap(va, n * PAGE);
    const char* s; cuGetErrorName(r, &s);
    CUdeviceptr far = va + 4ull * 1024 * MB;
    for (int i = 0; i < n; i++) CK(cuMemMap(far + (size_t)(n - 1 - i) * PAGE, PAGE, 0, hs[i], 0));
    CK(cuMemSetAccess(far, n * PAGE, &acc, 1));
    int wrong = 0;
    for (int i = 0; i < n; i++) {
      unsigned w[2];
      CK(cuMemcpyDtoH(&w[0], far + (size_t)(n - 1 - i) * PAGE, 4));
      CK(cuMemcpyDtoH(&w[1], far + (size_t)(n - 1 - i) * PAGE + PAGE - 4, 4));
      if (w[0] != 1000u + i || w[1] != 1000u + i) wrong++;
    }
    // the old range must be gone: a fresh handle maps there again
    CUmemGenericAllocationHandle again; CK(cuMemCreate(&again, PAGE, &prop, 0));
    CUresult r2 = cuMemMap(va, PAGE, 0, again, 0);
    const char* s2; cuGetErrorName(r2, &s2);
    printf("range unmap of 64 filled pages: %s; pages read back at new places: %d of %d wrong; "
           "old range mappable again: %s\n", s, wrong, n, s2);
    if (r2 == CUDA_SUCCESS) CK(cuMemUnmap(va, PAGE));
    CK(cuMemRelease(again));
    for (int i = 0; i < n; i++) CK(cuMemUnmap(far + (size_t)(n - 1 - i) * PAGE, PAGE));
    for (auto& h : hs) CK(cuMemRelease(h));
  }
  CK(cuMemAddressFree(va, VA));
  printf("done\n");
  return 0;
}
