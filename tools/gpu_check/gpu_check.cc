// ddprpc's NCCL process group on a GPU: every dtype the group takes, CPU
// tensors (staged through the GPU) and CUDA tensors (in place), views,
// broadcast, allgather, barrier, a large tensor, a small model's gradients
// averaged through the group, and the refusals (a dtype NCCL cannot reduce).
//
// Built two ways: by Bazel (//tools/gpu_check, against the rendezvous store
// of //rpc/rendezvous), where on a machine without a GPU it prints one SKIP
// line and exits 0; and by run.sh with CMake on a GPU machine without Bazel
// (file_store.cc stands in for the store there).
//
// Prints one "CHECK name: PASS|FAIL detail" line per check, then
// "gpu_check: P passed, F failed"; exits 1 when a check failed.
#include <ATen/ATen.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>

#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ddp/process_group.h"
#include "tools/gpu_check/check_store.h"

namespace ddp = ddprpc::ddp;

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

// Values every dtype holds exactly: 0, 1, 2, ... wrapped to 0/1 for bool.
at::Tensor sample(at::ScalarType type, int64_t n, const at::Device& device) {
  at::Tensor t = at::arange(n, at::TensorOptions().dtype(at::kLong)).remainder(7);
  if (type == at::kBool) t = t.remainder(2);
  return t.to(type).to(device);
}

void check_dtypes(ddp::ProcessGroup& group) {
  const std::vector<at::ScalarType> types = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                             at::kInt,   at::kLong,   at::kChar, at::kByte,
                                             at::kBool};
  for (at::ScalarType type : types) {
    for (const char* where : {"cuda", "cpu"}) {
      const at::Device device(where);
      for (auto op : {ddp::ReduceOp::kSum, ddp::ReduceOp::kMin, ddp::ReduceOp::kMax}) {
        const char* op_name = op == ddp::ReduceOp::kSum   ? "sum"
                              : op == ddp::ReduceOp::kMin ? "min"
                                                          : "max";
        check(std::string("allreduce ") + c10::toString(type) + " " + op_name + " " + where, [&] {
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
    at::Tensor t = at::ones({4}, at::TensorOptions().dtype(at::kComplexFloat).device(at::kCUDA));
    try {
      group.allreduce({t}, ddp::ReduceOp::kSum)->wait();
    } catch (const std::exception& e) {
      return std::string(e.what()).find("ComplexFloat") != std::string::npos;
    }
    return false;
  });
}

void check_shapes(ddp::ProcessGroup& group) {
  check("allreduce avg float cuda", [&] {
    at::Tensor t = at::full({256}, 3.0, at::TensorOptions().device(at::kCUDA));
    group.allreduce({t}, ddp::ReduceOp::kAvg)->wait();
    return at::allclose(t.cpu(), at::full({256}, 3.0));
  });
  check("allreduce of a non-contiguous cuda view", [&] {
    at::Tensor base = at::arange(64, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA))
                          .reshape({8, 8});
    at::Tensor view = base.t();
    const at::Tensor want = view.clone();
    group.allreduce({view}, ddp::ReduceOp::kSum)->wait();
    return at::equal(view.cpu(), want.cpu()) && at::equal(base.t().cpu(), want.cpu());
  });
  check("allreduce 64 MiB cuda", [&] {
    at::Tensor t = at::ones({16 << 20}, at::TensorOptions().device(at::kCUDA));
    group.allreduce({t}, ddp::ReduceOp::kSum)->wait();
    return t.sum().item<double>() == static_cast<double>(16 << 20);
  });
  check("broadcast bfloat16 cuda", [&] {
    at::Tensor t = sample(at::kBFloat16, 100, at::Device("cuda"));
    const at::Tensor want = t.clone();
    group.broadcast({t}, 0)->wait();
    return at::equal(t.cpu(), want.cpu());
  });
  check("allgather int8 cuda", [&] {
    at::Tensor in = sample(at::kChar, 100, at::Device("cuda"));
    std::vector<at::Tensor> out = {at::empty_like(in)};
    group.allgather(out, in)->wait();
    return at::equal(out[0].cpu(), in.cpu());
  });
  check("barrier", [&] {
    group.barrier()->wait();
    return true;
  });
}

// A two-layer model's gradients averaged through the group as DDP's
// reducer hands them over (one flat bucket per dtype), in bfloat16 and
// float: with one rank the average is the local gradient.
void check_gradients(ddp::ProcessGroup& group) {
  for (at::ScalarType type : {at::kFloat, at::kBFloat16}) {
    check(std::string("model gradients averaged, ") + c10::toString(type), [&] {
      const auto opts = at::TensorOptions().dtype(type).device(at::kCUDA);
      at::Tensor w1 = at::randn({32, 16}, opts).set_requires_grad(true);
      at::Tensor w2 = at::randn({4, 32}, opts).set_requires_grad(true);
      at::Tensor x = at::randn({8, 16}, opts);
      at::Tensor loss = at::relu(x.matmul(w1.t())).matmul(w2.t()).pow(2).sum();
      loss.backward();
      at::Tensor bucket = at::cat({w1.grad().reshape(-1), w2.grad().reshape(-1)});
      const at::Tensor local = bucket.clone();
      group.allreduce({bucket}, ddp::ReduceOp::kAvg)->wait();
      return at::allclose(bucket.cpu().to(at::kFloat), local.cpu().to(at::kFloat));
    });
  }
}

}  // namespace

int main() {
  if (!ddp::nccl_available()) {
    std::printf("gpu_check: SKIP: %s\n",
                ddp::nccl_devices() == 0 && !at::hasCUDA()
                    ? "no GPU visible (or the NCCL backend is not built in); nothing checked"
                    : "the NCCL backend sees no GPU; nothing checked");
    return 0;
  }
  std::shared_ptr<ddp::ProcessGroup> group;
  check("make_nccl_group world size 1", [&] {
    group = ddp::make_nccl_group(gpu_check::make_store(), "gpu_check/", 0, 1);
    return group != nullptr && group->backend() == "nccl";
  });
  if (group) {
    check_dtypes(*group);
    check_shapes(*group);
    check_gradients(*group);
  }
  std::printf("gpu_check: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
