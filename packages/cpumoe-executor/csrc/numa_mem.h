// Memory placed on one NUMA node, without libnuma: an anonymous private mapping (no MAP_HUGETLB: it can be
// page-locked later, e.g. by cudaHostRegister, like any malloc'd memory, and pinning keeps its pages where they
// are), transparent huge pages asked for (MADV_HUGEPAGE, as numpy asks for its large arrays), and an mbind
// MPOL_PREFERRED policy on the node before any page is touched: the pages come from that node while it has free
// memory, from another node after that (never an OOM kill or SIGBUS as MPOL_BIND could give). The executor then
// has the node's own pinned workers touch the pages first, so the placement holds even where mbind is refused
// (a kernel without NUMA, a node id the kernel does not know).
#pragma once
#include <stdexcept>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace cpumoe_exec {

struct NodeMem {
  // Maps `bytes` (rounded up to pages); node < 0 asks for no policy. Throws std::runtime_error when mmap fails.
  NodeMem(size_t bytes, int node);
  ~NodeMem();
  NodeMem(const NodeMem&) = delete;
  NodeMem& operator=(const NodeMem&) = delete;
  void* p = nullptr;
  size_t n = 0;
  int node = -1;
  int mbind_errno = -1;  // 0: mbind took the policy; > 0: the errno it failed with; -1: not asked (node < 0)
};

// The node each of up to `samples` pages of [p, p + n), evenly spaced, sits on now (move_pages with no target
// nodes): a node id, or -errno for a page the kernel cannot place (-ENOENT: not touched yet; -ENOSYS: no NUMA).
std::vector<int> page_nodes(const void* p, size_t n, int samples);

// "EINVAL", "ENOSYS", ... (errno's symbolic name; "errno N" for others).
std::string errno_name(int e);

}  // namespace cpumoe_exec
