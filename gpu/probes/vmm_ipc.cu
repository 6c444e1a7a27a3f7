// What sharing expandable pages between processes costs and needs (driver API, one device):
// which handle types cuMemCreate accepts (none, POSIX file descriptor, fabric), the cost of
// create / map + access / unmap / release per 2 MiB handle with and without a shareable type
// requested (alternating, p50 in µs), the cost of exporting a handle to a file descriptor, and
// whether a process may take a descriptor of its parent or child with pidfd_getfd (Yama's
// ptrace scope decides).
//
//   nvcc -O2 -o vmm_ipc gpu/probes/vmm_ipc.cu -lcuda && ./vmm_ipc
#include <cuda.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

static void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) {
    const char* s = nullptr;
    cuGetErrorString(r, &s);
    std::printf("FAIL %s: %s\n", what, s ? s : "?");
    std::exit(1);
  }
}

static double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

static double p50(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static CUmemAllocationProp prop_of(CUmemAllocationHandleType t) {
  CUmemAllocationProp p = {};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  p.requestedHandleTypes = t;
  return p;
}

int main() {
  check(cuInit(0), "cuInit");
  CUdevice dev;
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  CUcontext ctx;
  check(cuDevicePrimaryCtxRetain(&ctx, dev), "retain");
  check(cuCtxSetCurrent(ctx), "set current");
  const size_t page = 2u << 20;
  struct Kind {
    const char* name;
    CUmemAllocationHandleType t;
  } kinds[] = {{"none", CU_MEM_HANDLE_TYPE_NONE},
               {"posix_fd", CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR},
               {"fabric", CU_MEM_HANDLE_TYPE_FABRIC}};
  bool ok[3] = {false, false, false};
  for (int k = 0; k < 3; ++k) {
    auto p = prop_of(kinds[k].t);
    CUmemGenericAllocationHandle h = 0;
    CUresult r = cuMemCreate(&h, page, &p, 0);
    const char* s = nullptr;
    cuGetErrorString(r, &s);
    std::printf("create with handle type %s: %s\n", kinds[k].name, s ? s : "?");
    if (r == CUDA_SUCCESS) {
      ok[k] = true;
      cuMemRelease(h);
    }
  }
  const int n = 1000;
  CUdeviceptr va = 0;
  check(cuMemAddressReserve(&va, page * 2 * n, 0, 0, 0), "reserve");
  CUmemAccessDesc acc = {};
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = 0;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  std::vector<double> create[2], map[2], unmap[2], release[2], exp;
  std::vector<CUmemGenericAllocationHandle> hs[2];
  // Alternate the two kinds so drift in the driver's state hits both alike.
  for (int i = 0; i < n; ++i) {
    for (int k = 0; k < 2; ++k) {
      if (!ok[k]) continue;
      auto p = prop_of(kinds[k].t);
      CUmemGenericAllocationHandle h = 0;
      double t0 = now_us();
      check(cuMemCreate(&h, page, &p, 0), "create");
      double t1 = now_us();
      CUdeviceptr at = va + (2 * i + k) * page;
      check(cuMemMap(at, page, 0, h, 0), "map");
      check(cuMemSetAccess(at, page, &acc, 1), "access");
      double t2 = now_us();
      create[k].push_back(t1 - t0);
      map[k].push_back(t2 - t1);
      hs[k].push_back(h);
    }
  }
  if (ok[1]) {
    for (int i = 0; i < n; ++i) {
      int fd = -1;
      double t0 = now_us();
      check(cuMemExportToShareableHandle(&fd, hs[1][i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                         0),
            "export");
      exp.push_back(now_us() - t0);
      close(fd);
    }
  }
  for (int i = 0; i < n; ++i) {
    for (int k = 0; k < 2; ++k) {
      if (!ok[k]) continue;
      CUdeviceptr at = va + (2 * i + k) * page;
      double t0 = now_us();
      check(cuMemUnmap(at, page), "unmap");
      double t1 = now_us();
      check(cuMemRelease(hs[k][i]), "release");
      unmap[k].push_back(t1 - t0);
      release[k].push_back(now_us() - t1);
    }
  }
  for (int k = 0; k < 2; ++k) {
    if (!ok[k]) continue;
    std::printf("2 MiB handle, type %-8s p50 us: create %.1f, map+access %.1f, unmap %.1f, "
                "release %.1f (n=%d)\n",
                kinds[k].name, p50(create[k]), p50(map[k]), p50(unmap[k]), p50(release[k]), n);
  }
  if (!exp.empty()) std::printf("export to a POSIX fd p50 us: %.1f\n", p50(exp));
  // pidfd_getfd between parent and child, both ways.
  int pipefd[2];
  if (pipe(pipefd) != 0) return 1;
  pid_t parent = getpid();
  std::fflush(stdout);  // or the child prints the parent's buffered lines again
  pid_t child = fork();
  if (child == 0) {
    long pfd = syscall(SYS_pidfd_open, parent, 0);
    long got = pfd < 0 ? -1 : syscall(SYS_pidfd_getfd, pfd, pipefd[0], 0);
    std::printf("child takes a parent's fd: %s\n", got >= 0 ? "yes" : std::strerror(errno));
    std::fflush(stdout);
    sleep(1);
    _exit(0);
  }
  usleep(200000);
  long cfd = syscall(SYS_pidfd_open, child, 0);
  long got = cfd < 0 ? -1 : syscall(SYS_pidfd_getfd, cfd, 1, 0);
  std::printf("parent takes a child's fd: %s\n", got >= 0 ? "yes" : std::strerror(errno));
  waitpid(child, nullptr, 0);
  return 0;
}
