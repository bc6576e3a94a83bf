#pragma once
#include "cpumoe_executor/abi.h"
namespace cpumoe_exec {
const cpumoe_executor_api* executor_api();
}
