// The figures a batch_rpc run's rank 0 hands its launcher (benchmarks/
// harness.h): named arrays of numbers, as a JSON object of number arrays
// (non-finite numbers as null).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "benchmarks/common.h"

namespace ddprpc::benchmarks::batch_rpc {

using Figures = std::map<std::string, std::vector<double>>;

JsonValue figures_json(const Figures& f);
Figures figures_from(const JsonValue& v);
// The first value of `name`, or 0 when there is none.
double get(const Figures& f, const std::string& name);

}  // namespace ddprpc::benchmarks::batch_rpc
