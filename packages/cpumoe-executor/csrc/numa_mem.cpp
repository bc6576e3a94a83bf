// NUMA placement by syscalls (mbind, move_pages): no libnuma, which is not on every host.
#include "numa_mem.h"

#include <linux/mempolicy.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <stdexcept>

namespace cpumoe_exec {
namespace {
// Node masks of 1024 bits: the largest MAX_NUMNODES of distribution kernels (CONFIG_NODES_SHIFT=10).
constexpr int kMaskBits = 1024;
constexpr size_t kLongBits = 8 * sizeof(unsigned long);
size_t page_size() {
  static const size_t ps = (size_t)sysconf(_SC_PAGESIZE);
  return ps;
}
}  // namespace

NodeMem::NodeMem(size_t bytes, int node_) : node(node_) {
  const size_t ps = page_size();
  n = (std::max<size_t>(bytes, 1) + ps - 1) / ps * ps;
  p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    p = nullptr;
    throw std::runtime_error("cannot map " + std::to_string(n) + " bytes for node " + std::to_string(node) + ": " +
                             errno_name(errno));
  }
#ifdef MADV_HUGEPAGE
  madvise(p, n, MADV_HUGEPAGE);  // advice only: a kernel without THP ignores it
#endif
  if (node < 0) return;
  if (node >= kMaskBits) {
    mbind_errno = EINVAL;
    return;
  }
  unsigned long mask[kMaskBits / kLongBits] = {};
  mask[node / kLongBits] = 1UL << (node % kLongBits);
  // maxnode counts one past the last bit the kernel reads (it reads maxnode - 1 bits)
  mbind_errno = syscall(SYS_mbind, p, n, MPOL_PREFERRED, mask, (unsigned long)kMaskBits + 1, 0u) == 0 ? 0 : errno;
}

NodeMem::~NodeMem() {
  if (p) munmap(p, n);
}

std::vector<int> page_nodes(const void* p, size_t n, int samples) {
  const size_t ps = page_size(), pages = (n + ps - 1) / ps;
  const size_t k = std::min<size_t>(pages, (size_t)std::max(samples, 1));
  std::vector<void*> addr(k);
  std::vector<int> status(k, 0);
  for (size_t i = 0; i < k; ++i) addr[i] = (char*)p + (pages * i / k) * ps;
  if (k && syscall(SYS_move_pages, 0, (unsigned long)k, addr.data(), nullptr, status.data(), 0) != 0) {
    const int e = errno;
    for (int& s : status) s = -e;
  }
  return status;
}

std::string errno_name(int e) {
  switch (e) {
    case 0: return "ok";
    case EINVAL: return "EINVAL";
    case ENOSYS: return "ENOSYS";
    case EPERM: return "EPERM";
    case ENOMEM: return "ENOMEM";
    case EFAULT: return "EFAULT";
    case ENOENT: return "ENOENT";
    case EIO: return "EIO";
    case ENODEV: return "ENODEV";
    default: return "errno " + std::to_string(e);
  }
}
}  // namespace cpumoe_exec
