#include "rpc/internal/codec.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>

#include "gtest/gtest.h"
#include "rpc/value.h"

namespace ddprpc::rpc::internal {
namespace {

c10::IValue round_trip(const c10::IValue& value) {
  Frame out;
  encode_value(value, out.header.mutable_payload(), &out);
  grpc::ByteBuffer bytes = serialize_frame(out);
  EXPECT_EQ(bytes.Length(), out.size());
  Frame in;
  absl::Status status = parse_frame(bytes, &in);
  EXPECT_TRUE(status.ok()) << status;
  return decode_value(in.header.payload(), in);
}

TEST(CodecTest, ScalarsStringsAndNestedContainers) {
  auto value = to_ivalue(std::make_tuple(int64_t{-7}, 2.5, true, std::string("hi"),
                                         std::vector<int64_t>{1, 2, 3},
                                         std::vector<std::string>{"a", "b"}));
  auto back = from_ivalue<std::tuple<int64_t, double, bool, std::string, std::vector<int64_t>,
                                     std::vector<std::string>>>(round_trip(value));
  EXPECT_EQ(std::get<0>(back), -7);
  EXPECT_EQ(std::get<1>(back), 2.5);
  EXPECT_TRUE(std::get<2>(back));
  EXPECT_EQ(std::get<3>(back), "hi");
  EXPECT_EQ(std::get<4>(back), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(std::get<5>(back), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(round_trip(c10::IValue()).isNone());
}

TEST(CodecTest, TensorsKeepDtypeShapeValuesAndRequiresGrad) {
  at::Tensor f = at::randn({3, 4}).t();  // non-contiguous view
  at::Tensor i = at::arange(10, at::kLong);
  at::Tensor b = at::ones({2}, at::kBool);
  at::Tensor g = at::randn({5}).requires_grad_(true);
  auto back = from_ivalue<std::vector<at::Tensor>>(
      round_trip(to_ivalue(std::vector<at::Tensor>{f, i, b, g, at::Tensor()})));
  ASSERT_EQ(back.size(), 5u);
  EXPECT_TRUE(at::equal(back[0], f));
  EXPECT_EQ(back[0].sizes(), f.sizes());
  EXPECT_TRUE(at::equal(back[1], i));
  EXPECT_EQ(back[2].scalar_type(), at::kBool);
  EXPECT_TRUE(back[3].requires_grad());
  EXPECT_TRUE(at::equal(back[3].detach(), g.detach()));
  EXPECT_FALSE(back[4].defined());
}

TEST(CodecTest, SerializingDoesNotCopyTensorBytes) {
  at::Tensor t = at::randn({1 << 16});
  Frame out;
  encode_value(c10::IValue(t), out.header.mutable_payload(), &out);
  grpc::ByteBuffer bytes = serialize_frame(out);
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(bytes.Dump(&slices).ok());
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(static_cast<const void*>(slices[1].begin()), t.data_ptr());
}

TEST(CodecTest, MalformedBytesAreRejected) {
  Frame frame;
  auto parse = [&](const std::string& bytes) {
    grpc::Slice slice(bytes);
    grpc::ByteBuffer buffer(&slice, 1);
    return parse_frame(buffer, &frame);
  };
  EXPECT_FALSE(parse("").ok());
  EXPECT_FALSE(parse("\xff\xff\xff\x7f garbage").ok());
  EXPECT_FALSE(parse(std::string("\x03\x00\x00\x00", 4) + "\xff\xff\xff").ok());

  // A valid frame with a truncated tensor body.
  Frame out;
  encode_value(c10::IValue(at::ones({100})), out.header.mutable_payload(), &out);
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(serialize_frame(out).Dump(&slices).ok());
  std::string bytes;
  for (auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_TRUE(parse(bytes).ok());
  EXPECT_FALSE(parse(bytes.substr(0, bytes.size() - 1)).ok());
  EXPECT_FALSE(parse(bytes + "x").ok());

  wire::Value bad_index;
  bad_index.set_tensor(5);
  EXPECT_THROW(decode_value(bad_index, frame), std::invalid_argument);
  EXPECT_THROW(decode_value(wire::Value(), frame), std::invalid_argument);
}

TEST(CodecTest, UnsupportedValuesThrowTypeMismatch) {
  c10::Dict<std::string, int64_t> dict;
  Frame out;
  EXPECT_THROW(encode_value(c10::IValue(dict), out.header.mutable_payload(), &out),
               TypeMismatch);
}

}  // namespace
}  // namespace ddprpc::rpc::internal
