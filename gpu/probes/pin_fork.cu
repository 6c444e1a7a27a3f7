// Driver probe for #16: what fork() does to pinned host memory, for each way the pinned cache
// pins a slab, and for host pages (cuMemCreate with CU_MEM_LOCATION_TYPE_HOST, 2 MiB handles
// mapped side by side with access for the device and the host: PinnedAllocator's default). Registered memory is ordinary anonymous memory of the process: after a fork its
// pages are shared copy-on-write with the child unless the kernel copies pinned pages early, and
// a parent write that broke the sharing would leave the GPU copying from the old page (stale
// data, silently). cuMemHostAlloc memory is the driver's own mapping. For each of
//   cuMemHostAlloc(PORTABLE), register over anonymous memory, the same with MADV_DONTFORK,
// the probe forks a child that sleeps while the parent rewrites the buffer and copies it to the
// device and back (must read the new data), then lets the child read the buffer in a grandchild
// (a fault there is reported, not fatal). Prints one line per method.
// Build: nvcc -O2 -o pin_fork pin_fork.cu -lcuda
#include <cuda.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

static bool ck(CUresult r, const char* what, int line) {
  if (r == CUDA_SUCCESS) return true;
  const char* s = "?";
  cuGetErrorName(r, &s);
  printf("FAIL %s -> %s (line %d)\n", what, s, line);
  return false;
}
#define CK(x) ck((x), #x, __LINE__)
static const size_t MB = 1 << 20;

int main() {
  if (!CK(cuInit(0))) return 1;
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  size_t n = 64 * MB;
  CUdeviceptr d;
  CK(cuMemAlloc(&d, n));
  std::vector<unsigned char> back(n);
  const char* names[4] = {"cuMemHostAlloc(PORTABLE)", "register (anonymous, THP)", "register + MADV_DONTFORK",
                          "host pages (cuMemCreate HOST)"};
  const size_t page = 2 * MB;
  std::vector<CUmemGenericAllocationHandle> handles(n / page);
  CUdeviceptr va = 0;
  for (int m = 0; m < 4; m++) {
    unsigned char* p = nullptr;
    void* raw = nullptr;
    if (m == 0) {
      CK(cuMemHostAlloc((void**)&p, n, CU_MEMHOSTALLOC_PORTABLE));
    } else if (m == 3) {
      CUmemAllocationProp prop = {};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
      CUmemAccessDesc acc[2] = {};
      acc[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      acc[0].location.id = 0;
      acc[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      acc[1].location.type = CU_MEM_LOCATION_TYPE_HOST;
      acc[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      if (!CK(cuMemAddressReserve(&va, n, 0, 0, 0))) continue;
      bool ok = true;
      for (size_t i = 0; ok && i < handles.size(); i++)
        ok = CK(cuMemCreate(&handles[i], page, &prop, 0)) && CK(cuMemMap(va + i * page, page, 0, handles[i], 0));
      if (!ok || !CK(cuMemSetAccess(va, n, acc, 2))) continue;
      p = (unsigned char*)(uintptr_t)va;
    } else {
      raw = mmap(nullptr, n + 2 * MB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      p = (unsigned char*)(((uintptr_t)raw + 2 * MB - 1) / (2 * MB) * (2 * MB));
      madvise(p, n, MADV_HUGEPAGE);
      if (m == 2) madvise(p, n, MADV_DONTFORK);
      memset(p, 1, n);
      CK(cuMemHostRegister(p, n, CU_MEMHOSTREGISTER_PORTABLE));
    }
    memset(p, 0x11, n);
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
      usleep(1500 * 1000);  // hold the shared pages while the parent writes and copies
      pid_t g = fork();
      if (g == 0) _exit(p[12345] == 0x11 ? 0 : 3);  // the child's view of the buffer
      int st = 0;
      waitpid(g, &st, 0);
      _exit(WIFEXITED(st) ? WEXITSTATUS(st) : 100 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0));
    }
    // Parent, while the child lives: rewrite, copy to the device and back, compare.
    for (size_t i = 0; i < n; i += 4096) p[i] = (unsigned char)(0x22 + (i >> 12));
    bool ok = CK(cuMemcpyHtoD(d, p, n));
    ok = ok && CK(cuMemcpyDtoH(back.data(), d, n));
    size_t stale = 0;
    for (size_t i = 0; i < n; i += 4096) stale += back[i] != (unsigned char)(0x22 + (i >> 12));
    // And the other way: device writes, host reads through the parent's mapping.
    ok = ok && CK(cuMemsetD8(d, 0x33, n)) && CK(cuMemcpyDtoH(p, d, n));
    size_t lost = 0;
    for (size_t i = 0; i < n; i += 4096) lost += p[i] != 0x33;
    int st = 0;
    waitpid(child, &st, 0);
    int code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    const char* cview = code == 0 ? "reads the pre-fork data" : code == 3 ? "reads other data" : code >= 100 ? "FAULTS" : "?";
    printf("%-28s parent after fork: htod %s (%zu of %zu pages stale), dtoh %s (%zu lost); child %s (code %d)\n",
           names[m], ok && stale == 0 ? "ok" : "STALE", stale, n / 4096, ok && lost == 0 ? "ok" : "LOST", lost, cview, code);
    if (m == 0) {
      CK(cuMemFreeHost(p));
    } else if (m == 3) {
      CK(cuMemUnmap(va, n));
      for (auto h : handles) CK(cuMemRelease(h));
      CK(cuMemAddressFree(va, n));
    } else {
      CK(cuMemHostUnregister(p));
      munmap(raw, n + 2 * MB);
    }
  }
  CK(cuMemFree(d));
  printf("done\n");
  return 0;
}
