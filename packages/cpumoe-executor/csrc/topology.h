#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace cpumoe_exec {
// sysfs lives under `root` ("/sys" on a real host; tests point it at a directory describing any machine).
constexpr const char* kSysRoot = "/sys";

// One logical CPU per physical core (deduplicated by thread_siblings_list under root), restricted to `allowed`, in
// CPU order.
std::vector<int> physical_cores(const std::string& root, const std::vector<int>& allowed);
// physical_cores of the real machine within the process's affinity mask.
std::vector<int> physical_cores();
// All logical CPUs in the affinity mask.
std::vector<int> allowed_cpus();
// CPUs the cgroup lets the process use (ceil(quota / period)), 0 if unlimited; root's fs/cgroup.
int cgroup_cpu_limit(const std::string& root = kSysRoot);
// Default worker cores: physical cores, capped by the cgroup limit.
std::vector<int> default_cores(std::string* why);
bool pin_current_thread(int cpu);

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}
std::vector<int> parse_cpulist(const std::string& s);
}  // namespace cpumoe_exec
