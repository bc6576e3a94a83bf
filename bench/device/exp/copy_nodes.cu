// Run by hand on the lent H200 host: nvcc -O2 -arch=sm_90 bench/device/exp/copy_nodes.cu -lcuda -o cn && ./cn
// Issue 4 experiment: what one copy node costs inside CUDA graph replay, by copy style, and what the memop path's
// step (3 copies in, done := 0, ready := k, wait done >= 1, 1 copy out) costs with each style. Cases 7-12: a packed
// input copy, a zero-copy y read by an SM kernel, device staging. Styles: "ce" = cuMemcpyAsync between device memory
// and pinned host memory (a copy-engine node); "dtod" = cuMemcpyDtoDAsync with the pinned block's mapped device
// address (does the driver run it as an SM copy?). Prints one JSON line per case.
#include <cuda.h>
#include <cuda_runtime.h>
#include <atomic>
#include <thread>
#include <vector>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#define CK(x) do { auto e_ = (x); if ((int)e_) { fprintf(stderr, "%s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)e_); exit(1); } } while (0)

__global__ void noop() {}
// what a torch elementwise op (or kernelio) would do: read y through the mapped address, add into a device partial
__global__ void add_from(const unsigned short *y, float *part, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) part[i] += __uint_as_float((unsigned)y[i] << 16);
}
// one kernel writing the payload through the mapped address (the kernel path's publish, minus the residency mask)
__global__ void publish(const uint4 *x, uint4 *mx, int nx, const uint4 *idw, uint4 *midw, int nidw) {
  for (int i = threadIdx.x; i < nx; i += blockDim.x) mx[i] = x[i];
  for (int i = threadIdx.x; i < nidw; i += blockDim.x) midw[i] = idw[i];
}

struct Bufs { char *dx, *did, *dw, *dy, *dstage; float *dpart; char *hx, *hid, *hw, *hy; CUdeviceptr mx, mid, mw, my, mdone, mready;
              volatile unsigned long long *done, *ready; };
static size_t NX = 4096, NID = 32, NW = 32, NY = 4096;

static void cp(CUdeviceptr dst, CUdeviceptr src, size_t n, bool dtod, CUstream s) {
  if (dtod) CK(cuMemcpyDtoDAsync(dst, src, n, s)); else CK(cuMemcpyAsync(dst, src, n, s));
}
// kind: 0 noop, 1 one copy in, 2 one copy out, 3 dev->dev, 4 floor (done:=0, ready, wait), 5 memop step, 6 4 copies only
static void step(int kind, bool dtod, Bufs &b, CUstream s, int i) {
  switch (kind) {
    case 0: noop<<<1, 1, 0, s>>>(); break;
    case 1: cp(b.mx, (CUdeviceptr)b.dx, NX, dtod, s); break;
    case 2: cp((CUdeviceptr)b.dy, b.my, NY, dtod, s); break;
    case 3: cp((CUdeviceptr)b.dy, (CUdeviceptr)b.dx, NX, dtod, s); break;
    case 6:
      cp(b.mx, (CUdeviceptr)b.dx, NX, dtod, s); cp(b.mid, (CUdeviceptr)b.did, NID, dtod, s);
      cp(b.mw, (CUdeviceptr)b.dw, NW, dtod, s); cp((CUdeviceptr)b.dy, b.my, NY, dtod, s); break;
    case 4: case 5:
      if (kind == 5) { cp(b.mx, (CUdeviceptr)b.dx, NX, dtod, s); cp(b.mid, (CUdeviceptr)b.did, NID, dtod, s);
                       cp(b.mw, (CUdeviceptr)b.dw, NW, dtod, s); }
      CK(cuStreamWriteValue64(s, b.mdone, 0, 0));
      CK(cuStreamWriteValue64(s, b.mready, (cuuint64_t)(i + 1), 0));
      CK(cuStreamWaitValue64(s, b.mdone, 1, CU_STREAM_WAIT_VALUE_GEQ));
      if (kind == 5) cp((CUdeviceptr)b.dy, b.my, NY, dtod, s);
      break;
    case 7: case 8: case 9: case 10: case 11: case 12:
      // 7: one packed copy in (x|ids|w contiguous on the device) + memops + copy out
      // 8: one packed copy in + memops + SM kernel adding mapped y into a device partial (no copy out)
      // 9: 3 dev->dev copies into a device staging block + one copy in + memops + copy out
      // 10: publish kernel + memops + SM add kernel (kernel path with the memop wait)
      // 11: one copy in + one copy out, no memops (chain cost); 12: 3 dev->dev into staging + 1 copy in, no memops
      if (kind == 9 || kind == 12) { cp((CUdeviceptr)b.dstage, (CUdeviceptr)b.dx, NX, false, s);
                     cp((CUdeviceptr)b.dstage + NX, (CUdeviceptr)b.did, NID, false, s);
                     cp((CUdeviceptr)b.dstage + NX + NID, (CUdeviceptr)b.dw, NW, false, s); }
      if (kind == 10) publish<<<1, 256, 0, s>>>((const uint4 *)b.dstage, (uint4 *)b.mx, NX / 16, (const uint4 *)(b.dstage + NX), (uint4 *)b.mid, (NID + NW) / 16);
      else cp(b.mx, (CUdeviceptr)b.dstage, NX + NID + NW, dtod, s);
      if (kind != 11 && kind != 12) {
        CK(cuStreamWriteValue64(s, b.mdone, 0, 0));
        CK(cuStreamWriteValue64(s, b.mready, (cuuint64_t)(i + 1), 0));
        CK(cuStreamWaitValue64(s, b.mdone, 1, CU_STREAM_WAIT_VALUE_GEQ));
      }
      if (kind == 12) break;
      if (kind == 8 || kind == 10) add_from<<<1, 256, 0, s>>>((const unsigned short *)b.my, b.dpart, (int)(NY / 2));
      else cp((CUdeviceptr)b.dy, b.my, NY, dtod, s);
      break;
  }
}

int main() {
  CK(cudaSetDevice(0)); CK(cudaFree(0));
  Bufs b{};
  CK(cudaMalloc(&b.dx, NX)); CK(cudaMalloc(&b.did, NID)); CK(cudaMalloc(&b.dw, NW)); CK(cudaMalloc(&b.dy, NY));
  CK(cudaMalloc(&b.dstage, 1 << 16)); CK(cudaMalloc(&b.dpart, 1 << 16));
  char *blk; CK(cudaHostAlloc(&blk, 1 << 16, cudaHostAllocMapped));
  b.hx = blk; b.hid = blk + 8192; b.hw = blk + 8192 + 256; b.hy = blk + 16384;
  b.done = (volatile unsigned long long *)(blk + 32768); b.ready = b.done + 8;
  auto dp = [](void *h) { void *d; CK(cudaHostGetDevicePointer(&d, h, 0)); return (CUdeviceptr)d; };
  b.mx = dp(b.hx); b.mid = dp(b.hid); b.mw = dp(b.hw); b.my = dp(b.hy);
  b.mdone = dp((void *)b.done); b.mready = dp((void *)b.ready);
  *b.done = 1; *b.ready = 0;
  std::atomic<bool> stop{false};
  std::thread ans([&] { unsigned long long last = 0; while (!stop.load(std::memory_order_relaxed)) {
      unsigned long long v = *b.ready; if (v != last) { last = v; std::atomic_thread_fence(std::memory_order_seq_cst); *b.done = 1; } } });
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int L = 32, R = 300, REPS = 5;
  const char *names[] = {"noop kernel", "copy in 4 KB (dev->pinned)", "copy out 4 KB (pinned->dev)", "dev->dev 4 KB",
                         "floor: done:=0, ready, wait", "memop step (3 in, memops, 1 out)", "4 copies, no memops",
                         "packed: 1 in, memops, 1 out", "packed: 1 in, memops, SM add of mapped y",
                         "3 dev->dev to staging, 1 in, memops, 1 out", "publish kernel, memops, SM add of mapped y",
                         "1 in + 1 out, no memops", "3 dev->dev to staging + 1 in, no memops"};
  for (int dtod = 0; dtod < 2; ++dtod)
    for (int kind = 0; kind < 13; ++kind) {
      if (dtod && kind != 5 && kind != 7) continue;
      // fresh data so a copy that does not land is seen
      std::vector<char> px(NX); for (size_t j = 0; j < NX; ++j) px[j] = (char)(rand());
      CK(cudaMemcpy(b.dx, px.data(), NX, cudaMemcpyHostToDevice)); memset(b.hx, 0, NX);
      CK(cudaMemcpy(b.dstage, px.data(), NX, cudaMemcpyHostToDevice));
      memset(b.hy, 0, NY); for (size_t j = 0; j < NY; ++j) b.hy[j] = (char)(j * 7 + kind);
      cudaGraph_t g; cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < L; ++i) step(kind, dtod, b, s, i);
      CK(cudaStreamEndCapture(s, &g));
      size_t n = 0; CK(cuGraphGetNodes((CUgraph)g, nullptr, &n)); std::vector<CUgraphNode> nodes(n);
      CK(cuGraphGetNodes((CUgraph)g, nodes.data(), &n)); int types[16] = {0};
      for (auto nd : nodes) { CUgraphNodeType t; CK(cuGraphNodeGetType(nd, &t)); types[(int)t & 15]++; }
      CK(cudaGraphInstantiate(&ge, g, 0));
      for (int w = 0; w < 20; ++w) CK(cudaGraphLaunch(ge, s));
      CK(cudaStreamSynchronize(s));
      std::vector<double> us;
      cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
      for (int r = 0; r < REPS; ++r) {
        CK(cudaEventRecord(e0, s)); for (int k = 0; k < R; ++k) CK(cudaGraphLaunch(ge, s));
        CK(cudaEventRecord(e1, s)); CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); us.push_back(ms * 1e3 / (R * L));
      }
      std::sort(us.begin(), us.end());
      bool ok = true;
      if (kind == 1 || kind >= 5) ok = ok && !memcmp(b.hx, px.data(), NX);
      if (kind == 2 || kind == 5 || kind == 6 || kind == 7 || kind == 9 || kind == 11) { std::vector<char> yy(NY); CK(cudaMemcpy(yy.data(), b.dy, NY, cudaMemcpyDeviceToHost));
                                                 ok = ok && !memcmp(yy.data(), b.hy, NY); }
      printf("{\"case\": \"%s\", \"style\": \"%s\", \"us_per_step_median\": %.3f, \"min\": %.3f, \"max\": %.3f, "
             "\"nodes_kernel\": %d, \"nodes_memcpy\": %d, \"nodes_memop\": %d, \"data_ok\": %s}\n",
             names[kind], dtod ? "dtod" : "ce", us[REPS / 2], us[0], us[REPS - 1], types[0] / L, types[1] / L,
             types[12] / L, ok ? "true" : "false");
      fflush(stdout);
      CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
    }
  stop = true; ans.join();
  return 0;
}
