// CPU topology from sysfs and the cgroup CPU limit (v2 cpu.max, v1 cfs quota).
#include "topology.h"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <set>
#include <cstdlib>

namespace cpumoe_exec {
namespace {
// POSIX read, not an ifstream: streaming a filebuf that failed to open segfaulted in a GCC 13 build on the GPU
// host (a missing cgroup or sysfs file is normal: it reads as "").
std::string read_file(const std::string& p) {
  std::string out;
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) != 0;) {
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    out.append(buf, (size_t)n);
  }
  ::close(fd);
  return out;
}
}  // namespace

std::vector<int> parse_cpulist(const std::string& s) {
  std::vector<int> out;
  const char* p = s.c_str();
  while (*p) {
    char* end;
    const long a = std::strtol(p, &end, 10);
    if (end == p) {  // not a number: skip to the next item
      while (*p && *p != ',') ++p;
      if (*p) ++p;
      continue;
    }
    long b = a;
    p = end;
    if (*p == '-') {
      const char* q = p + 1;
      b = std::strtol(q, &end, 10);
      if (end == q) b = a;
      p = end;
    }
    for (long i = a; i <= b && i - a < (1L << 20); ++i) out.push_back((int)i);
    while (*p && *p != ',') ++p;
    if (*p) ++p;
  }
  return out;
}

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

std::vector<int> physical_cores(const std::string& root, const std::vector<int>& allowed) {
  std::vector<int> out;
  std::set<std::vector<int>> seen;
  for (int c : allowed) {
    auto sib = parse_cpulist(read_file(root + "/devices/system/cpu/cpu" + std::to_string(c) + "/topology/thread_siblings_list"));
    if (sib.empty()) sib = {c};
    if (seen.insert(sib).second) out.push_back(c);
  }
  return out;
}

std::vector<int> physical_cores() { return physical_cores(kSysRoot, allowed_cpus()); }

// Numbers are parsed with strtod, not iostream extraction: a stream's numeric extraction segfaulted in a GCC 13 build
// on the GPU host.
int cgroup_cpu_limit(const std::string& root) {
  const std::string v2 = read_file(root + "/fs/cgroup/cpu.max");  // "max 100000" or "300000 100000"
  if (!v2.empty()) {
    if (v2.compare(0, 3, "max") == 0) return 0;
    char* end;
    const double quota = std::strtod(v2.c_str(), &end), period = std::strtod(end, nullptr);
    return quota > 0 && period > 0 ? std::max(1, (int)std::ceil(quota / period)) : 0;
  }
  const std::string q = read_file(root + "/fs/cgroup/cpu/cpu.cfs_quota_us"),
                    p = read_file(root + "/fs/cgroup/cpu/cpu.cfs_period_us");
  const double quota = std::strtod(q.c_str(), nullptr), period = std::strtod(p.c_str(), nullptr);
  return quota > 0 && period > 0 ? std::max(1, (int)std::ceil(quota / period)) : 0;
}

std::vector<int> default_cores(std::string* why) {
  std::vector<int> cores = physical_cores();
  if (cores.empty()) cores = allowed_cpus();
  if (cores.empty()) cores = {0};
  int lim = cgroup_cpu_limit();
  std::string w = std::to_string(cores.size()) + " physical cores in the affinity mask";
  if (lim > 0 && (size_t)lim < cores.size()) {
    cores.resize(lim);
    w += ", capped to " + std::to_string(lim) + " by the cgroup CPU limit";
  }
  if (why) *why = w;
  return cores;
}

bool pin_current_thread(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
}
}  // namespace cpumoe_exec
