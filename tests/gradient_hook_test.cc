// dist_autograd::add_gradient_hook: hooks run in the order they were added,
// each seeing the earlier ones' replacements; a handle removes exactly its
// own hook, waits for the calls under way, and may be used from inside the
// hook itself.
#include <ATen/ATen.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "autograd/dist_autograd.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "tests/multiprocess.h"

namespace rpc = ddprpc::rpc;
namespace mp = ddprpc::testing;
namespace dist_autograd = ddprpc::dist_autograd;

namespace {

// The gradient that a distributed backward pass of sum(w * 3) leaves for w.
at::Tensor backward_once(const at::Tensor& w) {
  dist_autograd::Context context;
  dist_autograd::backward(context.id(), {(w * 3).sum()});
  c10::Dict<at::Tensor, at::Tensor> grads = dist_autograd::get_gradients(context.id());
  EXPECT_TRUE(grads.contains(w));
  return grads.contains(w) ? grads.at(w) : at::Tensor();
}

// Index of `param` in a hook's `params`, or -1.
int64_t index_of(const std::vector<at::Tensor>& params, const at::Tensor& param) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].is_same(param)) return static_cast<int64_t>(i);
  }
  return -1;
}

MULTIPROCESS_TEST(GradientHookTest, HooksRunInOrderEachSeeingTheEarlierOnesGradients, 1) {
  rpc::init_rpc(mp::worker_name(), 0, 1, mp::backend_options());
  {
    const at::Tensor w = at::ones({2}).requires_grad_(true);
    const at::Tensor plain = at::full({2}, 3.0);
    std::vector<std::string> calls;
    auto doubling = dist_autograd::add_gradient_hook(
        [&](dist_autograd::ContextId, std::vector<at::Tensor>& params,
            std::vector<at::Tensor>& grads) {
          calls.push_back("doubling");
          const int64_t i = index_of(params, w);
          ASSERT_GE(i, 0);
          grads[i] = grads[i] * 2;
        });
    at::Tensor seen;
    auto incrementing = std::make_unique<dist_autograd::GradientHookHandle>(
        dist_autograd::add_gradient_hook([&](dist_autograd::ContextId,
                                             std::vector<at::Tensor>& params,
                                             std::vector<at::Tensor>& grads) {
          calls.push_back("incrementing");
          const int64_t i = index_of(params, w);
          ASSERT_GE(i, 0);
          seen = grads[i].clone();
          grads[i] = grads[i] + 1;
        }));

    EXPECT_TRUE(at::equal(backward_once(w), plain * 2 + 1));
    EXPECT_EQ(calls, (std::vector<std::string>{"doubling", "incrementing"}));
    EXPECT_TRUE(at::equal(seen, plain * 2)) << "the second hook did not see the first's result";

    calls.clear();
    doubling.remove();
    EXPECT_FALSE(doubling.active());
    EXPECT_TRUE(at::equal(backward_once(w), plain + 1));
    EXPECT_EQ(calls, (std::vector<std::string>{"incrementing"}));

    calls.clear();
    incrementing.reset();  // the destructor removes it
    EXPECT_TRUE(at::equal(backward_once(w), plain));
    EXPECT_TRUE(calls.empty());

    // A moved-from handle removes nothing; the one it moved to does.
    auto first = dist_autograd::add_gradient_hook(
        [&](dist_autograd::ContextId, std::vector<at::Tensor>&, std::vector<at::Tensor>&) {
          calls.push_back("moved");
        });
    dist_autograd::GradientHookHandle second = std::move(first);
    first.remove();
    backward_once(w);
    EXPECT_EQ(calls, (std::vector<std::string>{"moved"}));
    second = dist_autograd::GradientHookHandle();
    backward_once(w);
    EXPECT_EQ(calls, (std::vector<std::string>{"moved"}));
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(GradientHookTest, RemoveWaitsForTheCallsUnderWay, 1) {
  rpc::init_rpc(mp::worker_name(), 0, 1, mp::backend_options());
  {
    const at::Tensor w = at::ones({2}).requires_grad_(true);
    absl::Notification entered, release;
    std::atomic<int> calls{0};
    auto handle = dist_autograd::add_gradient_hook(
        [&](dist_autograd::ContextId, std::vector<at::Tensor>&, std::vector<at::Tensor>&) {
          ++calls;
          entered.Notify();
          release.WaitForNotification();
        });
    std::thread pass([&] { backward_once(w); });
    entered.WaitForNotification();

    std::atomic<bool> removed{false};
    std::thread remover([&] {
      handle.remove();
      removed = true;
    });
    absl::SleepFor(absl::Milliseconds(300));
    EXPECT_FALSE(removed) << "remove() returned while its hook was still running";
    release.Notify();
    remover.join();
    pass.join();
    EXPECT_TRUE(removed);

    backward_once(w);
    EXPECT_EQ(calls, 1) << "a removed hook was called";
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(GradientHookTest, AHookMayRemoveItself, 1) {
  rpc::init_rpc(mp::worker_name(), 0, 1, mp::backend_options());
  {
    const at::Tensor w = at::ones({2}).requires_grad_(true);
    int calls = 0;
    dist_autograd::GradientHookHandle handle;
    handle = dist_autograd::add_gradient_hook(
        [&](dist_autograd::ContextId, std::vector<at::Tensor>&, std::vector<at::Tensor>&) {
          ++calls;
          handle.remove();  // must not wait for this very call
        });
    backward_once(w);
    backward_once(w);
    EXPECT_EQ(calls, 1);
    EXPECT_FALSE(handle.active());
  }
  rpc::shutdown();
}

}  // namespace
