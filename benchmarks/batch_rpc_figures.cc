#include "benchmarks/batch_rpc_figures.h"

#include <cmath>

namespace ddprpc::benchmarks::batch_rpc {
namespace bench = ::ddprpc::benchmarks;

bench::JsonValue figures_json(const Figures& f) {
  bench::JsonValue out;
  auto& fields = *out.mutable_struct_value()->mutable_fields();
  for (const auto& [name, values] : f) {
    auto* list = fields[name].mutable_list_value();
    for (double v : values) {
      if (std::isfinite(v)) {
        list->add_values()->set_number_value(v);
      } else {
        list->add_values()->set_null_value(google::protobuf::NULL_VALUE);
      }
    }
  }
  return out;
}

Figures figures_from(const bench::JsonValue& v) {
  Figures f;
  if (!v.has_struct_value()) return f;
  for (const auto& [name, list] : v.struct_value().fields()) {
    auto& values = f[name];
    for (const auto& x : list.list_value().values()) {
      values.push_back(x.kind_case() == bench::JsonValue::kNumberValue ? x.number_value()
                                                                      : std::nan(""));
    }
  }
  return f;
}

double get(const Figures& f, const std::string& name) {
  auto it = f.find(name);
  return it == f.end() || it->second.empty() ? 0 : it->second[0];
}

}  // namespace ddprpc::benchmarks::batch_rpc
