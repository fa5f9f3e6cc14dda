#include "rpc/wire/codec.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/_neg_view.h>
#include <ATen/ops/imag.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/quantize_per_tensor.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sparse_coo_tensor.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/empty.h>

#include "gtest/gtest.h"
#include "rpc/core/value.h"

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

// The dtypes of mixed-precision training and of masks and quantized
// buffers keep their dtype and bits.
TEST(CodecTest, ReducedPrecisionAndByteDtypesKeepTheirBits) {
  const at::Tensor base = at::randn({6, 5});
  for (at::ScalarType type : {at::kBFloat16, at::kHalf, at::kByte, at::kChar, at::kBool}) {
    SCOPED_TRACE(c10::toString(type));
    at::Tensor t = (base * 50).to(type);
    at::Tensor view = t.t();  // and a non-contiguous view of it
    auto back = from_ivalue<std::vector<at::Tensor>>(
        round_trip(to_ivalue(std::vector<at::Tensor>{t, view})));
    ASSERT_EQ(back.size(), 2u);
    EXPECT_EQ(back[0].scalar_type(), type);
    EXPECT_EQ(back[1].scalar_type(), type);
    EXPECT_TRUE(at::equal(back[0], t));
    EXPECT_TRUE(at::equal(back[1], view));
    EXPECT_EQ(back[1].sizes(), view.sizes());
  }
}

TEST(CodecTest, ConjugateAndNegativeViewsTravelAsTheirValues) {
  at::Tensor z = at::randn({4}, at::kComplexFloat);
  at::Tensor conj = z.conj();  // a lazy view: z's bytes with the conjugate bit set
  ASSERT_TRUE(conj.is_conj());
  at::Tensor strided_neg = at::imag(conj);  // a strided view with the negative bit set
  ASSERT_TRUE(strided_neg.is_neg());
  at::Tensor neg = at::_neg_view(at::randn({5}));  // contiguous, negative bit set
  ASSERT_TRUE(neg.is_neg() && neg.is_contiguous());
  auto back = from_ivalue<std::vector<at::Tensor>>(
      round_trip(to_ivalue(std::vector<at::Tensor>{conj, strided_neg, neg})));
  ASSERT_EQ(back.size(), 3u);
  EXPECT_FALSE(back[0].is_conj());
  EXPECT_TRUE(at::equal(back[0], conj.resolve_conj()));
  EXPECT_TRUE(at::equal(back[1], strided_neg.resolve_neg()));
  EXPECT_FALSE(back[2].is_neg());
  EXPECT_TRUE(at::equal(back[2], neg.resolve_neg()));
}

TEST(CodecTest, ContiguousViewsTravelFromTheirOffset) {
  at::Tensor base = at::arange(24, at::kFloat).reshape({4, 6});
  at::Tensor row = base[2];                 // contiguous, storage offset 12
  at::Tensor rows = base.slice(0, 1, 3);    // contiguous, offset 6, 2 x 6
  at::Tensor leaf = at::randn({3}).requires_grad_(true);
  at::Tensor grown = leaf.mul(2).contiguous();  // contiguous, with a grad_fn
  auto back = from_ivalue<std::vector<at::Tensor>>(
      round_trip(to_ivalue(std::vector<at::Tensor>{row, rows, grown})));
  ASSERT_EQ(back.size(), 3u);
  EXPECT_TRUE(at::equal(back[0], row));
  EXPECT_TRUE(at::equal(back[1], rows));
  EXPECT_EQ(back[1].sizes(), rows.sizes());
  EXPECT_TRUE(back[2].requires_grad());
  EXPECT_EQ(back[2].grad_fn(), nullptr);  // a leaf on this side, not the sender's graph
  EXPECT_TRUE(at::equal(back[2].detach(), grown.detach()));
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

TEST(CodecTest, LentTensorsLeaveTheFrameAndAreRefusedUnlessAccepted) {
  at::Tensor big = at::arange(1 << 16, at::kFloat);
  at::Tensor small = at::arange(4, at::kFloat);
  Frame out;
  encode_value(c10::IValue(std::vector<at::Tensor>{big, small}), out.header.mutable_payload(),
               &out);
  const uint64_t whole = out.size();
  out.header.mutable_tensors(0)->set_lent(7);
  EXPECT_LE(out.size(), whole - big.nbytes() + 11);  // the id's field, at most 11 bytes
  EXPECT_EQ(out.lent_bytes(), big.nbytes());
  grpc::ByteBuffer bytes = serialize_frame(out);
  EXPECT_EQ(bytes.Length(), out.size());

  Frame plain;
  absl::Status refused = parse_frame(bytes, &plain);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.ToString().find("lent"), std::string::npos) << refused;

  Frame in;
  absl::Status parsed = parse_frame(bytes, &in, ParseOptions{/*accept_lent=*/true});
  ASSERT_TRUE(parsed.ok()) << parsed;
  ASSERT_EQ(in.tensors.size(), 2u);
  EXPECT_FALSE(in.tensors[0].defined());  // for the transport to pull
  EXPECT_EQ(in.header.tensors(0).lent(), 7u);
  EXPECT_TRUE(at::equal(in.tensors[1], small));
  at::Tensor filled = allocate_tensor(in.header.tensors(0));
  EXPECT_EQ(filled.sizes(), big.sizes());
  EXPECT_EQ(filled.scalar_type(), big.scalar_type());

  // A lent tensor's metadata is checked as any other's.
  Frame lying = out;
  lying.header.mutable_tensors(0)->set_nbytes(big.nbytes() + 4);
  Frame bad;
  EXPECT_FALSE(parse_frame(serialize_frame(lying), &bad, ParseOptions{true}).ok());
  // A lent tensor of no dtype is refused.
  Frame undefined_lent = out;
  undefined_lent.header.mutable_tensors(0)->set_dtype(-1);
  undefined_lent.header.mutable_tensors(0)->clear_sizes();
  undefined_lent.header.mutable_tensors(0)->set_nbytes(0);
  Frame bad2;
  EXPECT_FALSE(parse_frame(serialize_frame(undefined_lent), &bad2, ParseOptions{true}).ok());
  // A lent tensor may say it is pushed; one that is not lent may not.
  Frame pushed = out;
  pushed.header.mutable_tensors(0)->set_pushed(3);
  Frame in_pushed;
  ASSERT_TRUE(parse_frame(serialize_frame(pushed), &in_pushed, ParseOptions{true}).ok());
  EXPECT_EQ(in_pushed.header.tensors(0).pushed(), 3u);
  Frame pushed_inline = pushed;
  pushed_inline.header.mutable_tensors(1)->set_pushed(1);
  Frame bad3;
  absl::Status not_lent = parse_frame(serialize_frame(pushed_inline), &bad3, ParseOptions{true});
  EXPECT_FALSE(not_lent.ok());
  EXPECT_NE(not_lent.ToString().find("pushed but not lent"), std::string::npos) << not_lent;
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

// A frame with `header` and `body` bytes after it, as a peer could send it.
std::string raw_frame(const wire::Header& header, const std::string& body = "") {
  std::string head = header.SerializeAsString();
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((head.size() >> (8 * i)) & 0xff);
  return out + head + body;
}

absl::Status parse_raw(const std::string& bytes, Frame* frame) {
  return parse_frame(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), frame);
}

// A header carrying one tensor argument with this metadata.
wire::Header one_tensor(int32_t dtype, std::vector<int64_t> sizes, uint64_t nbytes) {
  wire::Header h;
  h.set_kind(wire::REQUEST);
  h.mutable_payload()->mutable_tuple()->add_items()->set_tensor(0);
  auto* meta = h.add_tensors();
  meta->set_dtype(dtype);
  for (int64_t s : sizes) meta->add_sizes(s);
  meta->set_nbytes(nbytes);
  return h;
}

TEST(CodecTest, TensorMetadataIsCheckedBeforeAnythingIsAllocated) {
  Frame frame;
  // The bytes of a valid 2-float tensor follow each header below.
  const std::string body(8, '\0');
  absl::Status s;
  EXPECT_TRUE(parse_raw(raw_frame(one_tensor(6 /*Float*/, {2}, 8), body), &frame).ok());
  // Undefined (18), quantized (12), out-of-range and negative dtypes.
  for (int32_t dtype : {18, 12, 13, 14, 16, 17, 8, 19, 99, -5, 1 << 30}) {
    s = parse_raw(raw_frame(one_tensor(dtype, {2}, 8), body), &frame);
    EXPECT_FALSE(s.ok()) << "dtype " << dtype;
    EXPECT_NE(s.message().find("dtype"), std::string::npos) << s;
  }
  // Shapes whose element count, or byte count, wraps 64 bits.
  EXPECT_FALSE(parse_raw(raw_frame(one_tensor(6, {int64_t{1} << 32, int64_t{1} << 32, 4}, 0), ""),
                         &frame).ok());
  EXPECT_FALSE(parse_raw(raw_frame(one_tensor(6, {int64_t{1} << 62}, 0), ""), &frame).ok());
  EXPECT_FALSE(parse_raw(raw_frame(one_tensor(6, {int64_t{1} << 61}, 0), ""), &frame).ok());
  EXPECT_FALSE(parse_raw(raw_frame(one_tensor(6, {-2, -4}, 32), std::string(32, '\0')), &frame).ok());
  // No elements (a zero size), but the other sizes' product, libtorch's
  // contiguous strides, wraps 63 bits; a zero among sizes whose product fits is fine.
  s = parse_raw(raw_frame(one_tensor(6, {0, int64_t{1} << 32, int64_t{1} << 32}, 0), ""), &frame);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("too many elements"), std::string::npos) << s;
  EXPECT_TRUE(parse_raw(raw_frame(one_tensor(6, {0, int64_t{1} << 30, 4}, 0), ""), &frame).ok());
  // Byte counts that disagree with the shape or with the bytes present.
  EXPECT_FALSE(parse_raw(raw_frame(one_tensor(6, {2}, 4), std::string(4, '\0')), &frame).ok());
  EXPECT_FALSE(parse_raw(raw_frame(one_tensor(6, {4}, 16), body), &frame).ok());
  EXPECT_FALSE(parse_raw(raw_frame(one_tensor(6, {1 << 30}, uint64_t{4} << 30), body), &frame).ok());
  // Too many dimensions, too many tensors.
  EXPECT_FALSE(parse_raw(raw_frame(one_tensor(6, std::vector<int64_t>(kMaxTensorDims + 1, 1), 4),
                                   std::string(4, '\0')),
                         &frame).ok());
  wire::Header many;
  for (int i = 0; i <= kMaxTensorsPerFrame; ++i) many.add_tensors()->set_dtype(6);
  s = parse_raw(raw_frame(many), &frame);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("tensors"), std::string::npos) << s;
  // A header size prefix beyond the frame.
  EXPECT_FALSE(parse_raw(std::string("\xff\xff\xff\xff", 4) + "abc", &frame).ok());
  // An undefined tensor carries no shape or bytes.
  EXPECT_FALSE(parse_raw(raw_frame(one_tensor(-1, {2}, 8), body), &frame).ok());
  EXPECT_TRUE(parse_raw(raw_frame(one_tensor(-1, {}, 0)), &frame).ok());
}

TEST(CodecTest, MalformedValuesAreRejected) {
  Frame frame;
  ASSERT_TRUE(parse_raw(raw_frame(one_tensor(6, {2}, 8), std::string(8, '\0')), &frame).ok());
  // The same tensor referenced twice.
  wire::Value twice;
  twice.mutable_tuple()->add_items()->set_tensor(0);
  twice.mutable_tuple()->add_items()->set_tensor(0);
  EXPECT_THROW(decode_value(twice, frame), std::invalid_argument);
  // Typed lists whose items are of another kind.
  wire::Value ints;
  ints.mutable_int_list()->add_items()->set_s("not an int");
  EXPECT_THROW(decode_value(ints, frame), std::invalid_argument);
  wire::Value tensors;
  tensors.mutable_tensor_list()->add_items()->set_i(0);
  EXPECT_THROW(decode_value(tensors, frame), std::invalid_argument);
  // An extension value with nothing to decode it.
  wire::Value ext;
  ext.mutable_ext()->set_type("rref");
  EXPECT_THROW(decode_value(ext, frame), std::invalid_argument);
  // Nesting deeper than the limit, built directly.
  wire::Value deep;
  wire::Value* at = &deep;
  for (int i = 0; i < kMaxValueDepth + 1; ++i) at = at->mutable_list()->add_items();
  at->set_i(1);
  EXPECT_THROW(decode_value(deep, frame), std::invalid_argument);
}

TEST(CodecTest, ValuesThatCouldNotBeReceivedAreNotSent) {
  Frame out;
  at::Tensor quantized = at::quantize_per_tensor(at::ones({2}), 0.1, 0, at::kQInt8);
  EXPECT_THROW(encode_value(c10::IValue(quantized), out.header.mutable_payload(), &out),
               TypeMismatch);
  // Nested deeper than a receiver accepts.
  c10::IValue v(int64_t{1});
  for (int i = 0; i < kMaxValueDepth; ++i) {
    v = c10::IValue(c10::ivalue::Tuple::create(std::vector<c10::IValue>{v}));
  }
  Frame deep;
  EXPECT_THROW(encode_value(v, deep.header.mutable_payload(), &deep), TypeMismatch);
  // One level less round-trips.
  c10::IValue ok(int64_t{1});
  for (int i = 0; i < kMaxValueDepth - 1; ++i) {
    ok = c10::IValue(c10::ivalue::Tuple::create(std::vector<c10::IValue>{ok}));
  }
  c10::IValue back = round_trip(ok);
  for (int i = 0; i < kMaxValueDepth - 1; ++i) back = back.toTupleRef().elements()[0];
  EXPECT_EQ(back.toInt(), 1);
}

// A header whose bytes would parse into many times as many in memory is
// refused before protobuf parses it; one as large that stays within the
// bound parses.
TEST(CodecTest, HeadersPastTheFieldBoundAreRefusedBeforeTheyAreParsed) {
  Frame frame;
  // A tensor entry whose sizes (a packed list, a byte each) would take 8
  // bytes each once parsed.
  wire::Header packed = one_tensor(static_cast<int32_t>(at::kFloat), {}, 4);
  for (int64_t i = 0; i < kMaxHeaderFields; ++i) packed.mutable_tensors(0)->add_sizes(1);
  absl::Status s = parse_raw(raw_frame(packed, std::string(4, '\0')), &frame);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("more than 4194304 fields"), std::string::npos) << s;
  // Empty tensor entries, two bytes each on the wire.
  wire::Header entries;
  for (int64_t i = 0; i <= kMaxHeaderFields; ++i) entries.add_tensors();
  s = parse_raw(raw_frame(entries), &frame);
  EXPECT_NE(s.message().find("more than 4194304 fields"), std::string::npos) << s;
  // Header bytes behind their size prefix.
  auto framed = [](const std::string& header) {
    std::string out(4, '\0');
    for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
    return out + header;
  };
  // Fields the receiver does not know count too (protobuf keeps them):
  // field 99, varint 0, three bytes each.
  std::string unknown;
  for (int64_t i = 0; i <= kMaxHeaderFields; ++i) unknown += std::string("\x98\x06\x00", 3);
  s = parse_raw(framed(unknown), &frame);
  EXPECT_NE(s.message().find("more than 4194304 fields"), std::string::npos) << s;
  // A field cut short inside a large header.
  s = parse_raw(framed(packed.SerializeAsString().substr(0, 200000)), &frame);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("does not parse"), std::string::npos) << s;

  // The sender refuses what a receiver would: a list past the bound (each
  // int a value and its field)...
  Frame out;
  c10::List<int64_t> many(std::vector<int64_t>(kMaxHeaderFields / 2, 7));
  EXPECT_THROW(encode_value(c10::IValue(many), out.header.mutable_payload(), &out), TypeMismatch);
  // ... and sends, and a receiver takes, one within it.
  c10::List<int64_t> fewer(std::vector<int64_t>(kMaxHeaderFields / 4, 7));
  c10::IValue back = round_trip(c10::IValue(fewer));
  ASSERT_TRUE(back.isIntList());
  EXPECT_EQ(back.toIntList().size(), fewer.size());
  EXPECT_EQ(back.toIntList().get(12345), 7);
  // At the bound, whatever the sender sends (with the fields written after
  // the value: an id, the framing's flag) the receiver takes, and the
  // sender refuses the next sizes.
  int sent = 0;
  for (int64_t n = kMaxHeaderFields / 2 - 6; n < kMaxHeaderFields / 2 - 3; ++n) {
    Frame at_bound;
    try {
      encode_value(c10::IValue(c10::List<int64_t>(std::vector<int64_t>(n, 7))),
                   at_bound.header.mutable_payload(), &at_bound);
    } catch (const TypeMismatch&) {
      continue;
    }
    ++sent;
    at_bound.header.set_id(123456789);
    at_bound.header.set_src(3);
    at_bound.header.set_kind(wire::REQUEST);
    at_bound.more_in_flight = true;
    Frame in;
    const absl::Status parsed = parse_frame(serialize_frame(at_bound), &in);
    EXPECT_TRUE(parsed.ok()) << n << " ints: " << parsed;
  }
  EXPECT_GT(sent, 0);
  EXPECT_LT(sent, 3);
}

// A sparse COO tensor from int64 indices [sparse dims, nnz] and values.
at::Tensor coo(std::vector<int64_t> idx, int64_t sparse_dims, at::Tensor values,
               std::vector<int64_t> sizes) {
  const int64_t nnz = static_cast<int64_t>(idx.size()) / sparse_dims;
  at::Tensor indices = at::tensor(idx, at::kLong).view({sparse_dims, nnz});
  return at::sparse_coo_tensor(indices, values, sizes);
}

TEST(CodecTest, SparseCooTensorsRoundTrip) {
  // 2 sparse dims, 1 dense dim, an index repeated (uncoalesced), grad.
  at::Tensor a = coo({0, 2, 2, 1, 3, 3}, 2, at::randn({3, 4}), {3, 5, 4}).requires_grad_(true);
  at::Tensor empty = coo({}, 1, at::empty({0}), {1000000});  // no element set, 1M rows
  at::Tensor ints = coo({4, 0}, 1, at::tensor(std::vector<int64_t>{7, -1}, at::kLong), {5});
  auto back = ValueTraits<std::vector<at::Tensor>>::from_ivalue(
      round_trip(to_ivalue(std::vector<at::Tensor>{a, empty, ints, at::ones({2})})));
  ASSERT_EQ(back.size(), 4u);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(back[i].is_sparse()) << i;
  EXPECT_TRUE(at::equal(back[0].to_dense(), a.detach().to_dense()));
  EXPECT_TRUE(back[0].requires_grad());
  EXPECT_EQ(back[0].sizes(), a.sizes());
  EXPECT_EQ(back[1].sizes(), at::IntArrayRef({1000000}));
  EXPECT_EQ(back[1]._nnz(), 0);
  EXPECT_TRUE(at::equal(back[2].to_dense(), ints.to_dense()));
  EXPECT_FALSE(back[2].requires_grad());
  EXPECT_FALSE(back[3].is_sparse());
}

TEST(CodecTest, MalformedSparseTensorsAreRejected) {
  // Frames carrying indices (tensor 0) and values (tensor 1) as given.
  auto frame_of = [](const at::Tensor& indices, const at::Tensor& values) {
    Frame out;
    encode_value(to_ivalue(std::vector<at::Tensor>{indices, values}), out.header.mutable_payload(),
                 &out);
    Frame in;
    EXPECT_TRUE(parse_frame(serialize_frame(out), &in).ok());
    return in;
  };
  auto sparse = [](std::vector<int64_t> sizes, uint32_t indices = 0, uint32_t values = 1) {
    wire::Value v;
    v.mutable_sparse_coo()->set_indices(indices);
    v.mutable_sparse_coo()->set_values(values);
    for (int64_t s : sizes) v.mutable_sparse_coo()->add_sizes(s);
    return v;
  };
  const at::Tensor idx = at::tensor(std::vector<int64_t>{0, 3, 1}, at::kLong).view({1, 3});
  const at::Tensor vals = at::ones({3, 2});
  // Well formed: decodes.
  Frame ok = frame_of(idx, vals);
  EXPECT_TRUE(decode_value(sparse({4, 2}), ok).toTensor().is_sparse());
  // An index outside its dimension, negative or past the end.
  EXPECT_THROW(decode_value(sparse({3, 2}), frame_of(idx, vals)), std::invalid_argument);
  EXPECT_THROW(decode_value(sparse({4, 2}), frame_of(at::tensor(std::vector<int64_t>{0, -1, 1}, at::kLong).view({1, 3}), vals)), std::invalid_argument);
  // Sizes that do not match the values, too many or too few of them, negative.
  EXPECT_THROW(decode_value(sparse({4, 3}), frame_of(idx, vals)), std::invalid_argument);
  EXPECT_THROW(decode_value(sparse({4}), frame_of(idx, vals)), std::invalid_argument);
  EXPECT_THROW(decode_value(sparse({4, 2, 1}), frame_of(idx, vals)), std::invalid_argument);
  EXPECT_THROW(decode_value(sparse({-4, 2}), frame_of(idx, vals)), std::invalid_argument);
  // More values than indices; float indices; 1-D indices.
  EXPECT_THROW(decode_value(sparse({4, 2}), frame_of(idx, at::ones({4, 2}))), std::invalid_argument);
  EXPECT_THROW(decode_value(sparse({4, 2}), frame_of(idx.to(at::kFloat), vals)), std::invalid_argument);
  EXPECT_THROW(decode_value(sparse({4, 2}), frame_of(idx.view({3}), vals)), std::invalid_argument);
  // Element counts that overflow; a tensor index out of range or used twice.
  EXPECT_THROW(decode_value(sparse({int64_t{1} << 62, 2}), frame_of(idx, at::ones({3, 2}))),
               std::invalid_argument);
  EXPECT_THROW(decode_value(sparse({4, 2}, 0, 7), frame_of(idx, vals)), std::invalid_argument);
  EXPECT_THROW(decode_value(sparse({4, 2}, 0, 0), frame_of(idx, vals)), std::invalid_argument);
}

TEST(CodecTest, UnsupportedValuesThrowTypeMismatch) {
  c10::Dict<std::string, int64_t> dict;
  Frame out;
  EXPECT_THROW(encode_value(c10::IValue(dict), out.header.mutable_payload(), &out),
               TypeMismatch);
}

}  // namespace
}  // namespace ddprpc::rpc::internal
