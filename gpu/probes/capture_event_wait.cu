// Driver probe: inside a stream capture (thread-local mode), is cuStreamWaitEvent legal on an
// event that was never recorded, on one recorded outside the capture and complete, on one
// recorded outside and still pending, each with CU_EVENT_WAIT_DEFAULT and CU_EVENT_WAIT_EXTERNAL?
// And, after a capture that recorded an event: may the event be queried, waited on or waited
// for by another stream once the capture has ended, and does recording it again (outside a
// capture) make it legal again? And does synchronizing the capturing stream end the capture?
// One line per case: the call's result and the capture's end.
// cudarc's CachedPinned and CudaSlice wait on their events before every use, so these answers
// decide whether a cudarc buffer can be used inside a capture at all.
// Build: nvcc -O2 -o capture_event_wait capture_event_wait.cu -lcuda
#include <cuda.h>
#include <cstdio>

static const char* name(CUresult r) { const char* s = "?"; cuGetErrorName(r, &s); return s; }
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { printf("FAIL %s -> %s (line %d)\n", #x, name(r_), __LINE__); return 1; } } while (0)


int main() {
  CK(cuInit(0));
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CUstream cap, other;
  CK(cuStreamCreate(&cap, CU_STREAM_NON_BLOCKING));
  CK(cuStreamCreate(&other, CU_STREAM_NON_BLOCKING));
  CUdeviceptr buf, big;
  CK(cuMemAlloc(&buf, 1 << 20));
  CK(cuMemAlloc(&big, 1 << 30));
  const char* kinds[] = {"never recorded", "recorded outside, complete", "recorded outside, pending"};
  const char* flags[] = {"DEFAULT", "EXTERNAL"};
  for (int k = 0; k < 3; k++) {
    for (int f = 0; f < 2; f++) {
      CUevent ev;
      CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
      if (k >= 1) {
        if (k == 2) {
          // 64 memsets of 1 GiB on `other`: tens of milliseconds of queued work.
          for (int i = 0; i < 64; i++) CK(cuMemsetD8Async(big, (unsigned char)i, 1 << 30, other));
        }
        CK(cuEventRecord(ev, other));
        if (k == 1) CK(cuEventSynchronize(ev));
      }
      CK(cuStreamBeginCapture(cap, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
      CUresult w = cuStreamWaitEvent(cap, ev, f == 0 ? CU_EVENT_WAIT_DEFAULT : CU_EVENT_WAIT_EXTERNAL);
      CUresult m = cuMemsetD8Async(buf, 1, 1 << 20, cap);
      CUgraph g = nullptr;
      CUresult e = cuStreamEndCapture(cap, &g);
      printf("wait in capture on an event %-28s flags %-8s: wait %s, memset %s, end %s\n",
             kinds[k], flags[f], name(w), name(m), name(e));
      if (g) cuGraphDestroy(g);
      CK(cuCtxSynchronize());
      cuEventDestroy(ev);
    }
  }
  // A synchronization of the capturing stream (what a synchronous copy ends with).
  {
    CK(cuStreamBeginCapture(cap, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
    CUresult m = cuMemsetD8Async(buf, 3, 1 << 20, cap);
    CUresult sy = cuStreamSynchronize(cap);
    CUgraph g2 = nullptr;
    CUresult e2 = cuStreamEndCapture(cap, &g2);
    printf("synchronize the capturing stream: memset %s, synchronize %s, end %s\n", name(m),
           name(sy), name(e2));
    if (g2) cuGraphDestroy(g2);
  }
  // An event recorded inside a capture, after the capture ended.
  CUevent ev;
  CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  CK(cuStreamBeginCapture(cap, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
  CK(cuMemsetD8Async(buf, 2, 1 << 20, cap));
  CUresult rec = cuEventRecord(ev, cap);
  CUgraph g = nullptr;
  CUresult e = cuStreamEndCapture(cap, &g);
  printf("record in capture: %s, end %s\n", name(rec), name(e));
  printf("after the capture: query %s\n", name(cuEventQuery(ev)));
  printf("after the capture: synchronize %s\n", name(cuEventSynchronize(ev)));
  printf("after the capture: another stream waits %s\n", name(cuStreamWaitEvent(other, ev, 0)));
  CUgraphExec exec;
  CK(cuGraphInstantiate(&exec, g, 0));
  CK(cuGraphLaunch(exec, other));
  CK(cuStreamSynchronize(other));
  printf("after a launch of the graph: query %s\n", name(cuEventQuery(ev)));
  CUresult again = cuEventRecord(ev, other);
  printf("recorded again outside: %s; query %s\n", name(again), name(cuEventQuery(ev)));
  CK(cuStreamSynchronize(other));
  printf("recorded again outside, synchronized: query %s\n", name(cuEventQuery(ev)));
  cuGraphExecDestroy(exec);
  cuGraphDestroy(g);
  return 0;
}
