// Driver probe for graph capture safety: while one thread captures a stream in global mode
// (cudarc's and PyTorch's default), may another thread query or wait on an event that was
// recorded outside the capture, on a stream that is not capturing, without invalidating the
// capture? Once in the thread's default capture mode and once after exchanging it to relaxed
// (cuThreadExchangeStreamCaptureMode), as the crate's backend does around allocations. Also
// cuStreamQuery of a non-capturing stream, and, as a control that must invalidate, cuMemAlloc
// in the default mode. One line per case: the call's result and the capture's end result. Then
// the cost the exchange adds to a query (no capture underway): ns per cuEventQuery of a completed
// event, alone and between two exchanges, median of 5 rounds of 100,000.
// Build: nvcc -O2 -o capture_queries capture_queries.cu -lcuda -lpthread
#include <cuda.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <vector>
#include <thread>

static const char* name(CUresult r) { const char* s = "?"; cuGetErrorName(r, &s); return s; }
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { printf("FAIL %s -> %s (line %d)\n", #x, name(r_), __LINE__); return 1; } } while (0)

static CUcontext ctx;

enum Case { EVENT_QUERY, EVENT_SYNC, STREAM_QUERY, MEM_ALLOC };
static const char* case_name[] = {"cuEventQuery", "cuEventSynchronize", "cuStreamQuery", "cuMemAlloc (control)"};

// One trial: thread A begins a global capture on `cap`, enqueues a memset into the capture and
// waits; this thread makes the call; thread A then ends the capture. Returns 0 on success.
static int trial(Case c, bool relaxed, CUstream cap, CUstream other, CUevent ev, CUdeviceptr buf) {
  std::atomic<int> phase{0};
  CUresult begin = CUDA_SUCCESS, end = CUDA_SUCCESS, node = CUDA_SUCCESS;
  CUgraph graph = nullptr;
  std::thread a([&] {
    cuCtxSetCurrent(ctx);
    begin = cuStreamBeginCapture(cap, CU_STREAM_CAPTURE_MODE_GLOBAL);
    node = cuMemsetD8Async(buf, 1, 1 << 20, cap);
    phase = 1;
    while (phase.load() != 2) std::this_thread::yield();
    end = cuStreamEndCapture(cap, &graph);
  });
  while (phase.load() != 1) std::this_thread::yield();
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  if (relaxed) cuThreadExchangeStreamCaptureMode(&mode);
  CUresult call = CUDA_SUCCESS;
  CUdeviceptr extra = 0;
  switch (c) {
    case EVENT_QUERY: call = cuEventQuery(ev); break;
    case EVENT_SYNC: call = cuEventSynchronize(ev); break;
    case STREAM_QUERY: call = cuStreamQuery(other); break;
    case MEM_ALLOC: call = cuMemAlloc(&extra, 1 << 20); break;
  }
  if (relaxed) cuThreadExchangeStreamCaptureMode(&mode);
  phase = 2;
  a.join();
  if (extra) cuMemFree(extra);
  if (graph) cuGraphDestroy(graph);
  printf("%-22s mode %-7s: call %-40s begin %s, node %s, end capture %s\n", case_name[c],
         relaxed ? "relaxed" : "default", name(call), name(begin), name(node), name(end));
  return 0;
}

int main() {
  CK(cuInit(0));
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CUstream cap, other;
  CK(cuStreamCreate(&cap, CU_STREAM_NON_BLOCKING));
  CK(cuStreamCreate(&other, CU_STREAM_NON_BLOCKING));
  CUevent ev;
  CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  CUdeviceptr buf, src;
  CK(cuMemAlloc(&buf, 1 << 20));
  CK(cuMemAlloc(&src, 64 << 20));
  for (int relaxed = 0; relaxed < 2; relaxed++) {
    for (int c = EVENT_QUERY; c <= MEM_ALLOC; c++) {
      // An event recorded outside any capture, after work on the other stream.
      CK(cuMemsetD8Async(src, 2, 64 << 20, other));
      CK(cuEventRecord(ev, other));
      trial((Case)c, relaxed == 1, cap, other, ev, buf);
      CK(cuCtxSynchronize());
    }
  }
  CK(cuEventRecord(ev, other));
  CK(cuEventSynchronize(ev));
  for (int wrapped = 0; wrapped < 2; wrapped++) {
    std::vector<double> ns;
    for (int round = 0; round < 5; round++) {
      const int n = 100000;
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; i++) {
        CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        if (wrapped) cuThreadExchangeStreamCaptureMode(&mode);
        CUresult r = cuEventQuery(ev);
        if (wrapped) cuThreadExchangeStreamCaptureMode(&mode);
        if (r != CUDA_SUCCESS) { printf("query failed: %s\n", name(r)); return 1; }
      }
      ns.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n);
    }
    std::sort(ns.begin(), ns.end());
    printf("cuEventQuery of a completed event, %s: %.1f ns (min %.1f, max %.1f)\n",
           wrapped ? "between two mode exchanges" : "alone", ns[2], ns[0], ns[4]);
  }
  printf("done\n");
  return 0;
}
