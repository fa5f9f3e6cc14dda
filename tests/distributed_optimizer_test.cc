// Every optimizer DistributedOptimizer offers, against torch.optim's own
// (the PyTorch whose libtorch the build uses) on the same parameters and
// gradients:
// three steps with gradients that change sign; a parameter that never gets
// a gradient stays as it was.
#include <ATen/TensorOperators.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/tensor.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "ddprpc_libtorch_info.h"
#include "autograd/dist_autograd.h"
#include "gtest/gtest.h"
#include "optim/distributed_optimizer.h"
#include "tests/multiprocess.h"

namespace rpc = ddprpc::rpc;
namespace optim = ddprpc::optim;
namespace dist_autograd = ddprpc::dist_autograd;
namespace mp = ddprpc::testing;

namespace {

const std::vector<double> kStart = {0.5, -1.0, 2.0, 0.0};
const std::vector<std::vector<double>> kGrads = {
    {1, -2, 0.5, 3}, {0.5, -1, -0.5, 3}, {-1, 2, 0.25, -3}};

struct Case {
  std::string kind;
  std::map<std::string, double> ours;  // DistributedOptimizer's options
  std::string theirs;                   // torch.optim's class and keyword arguments
};
const std::vector<Case> kCases = {
    {"sgd", {{"lr", 0.1}, {"momentum", 0.9}}, "SGD, lr=0.1, momentum=0.9"},
    {"adam", {{"lr", 0.01}}, "Adam, lr=0.01"},
    {"adamw", {{"lr", 0.01}}, "AdamW, lr=0.01"},
    {"adagrad", {{"lr", 0.1}}, "Adagrad, lr=0.1"},
    {"rmsprop", {{"lr", 0.01}, {"momentum", 0.5}}, "RMSprop, lr=0.01, momentum=0.5"},
    {"adadelta", {}, "Adadelta"},
    {"adamax", {{"weight_decay", 0.1}}, "Adamax, weight_decay=0.1"},
    {"rprop", {}, "Rprop"},
};

std::string list(const std::vector<double>& v) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < v.size(); ++i) out << (i ? "," : "") << v[i];
  return out.str() + "]";
}

// kind -> the parameter after three steps, from torch.optim, with
// parameters of `dtype` ("float32", "bfloat16"); empty when PyTorch cannot
// be run here.
std::map<std::string, std::vector<double>> torch_results(const std::string& dtype) {
  std::string script = "import torch\n";
  for (const Case& c : kCases) {
    const std::string cls = c.theirs.substr(0, c.theirs.find(','));
    const std::string kwargs = c.theirs.find(',') == std::string::npos ? "" : c.theirs.substr(c.theirs.find(','));
    script += "p = torch.tensor(" + list(kStart) + ", dtype=torch." + dtype + ", requires_grad=True)\n";
    script += "q = torch.tensor([1.0, 2.0], requires_grad=True)\n";
    script += "o = torch.optim." + cls + "([p, q]" + kwargs + ")\n";
    for (const auto& g : kGrads) {
      script += "o.zero_grad(); (p * torch.tensor(" + list(g) + ")).sum().backward(); o.step()\n";
    }
    script += "assert q.tolist() == [1.0, 2.0]\n";
    script += "print('" + c.kind + "', *['%.9g' % x for x in p.tolist()])\n";
  }
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/optimizers_" + dtype + ".py";
  FILE* f = std::fopen(path.c_str(), "w");
  std::fputs(script.c_str(), f);
  std::fclose(f);
  std::map<std::string, std::vector<double>> out;
  FILE* p = ::popen((std::string(ddprpc_build::kPython) + " " + path + " 2>&1").c_str(), "r");
  if (p == nullptr) return out;
  char line[512];
  std::string all;
  while (std::fgets(line, sizeof(line), p)) {
    all += line;
    std::istringstream in(line);
    std::string kind;
    in >> kind;
    std::vector<double> values;
    for (double v; in >> v;) values.push_back(v);
    if (values.size() == kStart.size()) out[kind] = values;
  }
  const int status = ::pclose(p);
  if (status != 0) ADD_FAILURE() << "PyTorch's side failed:\n" << all;
  return out;
}

// Every kind on parameters of `dtype`, against torch.optim on the same.
void every_kind_matches_torch_optim(at::ScalarType dtype, double rtol, double atol) {
  // Built against a libtorch tree (DDPRPC_LIBTORCH), the build knows no
  // Python; built against a Python's PyTorch, that Python has torch, and a
  // failure here is a broken environment, not a reason to skip.
  if (ddprpc_build::kPython[0] == '\0') GTEST_SKIP() << "no PyTorch known to this build";
  ASSERT_EQ(std::system((std::string(ddprpc_build::kPython) + " -c 'import torch'").c_str()), 0)
      << "no PyTorch at " << ddprpc_build::kPython;
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    const auto expected = torch_results(dtype == at::kBFloat16 ? "bfloat16" : "float32");
    ASSERT_EQ(expected.size(), kCases.size());
    for (const Case& c : kCases) {
      SCOPED_TRACE(c.kind);
      // The parameters live on worker1; the gradients come from worker0's
      // backward through an RPC.
      const int64_t type = static_cast<int64_t>(dtype);
      rpc::RRef<at::Tensor> p = rpc::remote<at::Tensor>("worker1", "make_param", kStart, type);
      rpc::RRef<at::Tensor> untouched = rpc::remote<at::Tensor>(
          "worker1", "make_param", std::vector<double>{1.0, 2.0}, type);
      optim::DistributedOptimizer opt(c.kind, c.ours, {p, untouched});
      const int64_t p_version = p.rpc_sync<int64_t>("version");
      const int64_t untouched_version = untouched.rpc_sync<int64_t>("version");
      for (const auto& g : kGrads) {
        dist_autograd::Context context;
        at::Tensor scaled = rpc::rpc_sync<at::Tensor>("worker1", "times", p, at::tensor(g, at::kFloat));
        dist_autograd::backward(context.id(), {scaled.sum()});
        opt.step(context.id());
      }
      // A step changes each parameter it updates: sgd's once.
      const int64_t changes = p.rpc_sync<int64_t>("version") - p_version;
      if (c.kind == "sgd") {
        EXPECT_EQ(changes, static_cast<int64_t>(kGrads.size()));
      } else {
        EXPECT_GE(changes, static_cast<int64_t>(kGrads.size()));
      }
      EXPECT_EQ(untouched.rpc_sync<int64_t>("version"), untouched_version);
      const at::Tensor got = p.to_here();
      EXPECT_EQ(got.scalar_type(), dtype);
      const at::Tensor want = at::tensor(expected.at(c.kind), at::kFloat);
      EXPECT_TRUE(at::allclose(got.to(at::kFloat), want, rtol, atol))
          << "ours " << got << "\ntorch.optim " << want;
      EXPECT_TRUE(
          untouched.to_here().equal(at::tensor(std::vector<double>{1.0, 2.0}, at::kFloat).to(dtype)));
    }
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(DistributedOptimizerTest, EveryKindMatchesTorchOptim, 2) {
  every_kind_matches_torch_optim(at::kFloat, 1e-5, 1e-6);
}

// bfloat16 parameters keep their dtype and step as torch.optim's do, to
// bfloat16's precision (8 bits of mantissa).
MULTIPROCESS_TEST(DistributedOptimizerTest, EveryKindMatchesTorchOptimInBfloat16, 2) {
  every_kind_matches_torch_optim(at::kBFloat16, 2e-2, 2e-2);
}

}  // namespace

namespace {
at::Tensor make_param(std::vector<double> values, int64_t dtype) {
  return at::tensor(values, at::kFloat).to(static_cast<at::ScalarType>(dtype)).requires_grad_(true);
}
DDPRPC_REGISTER_FUNCTION(make_param);

// The version counter of a parameter, on its owner.
static bool version_registered = [] {
  rpc::register_value_method("version", [](const at::Tensor& t) { return t._version(); });
  return true;
}();
at::Tensor times(rpc::RRef<at::Tensor> param, at::Tensor factor) { return param.local_value() * factor; }
DDPRPC_REGISTER_FUNCTION(times);
}  // namespace

namespace {

// An owner whose step fails (here: worker1 died after the optimizer was
// made) does not hide the others': step() waits for every owner, and its
// error names the one that failed and the one that applied the step.
void die_now() { mp::die_abruptly(); }
DDPRPC_REGISTER_FUNCTION(die_now);

MULTIPROCESS_TEST(DistributedOptimizerTest, AStepThatFailsOnOneOwnerSaysWhichAppliedIt, 3) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, mp::backend_options());
  if (mp::rank() == 0) {
    const int64_t type = static_cast<int64_t>(at::kFloat);
    rpc::RRef<at::Tensor> on1 = rpc::remote<at::Tensor>("worker1", "make_param", kStart, type);
    rpc::RRef<at::Tensor> on2 = rpc::remote<at::Tensor>("worker2", "make_param", kStart, type);
    optim::DistributedOptimizer opt("sgd", {{"lr", 0.1}}, {on1, on2});
    const int64_t before = on2.rpc_sync<int64_t>("version");
    dist_autograd::Context context;
    at::Tensor scaled =
        rpc::rpc_sync<at::Tensor>("worker2", "times", on2, at::tensor(kGrads[0], at::kFloat));
    dist_autograd::backward(context.id(), {scaled.sum()});
    rpc::rpc_async<void>("worker1", "die_now");  // never answered
    absl::SleepFor(absl::Milliseconds(300));
    try {
      opt.step(context.id());
      ADD_FAILURE() << "a step with a dead owner succeeded";
    } catch (const std::exception& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("failed on worker1"), std::string::npos) << what;
      EXPECT_NE(what.find("applied on worker2"), std::string::npos) << what;
    }
    EXPECT_EQ(on2.rpc_sync<int64_t>("version"), before + 1);
  }
  if (mp::rank() == 1) absl::SleepFor(absl::Seconds(30));  // until it is told to die
  rpc::shutdown();
}

}  // namespace
