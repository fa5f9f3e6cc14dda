#include "rpc/registry.h"

#include <ATen/ops/ones.h>

#include "gtest/gtest.h"

namespace ddprpc::rpc {
namespace {

c10::IValue invoke(const Handler& h, std::vector<c10::IValue> args) {
  return h(args).value();
}

TEST(RegistryTest, TypedHandlerConvertsArgumentsAndResult) {
  Handler h = make_handler("scale", [](at::Tensor t, double k) { return t.mul(k); });
  at::Tensor out = invoke(h, {c10::IValue(at::ones({2})), c10::IValue(3.0)}).toTensor();
  EXPECT_EQ(out[0].item<float>(), 3.0f);
  // An int is accepted where a float is expected, as in Python.
  EXPECT_EQ(invoke(h, {c10::IValue(at::ones({2})), c10::IValue(int64_t{2})}).toTensor()[1].item<float>(), 2.0f);
}

TEST(RegistryTest, WrongArgumentsNameTheFunctionAndArgument) {
  Handler h = make_handler("scale", [](at::Tensor t, double k) { return t.mul(k); });
  try {
    invoke(h, {c10::IValue(std::string("x")), c10::IValue(1.0)});
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_STREQ(e.what(), "argument 1 of 'scale': expected Tensor, got str");
  }
  try {
    invoke(h, {c10::IValue(at::ones({1}))});
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_STREQ(e.what(), "'scale' takes 2 arguments, got 1");
  }
}

TEST(RegistryTest, AsyncFunctionCompletesLater) {
  Future<int64_t> pending;
  Handler h = make_handler("later", [pending](int64_t) { return pending; });
  std::vector<c10::IValue> args{c10::IValue(int64_t{1})};
  Future<c10::IValue> result = h(args);
  EXPECT_FALSE(result.completed());
  pending.set_result(9);
  EXPECT_EQ(result.value().toInt(), 9);
}

TEST(RegistryTest, DuplicateNamesAreRejected) {
  FunctionRegistry registry;
  registry.add("f", make_handler("f", [] { return 1; }));
  EXPECT_THROW(registry.add("f", make_handler("f", [] { return 2; })), std::invalid_argument);
  EXPECT_NE(registry.find("f"), nullptr);
  EXPECT_EQ(registry.find("g"), nullptr);
}

}  // namespace
}  // namespace ddprpc::rpc
