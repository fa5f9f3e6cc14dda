#include "models/linear.h"

#include <ATen/record_function.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <functional>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

namespace ddprpc::models {
namespace {

// Output and gradients (input, weight, bias) of y = linear(x); loss = sum(y * g).
std::vector<at::Tensor> run(bool fast, const at::Tensor& x0, const at::Tensor& w0,
                            const at::Tensor& b0, const at::Tensor& g) {
  at::Tensor x = x0.clone().requires_grad_(true);
  at::Tensor w = w0.clone().requires_grad_(true);
  at::Tensor b = b0.defined() ? b0.clone().requires_grad_(true) : at::Tensor();
  at::Tensor y = fast ? fast_linear(x, w, b) : at::linear(x, w, b);
  if (fast) {
    // The path taken: XNNPACK's node from 32k multiply-adds, at::linear's
    // below, and always at::linear's in a libtorch without XNNPACK.
    const bool xnnpack = y.grad_fn()->name().find("XnnLinear") != std::string::npos;
    EXPECT_EQ(xnnpack, xnnpack_linear_available() && x0.size(0) * w0.numel() >= 32 * 1024)
        << y.grad_fn()->name();
  }
  std::vector<at::Tensor> inputs{x, w};
  if (b.defined()) inputs.push_back(b);
  std::vector<at::Tensor> out{y.detach()};
  for (auto& grad : torch::autograd::grad({(y * g).sum()}, inputs)) out.push_back(grad);
  return out;
}

void expect_same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  const char* names[] = {"output", "grad input", "grad weight", "grad bias"};
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].sizes(), b[i].sizes()) << names[i];
    EXPECT_TRUE(at::allclose(a[i], b[i], 1e-4, 1e-4))
        << names[i] << ": max difference " << (a[i] - b[i]).abs().max().item<float>();
  }
}

// The tests of XNNPACK's own path need a libtorch built with it (Debian's
// 1.13 was; PyTorch's x86 wheels of 2.x are not: they run Linear on MKL).
#define REQUIRE_XNNPACK()                                                          \
  if (!xnnpack_linear_available()) {                                               \
    GTEST_SKIP() << "this libtorch has no XNNPACK (prepacked::linear_clamp_run); " \
                    "fast_linear runs at::linear, as WithoutXnnpackEveryPathIsAtLinear checks"; \
  }

// In a libtorch without XNNPACK, the xnnpack kernel, fast_linear and a
// layer with a packed-weight cache all run libtorch's own Linear.
TEST(FastLinearTest, WithoutXnnpackEveryPathIsAtLinear) {
  if (xnnpack_linear_available()) GTEST_SKIP() << "this libtorch has XNNPACK";
  at::manual_seed(7);
  Linear layer(512, 256);
  layer->cache_packed_weight(true);
  EXPECT_EQ(layer->kernel(), DenseKernel::kXnnpack);
  at::Tensor x = at::randn({7, 512}).requires_grad_(true);
  at::Tensor y = layer->forward(x);
  EXPECT_EQ(y.grad_fn()->name().find("XnnLinear"), std::string::npos) << y.grad_fn()->name();
  EXPECT_NE(y.grad_fn()->name().find("Addmm"), std::string::npos) << y.grad_fn()->name();
  EXPECT_TRUE(at::allclose(y, at::linear(x, layer->weight, layer->bias), 1e-5, 1e-5));
  at::Tensor z = fast_linear(x, layer->weight, layer->bias);
  EXPECT_NE(z.grad_fn()->name().find("Addmm"), std::string::npos) << z.grad_fn()->name();
}

TEST(FastLinearTest, MatchesAtLinearValuesAndGradients) {
  at::manual_seed(0);
  for (auto [batch, in, out] : std::vector<std::tuple<int, int, int>>{
           {7, 512, 256}, {1, 256, 128}, {9, 100, 37}, {50, 64, 64},  // XNNPACK
           {1, 4, 128}, {33, 32, 8}, {3, 1, 5}}) {                       // too small: at::linear
    SCOPED_TRACE(testing::Message() << batch << "x" << in << " -> " << out);
    at::Tensor x = at::randn({batch, in}), w = at::randn({out, in}), b = at::randn({out});
    at::Tensor g = at::randn({batch, out});
    expect_same(run(true, x, w, b, g), run(false, x, w, b, g));
    expect_same(run(true, x, w, at::Tensor(), g), run(false, x, w, at::Tensor(), g));
  }
}

TEST(FastLinearTest, NonContiguousInputAndNoInputGradient) {
  at::manual_seed(1);
  at::Tensor x = at::randn({64, 40}).t();  // [40, 64], transposed view
  at::Tensor w = at::randn({20, 64}).requires_grad_(true);
  at::Tensor y = fast_linear(x, w, at::Tensor());
  EXPECT_TRUE(at::allclose(y, at::linear(x, w.detach()), 1e-4, 1e-4));
  auto grads = torch::autograd::grad({y.sum()}, {w});
  EXPECT_TRUE(at::allclose(grads[0], at::ones({40}).unsqueeze(0).mm(x).expand({20, 64}), 1e-4, 1e-4));
}

TEST(FastLinearTest, FallsBackForInputsXnnpackCannotTake) {
  at::manual_seed(2);
  // 3-D input and double precision go through at::linear.
  at::Tensor x3 = at::randn({2, 3, 4}), w = at::randn({5, 4}), b = at::randn({5});
  EXPECT_TRUE(at::allclose(fast_linear(x3, w, b), at::linear(x3, w, b)));
  at::Tensor xd = at::randn({3, 4}, at::kDouble), wd = at::randn({5, 4}, at::kDouble);
  EXPECT_TRUE(at::allclose(fast_linear(xd, wd, at::Tensor()), at::linear(xd, wd)));
  // A shape mismatch gets at::linear's error, not XNNPACK's.
  EXPECT_THROW(fast_linear(at::randn({3, 6}), w, b), c10::Error);
}

TEST(FastLinearTest, ModuleHasTorchLinearParametersAndWorksInSequential) {
  torch::nn::Sequential seq(Linear(96, 64), Linear(torch::nn::LinearOptions(64, 48).bias(false)));
  EXPECT_EQ(seq->parameters().size(), 3u);
  auto* first = seq[0]->as<LinearImpl>();
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(first->weight.sizes(), at::IntArrayRef({64, 96}));
  at::Tensor x = at::randn({16, 96});
  at::Tensor y = seq->forward(x);
  auto* second = seq[1]->as<LinearImpl>();
  at::Tensor expected = at::linear(at::linear(x, first->weight, first->bias), second->weight);
  EXPECT_TRUE(at::allclose(y, expected, 1e-4, 1e-4));
  y.sum().backward();
  EXPECT_TRUE(first->weight.grad().defined());
  EXPECT_TRUE(second->weight.grad().defined());
}

TEST(FastLinearTest, AtenKernelRunsLibtorchsLinear) {
  at::manual_seed(4);
  Linear layer(512, 256);
  at::Tensor x = at::randn({7, 512});
  at::Tensor fast = layer->forward(x);
  if (xnnpack_linear_available()) {
    EXPECT_NE(fast.grad_fn()->name().find("XnnLinear"), std::string::npos)
        << fast.grad_fn()->name();
  }
  layer->set_kernel(DenseKernel::kAten);
  EXPECT_EQ(layer->kernel(), DenseKernel::kAten);
  at::Tensor aten = layer->forward(x);
  // libtorch's own node (AddmmBackward0), not ours; the same values.
  EXPECT_EQ(aten.grad_fn()->name().find("XnnLinear"), std::string::npos) << aten.grad_fn()->name();
  EXPECT_NE(aten.grad_fn()->name().find("Addmm"), std::string::npos) << aten.grad_fn()->name();
  EXPECT_TRUE(at::allclose(fast, aten, 1e-4, 1e-4));
  DenseKernel parsed = DenseKernel::kXnnpack;
  EXPECT_TRUE(parse_dense_kernel("aten", &parsed));
  EXPECT_EQ(parsed, DenseKernel::kAten);
  EXPECT_STREQ(dense_kernel_name(parsed), "aten");
  EXPECT_TRUE(parse_dense_kernel("xnnpack", &parsed));
  EXPECT_EQ(parsed, DenseKernel::kXnnpack);
  EXPECT_FALSE(parse_dense_kernel("blas", &parsed));
  std::vector<DenseKernel> list;
  std::string error;
  EXPECT_TRUE(parse_dense_kernels("xnnpack, aten", &list, &error));
  EXPECT_EQ(list, (std::vector<DenseKernel>{DenseKernel::kXnnpack, DenseKernel::kAten}));
  EXPECT_FALSE(parse_dense_kernels("xnnpack,blas", &list, &error));
  EXPECT_NE(error.find("blas"), std::string::npos) << error;
  EXPECT_FALSE(parse_dense_kernels("", &list, &error));
}

TEST(FastLinearTest, CachedPackedWeightFollowsEveryChangeOfTheWeight) {
  REQUIRE_XNNPACK();
  at::manual_seed(3);
  Linear layer(200, 10);
  layer->cache_packed_weight(true);
  at::Tensor x = at::randn({3, 200});
  at::Tensor g = at::randn({3, 10});
  auto check = [&](const char* when, bool packed) {
    SCOPED_TRACE(when);
    at::Tensor xin = x.clone().requires_grad_(true);
    at::Tensor y = layer->forward(xin);
    EXPECT_EQ(y.grad_fn()->name().find("XnnLinearPacked") != std::string::npos, packed)
        << y.grad_fn()->name();
    at::Tensor expected = at::linear(x, layer->weight.detach(), layer->bias.detach());
    EXPECT_TRUE(at::allclose(y, expected, 1e-4, 1e-4));
    auto grads = torch::autograd::grad({(y * g).sum()}, {xin, layer->weight, layer->bias});
    EXPECT_TRUE(at::allclose(grads[0], g.mm(layer->weight.detach()), 1e-4, 1e-4));
    EXPECT_TRUE(at::allclose(grads[1], g.t().mm(x), 1e-4, 1e-4));
    EXPECT_TRUE(at::allclose(grads[2], g.sum(0), 1e-4, 1e-4));
  };
  check("first forward: not packed yet", false);
  check("second forward: packed", true);
  check("third forward: the packed copy", true);
  {
    at::NoGradGuard no_grad;
    layer->weight.add_(1.0);  // an optimizer step
  }
  check("after an in-place step of the weight", false);
  check("packed again", true);
  {
    at::NoGradGuard no_grad;
    layer->bias.mul_(-2.0);
  }
  check("after an in-place change of the bias", false);
  layer->weight.set_data(at::randn({10, 200}));  // new storage
  check("after set_data", false);
  check("packed for the new storage", true);
  layer->cache_packed_weight(false);
  check("cache off", false);
}

// libtorch's optimizers write parameters through .data(), whose version
// counter is not the parameter's: after a step, cache_packed_weight(true)
// drops the packed copy of the old weight.
TEST(FastLinearTest, CachedPackedWeightIsDroppedByCacheOnAfterAnOptimizerStep) {
  REQUIRE_XNNPACK();
  at::manual_seed(4);
  Linear layer(200, 10);
  layer->cache_packed_weight(true);
  torch::optim::SGD sgd(layer->parameters(), torch::optim::SGDOptions(0.5));
  at::Tensor x = at::randn({3, 200});
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(step);
    sgd.zero_grad();
    layer->forward(x);                 // first at this weight: not packed
    at::Tensor y = layer->forward(x);  // packed
    ASSERT_NE(y.grad_fn()->name().find("XnnLinearPacked"), std::string::npos);
    EXPECT_TRUE(at::allclose(y, at::linear(x, layer->weight.detach(), layer->bias.detach()),
                             1e-4, 1e-4));
    y.pow(2).sum().backward();
    sgd.step();
    layer->cache_packed_weight(true);
    for (int i = 0; i < 2; ++i) {
      EXPECT_TRUE(at::allclose(layer->forward(x),
                               at::linear(x, layer->weight.detach(), layer->bias.detach()),
                               1e-4, 1e-4))
          << "forward " << i << " after the step used the old weight";
    }
  }
}

// The sizes of every tensor aten::copy_ wrote into on this thread while fn ran.
std::vector<std::vector<int64_t>> copies_during(const std::function<void()>& fn) {
  static thread_local std::vector<std::vector<int64_t>>* seen = nullptr;
  std::vector<std::vector<int64_t>> out;
  seen = &out;
  auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction& r) -> std::unique_ptr<at::ObserverContext> {
            if (std::string_view(r.name()) == "aten::copy_" && seen && !r.inputs().empty() &&
                r.inputs()[0].isTensor()) {
              seen->push_back(r.inputs()[0].toTensor().sizes().vec());
            }
            return nullptr;
          })
          .needsInputs(true));
  struct Remove {  // also when fn throws: `out` goes with this frame
    at::CallbackHandle handle;
    ~Remove() {
      at::removeCallback(handle);
      seen = nullptr;
    }
  } remove{handle};
  fn();
  return out;
}

// The layer's weight lives in padded memory, so XNNPACK runs it in place:
// no product copies it, forward or backward, also after optimizer steps
// and reset_parameters().
TEST(FastLinearTest, WeightIsNotCopiedByTheProducts) {
  REQUIRE_XNNPACK();
  at::manual_seed(6);
  Linear layer(128, 256);
  torch::optim::SGD sgd(layer->parameters(), torch::optim::SGDOptions(0.1));
  auto step = [&] {
    at::Tensor x = at::randn({7, 128});
    sgd.zero_grad();
    at::Tensor y = layer->forward(x);
    EXPECT_TRUE(at::allclose(y, at::linear(x, layer->weight, layer->bias), 1e-4, 1e-4));
    y.sum().backward();
    sgd.step();
  };
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round == 0 ? "as constructed" : "after reset_parameters()");
    for (int i = 0; i < 3; ++i) {
      const auto copies = copies_during(step);
      for (const auto& sizes : copies) {
        EXPECT_NE(sizes, (std::vector<int64_t>{256, 128})) << "a copy of the weight, step " << i;
      }
    }
    layer->reset_parameters();
  }
  // The check sees copies at all: a weight in ordinary memory is copied.
  at::Tensor w = at::randn({256, 128});
  layer->weight.set_data(w);
  const auto copies = copies_during(step);
  EXPECT_NE(std::find(copies.begin(), copies.end(), std::vector<int64_t>{256, 128}), copies.end());
}

// Threads sharing one layer (an RPC server's handlers) each get their own
// product from the one packed copy.
TEST(FastLinearTest, CachedPackedWeightServesThreadsAtOnce) {
  at::manual_seed(5);
  Linear layer(400, 300);
  layer->cache_packed_weight(true);
  {
    at::NoGradGuard no_grad;
    layer->forward(at::randn({1, 400}));
    layer->forward(at::randn({1, 400}));  // packed from here on
  }
  constexpr int kThreads = 4, kCalls = 300;
  std::vector<int> wrong(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      at::NoGradGuard no_grad;
      at::Tensor x = at::randn({1 + t, 400});
      at::Tensor expected = at::linear(x, layer->weight, layer->bias);
      for (int i = 0; i < kCalls; ++i) {
        if (!at::allclose(layer->forward(x), expected, 1e-4, 1e-4)) ++wrong[t];
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(wrong[t], 0) << "thread " << t;
}

}  // namespace
}  // namespace ddprpc::models
