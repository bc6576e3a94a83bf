#pragma once
#include <string>
#include <vector>

namespace cpumoe_exec {
// One logical CPU per physical core (deduplicated by thread_siblings_list),
// restricted to the process's affinity mask, in CPU order.
std::vector<int> physical_cores();
// All logical CPUs in the affinity mask.
std::vector<int> allowed_cpus();
// CPUs the cgroup lets the process use (ceil(quota / period)), 0 if unlimited.
int cgroup_cpu_limit();
// Default worker cores: physical cores, capped by the cgroup limit.
std::vector<int> default_cores(std::string* why);
bool pin_current_thread(int cpu);
}  // namespace cpumoe_exec
