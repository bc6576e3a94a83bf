// kernelio start-up probe on scratch pinned memory: proves the image loads and
// both kernels produce the exact bits, before any IO block or graph uses them.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "launcher.h"

namespace kernelio {
namespace {
constexpr int T_MAX = 8, H = 2048, K = 8, E = 16;

struct Rng {
  uint64_t s;
  uint32_t next() { return (uint32_t)((s = s * 6364136223846793005ull + 1442695040888963407ull) >> 33); }
  uint16_t bf16() {  // finite values of both signs over a wide range, and signed zeros
    const uint32_t r = next();
    if (r % 61 == 0) return (r & 2) ? 0x8000 : 0;
    return (uint16_t)(((r & 1) << 15) | ((0x70 + (r >> 1) % 32) << 7) | ((r >> 6) & 0x7F));
  }
};

float f32(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t bf16_rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct Scratch {  // the fake IO block in pinned, device-mapped host memory
  const gpusync_api* api;
  gpusync_device* dev;
  char* host = nullptr;
  uint64_t dptr = 0;
  size_t bytes = 0;
  Scratch(const gpusync_api* a, gpusync_device* d) : api(a), dev(d) {
    bytes = (256 + 4 * ((size_t)T_MAX * H * 2 + 64) + 4095) / 4096 * 4096;  // whole pages, as registered
    host = static_cast<char*>(std::aligned_alloc(4096, bytes));
    std::memset(host, 0, bytes);
    if (api->host_register(dev, host, bytes, &dptr)) {
      std::free(host);
      host = nullptr;
      throw Error(std::string("kernelio probe: registering scratch memory: ") + api->last_error());
    }
  }
  ~Scratch() {
    if (host) {
      api->host_unregister(dev, host);
      std::free(host);
    }
  }
  static constexpr size_t X = 256, IDS = X + T_MAX * H * 2, W = IDS + T_MAX * K * 4 + 64, Y = W + T_MAX * K * 4 + 64;
  volatile uint64_t& ready() { return *reinterpret_cast<volatile uint64_t*>(host); }
  volatile uint64_t& done() { return *reinterpret_cast<volatile uint64_t*>(host + 64); }
  template <class V>
  V* at(size_t off) { return reinterpret_cast<V*>(host + off); }
};

struct DevBuf {
  const gpusync_api* api;
  gpusync_device* dev;
  uint64_t p = 0;
  DevBuf(const gpusync_api* a, gpusync_device* d, size_t n) : api(a), dev(d) {
    if (api->mem_alloc(dev, n, &p)) throw Error(std::string("kernelio probe: ") + api->last_error());
  }
  ~DevBuf() { api->mem_free(dev, p); }
};
// combine's in-kernel wait (wait = 1) after a ringing step (done = 0, skip flag 0):
// it must still be spinning when the host stores y and then done = 1, and read
// that y; with nobody to release it, it must give up after its timeout, count
// it and leave out untouched. A wait that never ends is released by the probe
// (done := SHUTDOWN) so the probe itself stays bounded.
void probe_wait(const gpusync_api* api, gpusync_device* dev, KernelIO& kio, Scratch& sc, uint64_t dout, int64_t os,
                const std::vector<uint16_t>& out, Rng& rng, double timeout_s, std::string& stage) {
  std::vector<uint16_t> got(out.size());
  auto finish = [&](double limit, const char* what) {
    if (api->stream_sync(dev, nullptr, 0, limit) == 0) return;
    __atomic_store_n(const_cast<uint64_t*>(&sc.done()), CPUMOE_DONE_SHUTDOWN, __ATOMIC_RELEASE);
    api->stream_sync(dev, nullptr, 0, 2.0);
    throw Error(std::string(what) + ": the in-kernel wait did not end within " + std::to_string(limit) +
                " s (released with done := SHUTDOWN)");
  };
  auto fetch = [&] {
    if (api->memcpy_async(dev, (uint64_t)(uintptr_t)got.data(), dout, got.size() * 2, 0))
      throw Error(api->last_error());
    finish(timeout_s, "copy back");
  };
  stage = "combine waiting in the kernel, released by a host store of done";
  if (kio.poll_timeouts(true)) throw Error("poll-timeout count not 0 before the wait stages");
  sc.done() = 0;
  kio.combine(0, T_MAX, dout, os, false, true);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the kernel is spinning by now
  uint16_t* y = sc.at<uint16_t>(Scratch::Y);
  for (int i = 0; i < T_MAX * H; ++i) y[i] = rng.bf16();  // written after the launch: only a waiting kernel sees it
  __atomic_store_n(const_cast<uint64_t*>(&sc.done()), CPUMOE_DONE_COMPLETE, __ATOMIC_RELEASE);
  finish(timeout_s, "combine (wait)");
  fetch();
  for (int t = 0; t < T_MAX; ++t)
    if (std::memcmp(got.data() + t * os, y + t * H, H * 2))
      throw Error("row " + std::to_string(t) + " is not the y stored before done: the kernel did not wait");
  if (kio.poll_timeouts(true)) throw Error("a released wait was counted as a timeout");

  stage = "combine waiting in the kernel, nobody releasing it (timeout)";
  if (api->memcpy_async(dev, dout, (uint64_t)(uintptr_t)out.data(), out.size() * 2, 0)) throw Error(api->last_error());
  sc.done() = 0;
  const uint64_t keep = kio.poll_timeout_ns();
  kio.set_poll_timeout_ns(2'000'000);  // 2 ms
  kio.combine(0, T_MAX, dout, os, true, true);
  kio.set_poll_timeout_ns(keep);
  finish(timeout_s, "combine (timeout)");
  const uint32_t n = kio.poll_timeouts(true);
  if (n < 1) throw Error("the wait ended without done >= 1 and without counting a timeout");
  fetch();
  if (got != out) throw Error("a timed-out combine wrote its output (it must read no y)");
  if (kio.poll_timeouts(true)) throw Error("the poll-timeout count was not cleared");
}
}  // namespace

std::string probe(const gpusync_api* api, gpusync_device* dev, const std::string& image, double timeout_s, bool wait) {
  std::string stage = "setup";
  try {
    Scratch sc(api, dev);
    IoTarget io;
    io.io_x = sc.dptr + Scratch::X, io.io_ids = sc.dptr + Scratch::IDS, io.io_w = sc.dptr + Scratch::W;
    io.io_y = sc.dptr + Scratch::Y, io.ready = sc.dptr, io.done = sc.dptr + 64;
    io.H = H, io.K = K, io.max_tokens = T_MAX;
    stage = "module load";
    KernelIO kio(api, dev, image, io);
    const int64_t xs = H + 64, os = H + 8;
    DevBuf dx(api, dev, T_MAX * xs * 2 + 64), dids(api, dev, T_MAX * K * 4), dw(api, dev, T_MAX * K * 4),
        dres(api, dev, E), dout(api, dev, T_MAX * os * 2);
    Rng rng{12345};
    std::vector<uint16_t> x(T_MAX * xs), out(T_MAX * os), got(T_MAX * os);
    std::vector<int32_t> ids(T_MAX * K);
    std::vector<float> w(T_MAX * K);
    std::vector<uint8_t> res(E, 0);
    res[1] = res[5] = res[9] = 1;
    for (auto& v : x) v = rng.bf16();
    for (auto& v : w) v = (rng.next() % 1000) / 997.0f;
    for (auto& v : ids) v = (int32_t)(rng.next() % (E + 1)) - 1;
    ids[3] = E + 3;  // out of range: passed through for the executor to reject
    auto sync = [&](const char* what) {
      if (api->stream_sync(dev, nullptr, 0, timeout_s))
        throw Error(std::string(what) + ": " + api->last_error());
    };
    auto up = [&](uint64_t d, const void* h, size_t n) {
      if (api->memcpy_async(dev, d, (uint64_t)(uintptr_t)h, n, 0)) throw Error(api->last_error());
    };
    up(dx.p, x.data(), x.size() * 2), up(dids.p, ids.data(), ids.size() * 4), up(dw.p, w.data(), w.size() * 4);
    up(dres.p, res.data(), E);
    sync("upload");
    auto check_payload = [&](int T, const uint16_t* xsrc, int64_t stride, const char* what) {
      for (int t = 0; t < T; ++t)
        if (std::memcmp(sc.at<uint16_t>(Scratch::X) + (size_t)t * H, xsrc + t * stride, H * 2))
          throw Error(std::string(what) + ": x row " + std::to_string(t) + " differs");
      for (int i = 0; i < T * K; ++i) {
        int want = ids[i];
        if (want >= 0 && want < E && res[want]) want = -1;
        if (sc.at<int32_t>(Scratch::IDS)[i] != want || std::memcmp(sc.at<float>(Scratch::W) + i, &w[i], 4))
          throw Error(std::string(what) + ": route " + std::to_string(i) + " differs");
      }
    };

    stage = "publish (16-byte copies, one block, residency mask)";
    sc.ready() = 0, sc.done() = 77;
    const uint64_t task = (2ull << 32) | T_MAX;
    kio.publish(0, T_MAX, dx.p, xs, dids.p, K, dw.p, K, dres.p, E, task);
    sync("publish");
    check_payload(T_MAX, x.data(), xs, "publish");
    if (sc.done() != 0 || sc.ready() != task) throw Error("publish: doorbell words not (done 0, ready task)");

    stage = "combine after a ringing step";
    for (int i = 0; i < T_MAX * H; ++i) sc.at<uint16_t>(Scratch::Y)[i] = rng.bf16();
    for (auto& v : out) v = rng.bf16();
    for (int acc = 1; acc >= 0; --acc) {
      up(dout.p, out.data(), out.size() * 2);
      kio.combine(0, T_MAX, dout.p, os, acc != 0);
      if (api->memcpy_async(dev, (uint64_t)(uintptr_t)got.data(), dout.p, got.size() * 2, 0))
        throw Error(api->last_error());
      sync("combine");
      for (int t = 0; t < T_MAX; ++t)
        for (int h = 0; h < H; ++h) {
          const uint16_t y = sc.at<uint16_t>(Scratch::Y)[t * H + h], o = out[t * os + h];
          const uint16_t want = acc ? bf16_rne(f32(o) + f32(y)) : y;
          if (got[t * os + h] != want) throw Error(std::string(acc ? "accumulate" : "write") + " differs");
        }
    }

    stage = "publish without CPU routes (skip)";
    std::vector<int32_t> ids0 = ids;
    for (int i = 0; i < 2 * K; ++i) ids[i] = (i % 3 == 0) ? -1 : 1 + 4 * (i % 3);  // -1, 5, 9: all resident
    up(dids.p, ids.data(), ids.size() * 4);
    sc.ready() = 0, sc.done() = 77;
    kio.publish(0, 2, dx.p, xs, dids.p, K, dw.p, K, dres.p, E, (5ull << 32) | 2);
    sync("publish skip");
    if (sc.done() != 1 || sc.ready() != 0) throw Error("skip: expected done 1 and no doorbell");
    for (int acc = 1; acc >= 0; --acc) {
      up(dout.p, out.data(), out.size() * 2);
      kio.combine(0, 2, dout.p, os, acc != 0, wait);  // a skipped step waits for nothing
      if (api->memcpy_async(dev, (uint64_t)(uintptr_t)got.data(), dout.p, got.size() * 2, 0))
        throw Error(api->last_error());
      sync("combine skip");
      for (int t = 0; t < 2; ++t)
        for (int h = 0; h < H; ++h) {
          const uint16_t want = acc ? bf16_rne(f32(out[t * os + h]) + 0.0f) : 0;
          if (got[t * os + h] != want) throw Error("skipped step: combine must add/write zeros");
        }
    }

    // Several blocks (2-byte copies, 3 x 2048 items): whether any route goes to the CPU reaches
    // the last block through the block counter, which it must leave at 0 for the next launch.
    stage = "publish without CPU routes, several blocks (2-byte copies)";
    sc.ready() = 0, sc.done() = 77;
    for (int i = 2 * K; i < 3 * K; ++i) ids[i] = -1;
    up(dids.p, ids.data(), ids.size() * 4);
    kio.publish(0, 3, dx.p + 2, xs - 1, dids.p, K, dw.p, K, dres.p, E, (6ull << 32) | 3);
    sync("publish skip, several blocks");
    if (sc.done() != 1 || sc.ready() != 0) throw Error("skip, several blocks: expected done 1 and no doorbell");

    stage = "publish (2-byte copies: unaligned x, several blocks)";
    ids = ids0;
    up(dids.p, ids.data(), ids.size() * 4);
    sync("upload");
    sc.ready() = 0, sc.done() = 77;
    kio.publish(0, 3, dx.p + 2, xs - 1, dids.p, K, dw.p, K, dres.p, E, (1ull << 32) | 3);
    sync("publish unaligned");
    check_payload(3, x.data() + 1, xs - 1, "publish unaligned");
    if (sc.done() != 0 || sc.ready() != ((1ull << 32) | 3)) throw Error("unaligned publish: doorbell words");
    if (wait) probe_wait(api, dev, kio, sc, dout.p, os, out, rng, timeout_s, stage);
    return "";
  } catch (const std::exception& e) {
    return "kernelio probe failed at " + stage + ": " + e.what();
  }
}
}  // namespace kernelio
