// ddprpc on a GPU: the NCCL process group on every dtype it takes (CUDA
// tensors in place, CPU tensors staged through the GPU), views, broadcast,
// allgather, barrier, a large tensor and the refusals; a group whose second
// rank never comes (it must fail at its timeout, not hang); DDP's reducer
// over the group on a small CUDA model, in float and bfloat16; the codec
// on CUDA tensors; and an RPC with distributed autograd and the distributed
// optimizer stepping a CUDA parameter, against torch::optim on the same.
// World size 1: NCCL refuses two ranks on one GPU.
//
// Built two ways from the same sources: by Bazel (//tools/gpu_check), and
// by run.sh with CMake on a GPU machine that has no Bazel (prepare.sh
// carries the source list, generated files and libraries there). On a
// machine without a GPU it prints one SKIP line and exits 0; with --cpu it
// runs every check it can on the CPU over a Gloo group instead (what CI
// runs, so that the checks themselves are known to work).
//
// Prints one "CHECK name: PASS|FAIL detail" line per check, then
// "gpu_check: P passed, F failed"; exits 1 when a check failed.
#include <ATen/ATen.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "autograd/dist_autograd.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/process_group.h"
#include "optim/distributed_optimizer.h"
#include "rpc/rendezvous/launch.h"
#include "rpc/rendezvous/store.h"
#include "rpc/rpc.h"
#include "rpc/core/security.h"
#include "rpc/wire/codec.h"

namespace ddp = ddprpc::ddp;
namespace rpc = ddprpc::rpc;
namespace optim = ddprpc::optim;
namespace dist_autograd = ddprpc::dist_autograd;

namespace {

int g_passed = 0;
int g_failed = 0;

void report(const std::string& name, bool ok, const std::string& detail = "") {
  std::printf("CHECK %s: %s%s%s\n", name.c_str(), ok ? "PASS" : "FAIL", detail.empty() ? "" : " ",
              detail.c_str());
  std::fflush(stdout);
  ++(ok ? g_passed : g_failed);
}

// Runs `body`; an exception is a failure named by its message.
void check(const std::string& name, const std::function<bool()>& body) {
  try {
    report(name, body());
  } catch (const std::exception& e) {
    report(name, false, std::string("threw: ") + e.what());
  }
}

// Where the checks run: CUDA with the NCCL group, or (--cpu) the CPU with
// the Gloo group.
struct Target {
  at::Device device;
  std::string backend;  // "nccl" or "gloo"
};

// A store server on a free loopback port, owned for the life of the
// process, and clients of it, with a random token.
class LocalStore {
 public:
  LocalStore() {
    security_.token = rpc::Security::random_token();
    server_ = rpc::StoreServer::start("127.0.0.1", 0, security_);
  }
  std::shared_ptr<rpc::Store> client(absl::Duration timeout = absl::Seconds(60)) const {
    return std::make_shared<rpc::Store>("127.0.0.1", server_->port(), timeout, security_);
  }

 private:
  rpc::Security security_;
  std::unique_ptr<rpc::StoreServer> server_;
};

std::shared_ptr<ddp::ProcessGroup> make_group(const Target& target, const LocalStore& store,
                                              const std::string& prefix, int size,
                                              ddp::ProcessGroupOptions options = {}) {
  return target.backend == "nccl" ? ddp::make_nccl_group(store.client(), prefix, 0, size, options)
                                  : ddp::make_gloo_group(store.client(), prefix, 0, size, options);
}

// Values every dtype holds exactly: 0, 1, 2, ... wrapped to 0/1 for bool.
at::Tensor sample(at::ScalarType type, int64_t n, const at::Device& device) {
  at::Tensor t = at::arange(n, at::TensorOptions().dtype(at::kLong)).remainder(7);
  if (type == at::kBool) t = t.remainder(2);
  return t.to(type).to(device);
}

const std::vector<at::ScalarType> kGroupTypes = {at::kFloat, at::kDouble, at::kHalf,
                                                 at::kBFloat16, at::kInt, at::kLong,
                                                 at::kChar, at::kByte, at::kBool};

void check_dtypes(ddp::ProcessGroup& group, const Target& target) {
  std::vector<at::Device> devices = {target.device};
  if (target.device.is_cuda()) devices.emplace_back(at::kCPU);  // staged through the GPU
  for (at::ScalarType type : kGroupTypes) {
    for (const at::Device& device : devices) {
      for (auto op : {ddp::ReduceOp::kSum, ddp::ReduceOp::kMin, ddp::ReduceOp::kMax}) {
        const char* op_name = op == ddp::ReduceOp::kSum   ? "sum"
                              : op == ddp::ReduceOp::kMin ? "min"
                                                          : "max";
        check(absl::StrCat("allreduce ", c10::toString(type), " ", op_name, " ", device.str()), [&] {
          // One rank: the reduction of one contribution is that contribution.
          at::Tensor t = sample(type, 1000, device);
          const at::Tensor want = t.clone();
          group.allreduce({t}, op)->wait();
          return t.device() == device && at::equal(t.cpu(), want.cpu());
        });
      }
    }
  }
  check("allreduce complex64 refused, naming the dtype", [&] {
    at::Tensor t = at::ones({4}, at::TensorOptions().dtype(at::kComplexFloat).device(target.device));
    try {
      group.allreduce({t}, ddp::ReduceOp::kSum)->wait();
    } catch (const std::exception& e) {
      return std::string(e.what()).find("ComplexFloat") != std::string::npos;
    }
    return false;
  });
}

void check_shapes(ddp::ProcessGroup& group, const Target& target) {
  const auto on = at::TensorOptions().device(target.device);
  check("allreduce avg float", [&] {
    at::Tensor t = at::full({256}, 3.0, on);
    group.allreduce({t}, ddp::ReduceOp::kAvg)->wait();
    return at::allclose(t.cpu(), at::full({256}, 3.0));
  });
  check("allreduce of a non-contiguous view", [&] {
    at::Tensor base = at::arange(64, on.dtype(at::kFloat)).reshape({8, 8});
    at::Tensor view = base.t();
    const at::Tensor want = view.clone();
    group.allreduce({view}, ddp::ReduceOp::kSum)->wait();
    return at::equal(view.cpu(), want.cpu()) && at::equal(base.t().cpu(), want.cpu());
  });
  check("allreduce 64 MiB", [&] {
    at::Tensor t = at::ones({16 << 20}, on);
    group.allreduce({t}, ddp::ReduceOp::kSum)->wait();
    return t.sum().item<double>() == static_cast<double>(16 << 20);
  });
  check("broadcast bfloat16", [&] {
    at::Tensor t = sample(at::kBFloat16, 100, target.device);
    const at::Tensor want = t.clone();
    group.broadcast({t}, 0)->wait();
    return at::equal(t.cpu(), want.cpu());
  });
  check("allgather int8", [&] {
    at::Tensor in = sample(at::kChar, 100, target.device);
    std::vector<at::Tensor> out = {at::empty_like(in)};
    group.allgather(out, in)->wait();
    return at::equal(out[0].cpu(), in.cpu());
  });
  check("barrier", [&] {
    group.barrier()->wait();
    return true;
  });
}

// A group of two whose second rank never comes fails at its timeout with
// an error, instead of blocking (NCCL's own initialisation has no timeout).
void check_missing_rank(const Target& target, const LocalStore& store) {
  check("a group whose second rank never comes fails at its timeout", [&] {
    ddp::ProcessGroupOptions options;
    options.timeout = absl::Seconds(5);
    const absl::Time start = absl::Now();
    try {
      make_group(target, store, "gpu_check/missing/", 2, options);
    } catch (const std::exception& e) {
      const absl::Duration took = absl::Now() - start;
      std::printf("  (failed after %s: %s)\n", absl::FormatDuration(took).c_str(), e.what());
      return took < absl::Seconds(30);
    }
    return false;
  });
}

torch::nn::Sequential small_model() {
  return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 4));
}

// DistributedDataParallel over the group on a model on the target device:
// the reducer's averaged gradients (one rank: the local ones) match those
// of an unwrapped copy of the model, after a synchronized pass and after
// one accumulated under no_sync; the fp16 compression hook's too, to
// float16's precision.
void check_ddp(const std::shared_ptr<ddp::ProcessGroup>& group, const Target& target) {
  for (at::ScalarType type : {at::kFloat, at::kBFloat16}) {
    for (bool compressed : {false, true}) {
      if (compressed && type != at::kFloat) continue;
      const std::string name = absl::StrCat("DDP on a ", c10::toString(type), " model",
                                            compressed ? ", fp16 compression hook" : "");
      check(name, [&] {
        torch::manual_seed(0);
        auto model = small_model();
        model->to(target.device, type);
        auto reference = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
        reference->to(target.device, type);
        ddp::DistributedDataParallel wrapped(model.ptr(), group);
        if (compressed) wrapped.register_comm_hook(ddp::fp16_compress_hook());
        const auto opts = at::TensorOptions().dtype(type).device(target.device);
        const double tol = type == at::kFloat && !compressed ? 1e-5 : 2e-2;
        auto same_grads = [&] {
          auto ours = model->parameters(), theirs = reference->parameters();
          for (size_t i = 0; i < ours.size(); ++i) {
            if (!ours[i].grad().defined() || ours[i].grad().device() != target.device ||
                ours[i].grad().scalar_type() != type ||
                !at::allclose(ours[i].grad().cpu().to(at::kFloat),
                              theirs[i].grad().cpu().to(at::kFloat), tol, tol)) {
              return false;
            }
          }
          return true;
        };
        at::Tensor x = at::randn({8, 16}, opts);
        model->forward(x).pow(2).sum().backward();
        reference->forward(x).pow(2).sum().backward();
        if (!same_grads()) return false;
        {
          auto no_sync = wrapped.no_sync();
          model->forward(x * 2).pow(2).sum().backward();
        }
        reference->forward(x * 2).pow(2).sum().backward();
        model->forward(x).sum().backward();
        reference->forward(x).sum().backward();
        return same_grads();
      });
    }
  }
}

// The codec on tensors of the target device: each dtype, a non-contiguous
// view and a tensor that requires grad arrive with their values, shapes and
// flags (on the CPU: the wire carries host memory).
void check_codec(const Target& target) {
  auto round_trip = [](const at::Tensor& t) {
    rpc::internal::Frame out;
    rpc::internal::encode_value(c10::IValue(t), out.header.mutable_payload(), &out);
    rpc::internal::Frame in;
    const absl::Status status = rpc::internal::parse_frame(rpc::internal::serialize_frame(out), &in);
    if (!status.ok()) throw std::runtime_error(std::string(status.message()));
    return rpc::internal::decode_value(in.header.payload(), in).toTensor();
  };
  for (at::ScalarType type : kGroupTypes) {
    check(absl::StrCat("codec ", c10::toString(type), " ", target.device.str()), [&] {
      const at::Tensor t = sample(type, 257, target.device);
      const at::Tensor back = round_trip(t);
      return back.scalar_type() == type && back.sizes() == t.sizes() && at::equal(back, t.cpu());
    });
  }
  check(absl::StrCat("codec non-contiguous view ", target.device.str()), [&] {
    const at::Tensor t = at::randn({6, 5}, at::TensorOptions().device(target.device)).t();
    const at::Tensor back = round_trip(t);
    return back.sizes() == t.sizes() && at::equal(back, t.cpu());
  });
  check(absl::StrCat("codec requires_grad ", target.device.str()), [&] {
    const at::Tensor t = at::randn({4}, at::TensorOptions().device(target.device)).requires_grad_(true);
    const at::Tensor back = round_trip(t);
    return back.requires_grad() && at::equal(back.detach(), t.detach().cpu());
  });
}

// The parameter a remote call makes, on `device` ("cuda", "cpu").
at::Tensor gpu_check_param(std::vector<double> values, int64_t dtype, std::string device) {
  return at::tensor(values, at::kFloat)
      .to(at::Device(device), static_cast<at::ScalarType>(dtype))
      .requires_grad_(true);
}
DDPRPC_REGISTER_FUNCTION(gpu_check_param);
// The parameter times `factor`, on the parameter's device.
at::Tensor gpu_check_times(rpc::RRef<at::Tensor> param, std::vector<double> factor) {
  const at::Tensor p = param.local_value();
  return p * at::tensor(factor, at::kFloat).to(p.device(), p.scalar_type());
}
DDPRPC_REGISTER_FUNCTION(gpu_check_times);

const std::vector<double> kStart = {0.5, -1.0, 2.0, 0.0};
const std::vector<std::vector<double>> kGrads = {{1, -2, 0.5, 3}, {0.5, -1, -0.5, 3}, {-1, 2, 0.25, -3}};

// DDP inside a distributed autograd pass, on a model on the target device:
// the context gets the averaged gradients (one rank: the local ones) and
// .grad stays untouched. On a GPU, libtorch's engine runs the CUDA
// parameters' hooks (DDP's) on the device's thread, not the pass's.
void check_ddp_in_dist_autograd(const std::shared_ptr<ddp::ProcessGroup>& group,
                                const Target& target) {
  check(absl::StrCat("DDP inside a dist_autograd pass ", target.device.str()), [&] {
    torch::manual_seed(0);
    auto model = small_model();
    model->to(target.device);
    auto reference = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
    reference->to(target.device);
    ddp::DistributedDataParallel wrapped(model.ptr(), group);
    const at::Tensor x = at::randn({8, 16}, at::TensorOptions().device(target.device));
    reference->forward(x).pow(2).sum().backward();
    dist_autograd::Context context;
    dist_autograd::backward(context.id(), {model->forward(x).pow(2).sum()});
    const auto grads = dist_autograd::get_gradients(context.id());
    auto ours = model->parameters(), theirs = reference->parameters();
    for (size_t i = 0; i < ours.size(); ++i) {
      if (ours[i].grad().defined() || !grads.contains(ours[i]) ||
          !at::allclose(grads.at(ours[i]).cpu(), theirs[i].grad().cpu(), 1e-5, 1e-5)) {
        return false;
      }
    }
    return true;
  });
}

// One worker: a parameter on the target device owned through an RRef, a
// loss computed by RPC, distributed autograd's backward through that RPC
// (the gradient comes back over the wire and must reach the parameter's
// device) and DistributedOptimizer's steps, against torch::optim on a copy.
void check_rpc_autograd_optimizer(const Target& target,
                                  const std::shared_ptr<ddp::ProcessGroup>& group) {
  bool running = false;
  check("rpc init, world size 1", [&] {
    rpc::RpcBackendOptions options;
    // The agent hosts its own store, on a port that was free a moment ago.
    options.init_method = absl::StrCat("tcp://127.0.0.1:", rpc::pick_free_port());
    rpc::init_rpc("gpu_check", 0, 1, options);
    running = true;
    return true;
  });
  if (!running) return;
  for (at::ScalarType type : {at::kFloat, at::kBFloat16}) {
    for (const std::string kind : {"sgd", "adam"}) {
      check(absl::StrCat("dist_autograd + DistributedOptimizer ", kind, " ", c10::toString(type),
                         " ", target.device.str()),
            [&] {
              const int64_t dtype = static_cast<int64_t>(type);
              auto p = rpc::remote<at::Tensor>("gpu_check", "gpu_check_param", kStart, dtype,
                                               target.device.str());
              const std::map<std::string, double> options =
                  kind == "sgd" ? std::map<std::string, double>{{"lr", 0.1}, {"momentum", 0.9}}
                                : std::map<std::string, double>{{"lr", 0.01}};
              optim::DistributedOptimizer opt(kind, options, {p});
              at::Tensor q = gpu_check_param(kStart, dtype, target.device.str());
              std::unique_ptr<torch::optim::Optimizer> reference;
              if (kind == "sgd") {
                reference = std::make_unique<torch::optim::SGD>(
                    std::vector<at::Tensor>{q}, torch::optim::SGDOptions(0.1).momentum(0.9));
              } else {
                reference = std::make_unique<torch::optim::Adam>(std::vector<at::Tensor>{q},
                                                                 torch::optim::AdamOptions(0.01));
              }
              for (const auto& g : kGrads) {
                dist_autograd::Context context;
                at::Tensor scaled = rpc::rpc_sync<at::Tensor>("gpu_check", "gpu_check_times", p, g);
                dist_autograd::backward(context.id(), {scaled.sum()});
                opt.step(context.id());
                reference->zero_grad();
                (q * at::tensor(g, at::kFloat).to(q.device(), q.scalar_type())).sum().backward();
                reference->step();
              }
              const at::Tensor got = p.to_here();
              const double tol = type == at::kFloat ? 1e-5 : 2e-2;
              return got.scalar_type() == type && got.device() == target.device &&
                     at::allclose(got.detach().cpu().to(at::kFloat),
                                  q.detach().cpu().to(at::kFloat), tol, tol);
            });
    }
  }
  if (group) check_ddp_in_dist_autograd(group, target);
  rpc::shutdown();
}

}  // namespace

int main(int argc, char** argv) {
  const bool cpu = argc > 1 && std::strcmp(argv[1], "--cpu") == 0;
  if (argc > 1 && !cpu) {
    std::printf(
        "usage: gpu_check [--cpu]\n"
        "  Checks ddprpc's NCCL group, DDP, codec, distributed autograd and optimizer on a GPU;\n"
        "  --cpu runs the same checks on the CPU over a Gloo group.\n");
    return 2;
  }
  if (!cpu && !ddp::nccl_available()) {
    std::printf("gpu_check: SKIP: %s\n",
                ddp::nccl_devices() == 0 && !at::hasCUDA()
                    ? "no GPU visible (or the NCCL backend is not built in); nothing checked"
                    : "the NCCL backend sees no GPU; nothing checked");
    return 0;
  }
  const Target target = cpu ? Target{at::Device(at::kCPU), "gloo"}
                            : Target{at::Device(at::kCUDA, 0), "nccl"};
  LocalStore store;
  std::shared_ptr<ddp::ProcessGroup> group;
  check(absl::StrCat("make ", target.backend, " group world size 1"), [&] {
    group = make_group(target, store, "gpu_check/", 1);
    return group != nullptr && group->backend() == target.backend;
  });
  if (group) {
    check_dtypes(*group, target);
    check_shapes(*group, target);
    check_ddp(group, target);
  }
  check_missing_rank(target, store);
  check_codec(target);
  check_rpc_autograd_optimizer(target, group);
  std::printf("gpu_check: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
