// Driver probe for #16: is memory pinned by cuMemHostRegister as fast to copy from as memory
// from cuMemHostAlloc, and what does each cost? vmm_alias_host.cu found registration 4-6x
// cheaper than cuMemHostAlloc but htod 46.5 against 54.3 GB/s from 4 KiB pages; this one compares,
// per size (2 MiB to 1 GiB), cuMemHostAlloc(PORTABLE) against registration over anonymous memory with 4 KiB pages
// (MADV_NOHUGEPAGE) and with transparent huge pages (MADV_HUGEPAGE, 2 MiB aligned), touched by
// 1 or 8 threads. Copies are 64 MiB (or the size, if smaller), checked, 10 each way.
// Build: nvcc -O2 -o pin_register pin_register.cu -lcuda -lpthread
#include <cuda.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

static bool ck(CUresult r, const char* what, int line) {
  if (r == CUDA_SUCCESS) return true;
  const char* s = "?";
  cuGetErrorName(r, &s);
  printf("FAIL %s -> %s (line %d)\n", what, s, line);
  return false;
}
#define CK(x) ck((x), #x, __LINE__)
static double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static const size_t MB = 1 << 20;

static void touch(char* p, size_t n, int threads) {
  std::vector<std::thread> ts;
  size_t chunk = (n / threads + 4095) / 4096 * 4096;
  for (int t = 0; t < threads; t++)
    ts.emplace_back([=] {
      size_t lo = std::min(n, t * chunk), hi = std::min(n, lo + chunk);
      for (size_t i = lo; i < hi; i += 4096) p[i] = 1;
    });
  for (auto& t : ts) t.join();
}

// htod / dtoh GB/s over `n` bytes from `host` (10 copies each way), with a content check.
static void bw(const char* label, double pin_us, char* host, size_t n, CUdeviceptr dev, CUstream s) {
  size_t c = std::min(n, 64 * MB);
  for (size_t i = 0; i < c; i += 4093) host[i] = (char)(i * 7 + 3);
  bool ok = CK(cuMemcpyHtoDAsync(dev, host, c, s)) && CK(cuStreamSynchronize(s));
  double t = now_us();
  for (int i = 0; i < 10; i++) ok = ok && CK(cuMemcpyHtoDAsync(dev, host, c, s));
  ok = ok && CK(cuStreamSynchronize(s));
  double h = 10.0 * c / (now_us() - t) / 1e3;
  memset(host, 0, c);
  t = now_us();
  for (int i = 0; i < 10; i++) ok = ok && CK(cuMemcpyDtoHAsync(host, dev, c, s));
  ok = ok && CK(cuStreamSynchronize(s));
  double d = 10.0 * c / (now_us() - t) / 1e3;
  bool same = true;
  for (size_t i = 0; i < c; i += 4093) same = same && host[i] == (char)(i * 7 + 3);
  printf("%-44s pin %9.1f us  htod %6.2f GB/s  dtoh %6.2f GB/s  %s\n", label, pin_us, h, d, ok && same ? "checked" : "WRONG");
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
  CUdeviceptr d;
  CK(cuMemAlloc(&d, 64 * MB));
  FILE* f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  char buf[256] = "?";
  if (f) { if (!fgets(buf, sizeof buf, f)) buf[0] = 0; fclose(f); }
  printf("transparent_hugepage/enabled: %s", buf);
  for (size_t mb : {2, 4, 8, 16, 32, 64, 1024}) {
    size_t n = mb * MB;
    {
      void* p = nullptr;
      double t = now_us();
      CK(cuMemHostAlloc(&p, n, CU_MEMHOSTALLOC_PORTABLE));
      double tp = now_us() - t;
      char label[64];
      snprintf(label, sizeof label, "%4zu MiB cuMemHostAlloc", mb);
      bw(label, tp, (char*)p, n, d, s);
      t = now_us();
      CK(cuMemFreeHost(p));
      printf("%4zu MiB cuMemFreeHost %.1f us\n", mb, now_us() - t);
    }
    for (int huge : {0, 1}) {
      for (int threads : {1, 8}) {
        size_t al = 2 * MB;
        char* raw = (char*)mmap(nullptr, n + al, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        char* p = (char*)(((uintptr_t)raw + al - 1) / al * al);
        madvise(p, n, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
        double t = now_us();
        touch(p, n, threads);
        double tt = now_us() - t;
        t = now_us();
        bool ok = CK(cuMemHostRegister(p, n, CU_MEMHOSTREGISTER_PORTABLE));
        double tr = now_us() - t;
        char label[64];
        snprintf(label, sizeof label, "%4zu MiB register, %s, %d touch threads", mb, huge ? "THP" : "4 KiB", threads);
        if (ok) bw(label, tt + tr, p, n, d, s);
        t = now_us();
        if (ok) CK(cuMemHostUnregister(p));
        double tu = now_us() - t;
        munmap(raw, n + al);
        printf("%4zu MiB   (touch %.1f + register %.1f us; unregister %.1f us)\n", mb, tt, tr, tu);
      }
    }
  }
  CK(cuMemFree(d));
  printf("done\n");
  return 0;
}
