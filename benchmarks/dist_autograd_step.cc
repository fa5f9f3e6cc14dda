// dist_autograd_step: per-iteration cost of distributed autograd on the
// 3-worker split model of //tests:dist_autograd_test (embedding on worker1,
// linear on worker2, loss on worker0): forward, dist backward and
// DistributedOptimizer(SGD) step, p50/p90 in microseconds.
//
//   ./bazelw run //benchmarks:dist_autograd_step
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <gflags/gflags.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "autograd/dist_autograd.h"
#include "benchmarks/common.h"
#include "benchmarks/harness.h"
#include "models/split_model.h"
#include "optim/distributed_optimizer.h"
#include "rpc/rpc.h"
#include "rpc/rref/rref.h"

DEFINE_int32(iters, 500, "measured iterations");
DEFINE_int32(warmup, 50, "iterations before measuring");
DEFINE_string(json, "dist_autograd_step.json", "where to write the figures");

namespace rpc = ddprpc::rpc;
namespace bench = ddprpc::benchmarks;
namespace dist_autograd = ddprpc::dist_autograd;
using ddprpc::models::RemoteEmbedding;
using ddprpc::models::RemoteLinear;

namespace {

const char* const kPhases[] = {"forward (2 RPCs)", "dist backward", "optimizer step", "iteration"};

int worker() {
  const int rank = bench::env_rank();
  rpc::init_rpc("worker" + std::to_string(rank), rank, 3);
  if (rank == 0) {
    auto emb = rpc::remote<RemoteEmbedding>("worker1", 10, 5);
    auto lin = rpc::remote<RemoteLinear>("worker2", 5, 3);
    std::vector<rpc::RRef<at::Tensor>> params = emb.rpc_sync(&RemoteEmbedding::parameters);
    for (auto& p : lin.rpc_sync(&RemoteLinear::parameters)) params.push_back(p);
    ddprpc::optim::DistributedOptimizer opt("sgd", {{"lr", 0.05}}, params);
    at::Tensor indices = at::randint(0, 10, {12}, at::kLong), offsets = at::arange(0, 12, 3, at::kLong);
    at::Tensor target = at::randn({4, 3});
    std::vector<double> phase[4];  // forward, backward, step, total
    for (int i = 0; i < FLAGS_warmup + FLAGS_iters; ++i) {
      absl::Time t0 = absl::Now(), t1, t2, t3;
      {
        dist_autograd::Context context;
        at::Tensor out = lin.rpc_sync(&RemoteLinear::forward,
                                      emb.rpc_sync(&RemoteEmbedding::forward, indices, offsets));
        at::Tensor loss = (out - target).pow(2).mean();
        t1 = absl::Now();
        dist_autograd::backward(context.id(), {loss});
        t2 = absl::Now();
        opt.step(context.id());
        t3 = absl::Now();
      }
      if (i < FLAGS_warmup) continue;
      phase[0].push_back(absl::ToDoubleMicroseconds(t1 - t0));
      phase[1].push_back(absl::ToDoubleMicroseconds(t2 - t1));
      phase[2].push_back(absl::ToDoubleMicroseconds(t3 - t2));
      phase[3].push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
    }
    // The samples go back to the launcher: phase name -> microseconds.
    bench::JsonValue result;
    auto& fields = *result.mutable_struct_value()->mutable_fields();
    for (int i = 0; i < 4; ++i) {
      auto* samples = fields[kPhases[i]].mutable_list_value();
      for (double us : phase[i]) samples->add_values()->set_number_value(us);
    }
    std::string error;
    if (!bench::write_result(result, &error)) {
      std::fprintf(stderr, "dist_autograd_step: cannot hand the samples back: %s\n", error.c_str());
    }
  }
  rpc::shutdown();
  return 0;
}

// Starts the 3 workers; prints the table and writes the JSON of their samples.
int launcher(int argc, char** argv) {
  bench::RolesOptions launch;
  launch.nprocs = 3;
  launch.timeout = absl::Minutes(5);
  const bench::RolesResult r = bench::run_roles(argc, argv, launch);
  if (!r.ok()) {
    std::fprintf(stderr, "dist_autograd_step: %s\n",
                 r.exit_code != 0 ? r.message.c_str() : r.result_error.c_str());
    return r.exit_code != 0 ? r.exit_code : 1;
  }
  bench::Table table({"3-worker split model", "p50", "p90"});
  bench::Json json;
  json.begin_object();
  for (const char* name : kPhases) {
    std::vector<double> samples;
    if (const bench::JsonValue* list = bench::json_at(r.result, {name})) {
      for (const auto& v : list->list_value().values()) samples.push_back(v.number_value());
    }
    double p50 = bench::percentile(samples, 0.5), p90 = bench::percentile(samples, 0.9);
    table.add({name, absl::StrFormat("%.0f us", p50), absl::StrFormat("%.0f us", p90)});
    json.key(name).begin_object().key("p50_us").value(p50).key("p90_us").value(p90).end_object();
  }
  json.end_object();
  std::printf("%s", table.str().c_str());
  const std::string path = bench::output_path(FLAGS_json);
  if (json.write(path)) std::printf("wrote %s\n", path.c_str());
  return 0;
}

}  // namespace

// After main's one-time set-up; also where ranks forked by run_roles start.
int rank_main(int argc, char** argv) {
  bench::parse_flags(&argc, &argv, "benchmarks/dist_autograd_step");
  if (bench::env_rank() >= 0) return worker();
  return launcher(argc, argv);
}

int main(int argc, char** argv) {
  gflags::SetUsageMessage("per-iteration cost of dist autograd + DistributedOptimizer (3 workers)");
  return bench::run_main(argc, argv, &rank_main);
}
