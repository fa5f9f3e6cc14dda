#include "rpc/internal/codec.h"

#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>

#include <cstring>
#include <memory>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "rpc/value.h"

namespace ddprpc::rpc::internal {
namespace {

constexpr int32_t kUndefinedTensor = -1;

void encode_tensor(const at::Tensor& tensor, wire::Value* out, Frame* frame) {
  auto* meta = frame->header.add_tensors();
  out->set_tensor(static_cast<uint32_t>(frame->tensors.size()));
  if (!tensor.defined()) {
    meta->set_dtype(kUndefinedTensor);
    frame->tensors.emplace_back();
    return;
  }
  if (tensor.layout() != c10::kStrided) {
    throw TypeMismatch("only dense (strided) tensors can be sent, got layout " +
                       c10::str(tensor.layout()));
  }
  at::Tensor data = tensor.detach();
  if (!data.device().is_cpu()) data = data.cpu();
  data = data.contiguous();
  meta->set_dtype(static_cast<int32_t>(data.scalar_type()));
  for (int64_t s : data.sizes()) meta->add_sizes(s);
  meta->set_nbytes(data.numel() * data.element_size());
  meta->set_requires_grad(tensor.requires_grad());
  frame->tensors.push_back(std::move(data));
}

void encode_list(const c10::List<c10::IValue>& items, wire::Value::List* out, Frame* frame,
                 const CodecContext& ctx) {
  for (const c10::IValue& item : items) encode_value(item, out->add_items(), frame, ctx);
}

}  // namespace

uint64_t Frame::size() const {
  uint64_t n = 4 + header.ByteSizeLong();
  for (const auto& meta : header.tensors()) n += meta.nbytes();
  return n;
}

void encode_value(const c10::IValue& v, wire::Value* out, Frame* frame, const CodecContext& ctx) {
  if (v.isNone()) {
    out->set_none(true);
  } else if (v.isBool()) {
    out->set_b(v.toBool());
  } else if (v.isInt()) {
    out->set_i(v.toInt());
  } else if (v.isDouble()) {
    out->set_d(v.toDouble());
  } else if (v.isString()) {
    out->set_s(v.toStringRef());
  } else if (v.isTensor()) {
    encode_tensor(v.toTensor(), out, frame);
  } else if (v.isTuple()) {
    auto* list = out->mutable_tuple();
    for (const c10::IValue& item : v.toTupleRef().elements()) {
      encode_value(item, list->add_items(), frame, ctx);
    }
  } else if (v.isIntList()) {
    auto* list = out->mutable_int_list();
    for (int64_t i : v.toIntList()) list->add_items()->set_i(i);
  } else if (v.isDoubleList()) {
    auto* list = out->mutable_double_list();
    for (double d : v.toDoubleList()) list->add_items()->set_d(d);
  } else if (v.isBoolList()) {
    auto* list = out->mutable_bool_list();
    for (bool b : v.toBoolList()) list->add_items()->set_b(b);
  } else if (v.isTensorList()) {
    auto* list = out->mutable_tensor_list();
    for (const at::Tensor& t : v.toTensorList()) encode_tensor(t, list->add_items(), frame);
  } else if (v.isList()) {
    const auto list = v.toList();
    bool all_strings = !list.empty();
    for (const c10::IValue& item : list) all_strings = all_strings && item.isString();
    encode_list(list, all_strings ? out->mutable_string_list() : out->mutable_list(), frame, ctx);
  } else if (v.isCapsule() && ctx.ext) {
    ctx.ext->encode(v, ctx.peer, out->mutable_ext());
  } else {
    throw TypeMismatch("values of type " + ivalue_type_name(v) +
                       " cannot be sent over RPC");
  }
}

namespace {

template <typename T, typename Get>
c10::IValue decode_typed_list(const wire::Value::List& list, Get get) {
  c10::List<T> out;
  out.reserve(list.items_size());
  for (const auto& item : list.items()) out.push_back(get(item));
  return c10::IValue(std::move(out));
}

const at::Tensor& tensor_at(const Frame& frame, uint32_t index) {
  if (index >= frame.tensors.size()) {
    throw std::invalid_argument(absl::StrCat("tensor index ", index, " out of range (",
                                             frame.tensors.size(), " tensors)"));
  }
  return frame.tensors[index];
}

}  // namespace

c10::IValue decode_value(const wire::Value& v, const Frame& frame, const CodecContext& ctx) {
  switch (v.kind_case()) {
    case wire::Value::kNone:
      return c10::IValue();
    case wire::Value::kB:
      return c10::IValue(v.b());
    case wire::Value::kI:
      return c10::IValue(v.i());
    case wire::Value::kD:
      return c10::IValue(v.d());
    case wire::Value::kS:
      return c10::IValue(v.s());
    case wire::Value::kTensor:
      return c10::IValue(tensor_at(frame, v.tensor()));
    case wire::Value::kTuple: {
      std::vector<c10::IValue> elems;
      elems.reserve(v.tuple().items_size());
      for (const auto& item : v.tuple().items()) elems.push_back(decode_value(item, frame, ctx));
      return c10::IValue(c10::ivalue::Tuple::create(std::move(elems)));
    }
    case wire::Value::kIntList:
      return decode_typed_list<int64_t>(v.int_list(), [](const wire::Value& x) { return x.i(); });
    case wire::Value::kDoubleList:
      return decode_typed_list<double>(v.double_list(), [](const wire::Value& x) { return x.d(); });
    case wire::Value::kBoolList:
      return decode_typed_list<bool>(v.bool_list(), [](const wire::Value& x) { return x.b(); });
    case wire::Value::kStringList:
      return decode_typed_list<std::string>(v.string_list(),
                                            [](const wire::Value& x) { return x.s(); });
    case wire::Value::kTensorList:
      return decode_typed_list<at::Tensor>(
          v.tensor_list(), [&](const wire::Value& x) { return tensor_at(frame, x.tensor()); });
    case wire::Value::kList: {
      c10::impl::GenericList out(c10::AnyType::get());
      out.reserve(v.list().items_size());
      for (const auto& item : v.list().items()) out.push_back(decode_value(item, frame, ctx));
      return c10::IValue(std::move(out));
    }
    case wire::Value::kExt:
      if (!ctx.ext) throw std::invalid_argument("extension value '" + v.ext().type() + "' unexpected here");
      return ctx.ext->decode(v.ext(), ctx.peer);
    case wire::Value::KIND_NOT_SET:
      break;
  }
  throw std::invalid_argument("malformed value: no kind set");
}

namespace {

void release_tensor(void* tensor) { delete static_cast<at::Tensor*>(tensor); }

// Reads consecutive bytes across the slices of a ByteBuffer.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const auto& s : slices) remaining_ += s.size();
  }
  uint64_t remaining() const { return remaining_; }
  bool read(void* dst, uint64_t n) {
    if (n > remaining_) return false;
    auto* out = static_cast<uint8_t*>(dst);
    while (n > 0) {
      const grpc::Slice& s = slices_[index_];
      uint64_t take = std::min<uint64_t>(n, s.size() - offset_);
      std::memcpy(out, s.begin() + offset_, take);
      out += take;
      n -= take;
      remaining_ -= take;
      offset_ += take;
      if (offset_ == s.size()) {
        ++index_;
        offset_ = 0;
      }
    }
    return true;
  }

 private:
  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  uint64_t offset_ = 0;
  uint64_t remaining_ = 0;
};

}  // namespace

grpc::ByteBuffer serialize_frame(const Frame& frame) {
  const uint32_t header_size = static_cast<uint32_t>(frame.header.ByteSizeLong());
  std::string head(4 + header_size, '\0');
  for (int i = 0; i < 4; ++i) head[i] = static_cast<char>((header_size >> (8 * i)) & 0xff);
  frame.header.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(head.data() + 4));

  std::vector<grpc::Slice> slices;
  slices.reserve(1 + frame.tensors.size());
  slices.emplace_back(head);
  for (const at::Tensor& t : frame.tensors) {
    if (!t.defined() || t.numel() == 0) continue;
    // The slice keeps the tensor (and so its memory) alive until gRPC is done.
    slices.emplace_back(t.data_ptr(), t.numel() * t.element_size(), &release_tensor,
                        new at::Tensor(t));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

absl::Status parse_frame(const grpc::ByteBuffer& buffer, Frame* frame) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return absl::DataLossError("unreadable byte buffer");
  SliceReader reader(slices);
  uint8_t size_bytes[4];
  if (!reader.read(size_bytes, 4)) return absl::DataLossError("frame shorter than its size prefix");
  const uint32_t header_size = size_bytes[0] | (size_bytes[1] << 8) | (size_bytes[2] << 16) |
                               (static_cast<uint32_t>(size_bytes[3]) << 24);
  if (header_size > reader.remaining()) {
    return absl::DataLossError(absl::StrCat("frame header of ", header_size,
                                            " bytes exceeds the frame (", reader.remaining(),
                                            " bytes left)"));
  }
  std::string head(header_size, '\0');
  reader.read(head.data(), header_size);
  if (!frame->header.ParseFromString(head)) return absl::DataLossError("frame header does not parse");

  frame->tensors.clear();
  frame->tensors.reserve(frame->header.tensors_size());
  for (const auto& meta : frame->header.tensors()) {
    if (meta.dtype() == kUndefinedTensor) {
      frame->tensors.emplace_back();
      continue;
    }
    if (meta.dtype() < 0 || meta.dtype() >= static_cast<int>(c10::ScalarType::NumOptions)) {
      return absl::DataLossError(absl::StrCat("unknown tensor dtype ", meta.dtype()));
    }
    auto dtype = static_cast<c10::ScalarType>(meta.dtype());
    uint64_t numel = 1;
    for (int64_t s : meta.sizes()) {
      if (s < 0) return absl::DataLossError("negative tensor size");
      numel *= static_cast<uint64_t>(s);
    }
    if (numel * c10::elementSize(dtype) != meta.nbytes() || meta.nbytes() > reader.remaining()) {
      return absl::DataLossError(absl::StrCat("tensor of ", meta.nbytes(),
                                              " bytes does not match its shape or the frame"));
    }
    at::Tensor t = at::empty(std::vector<int64_t>(meta.sizes().begin(), meta.sizes().end()),
                             at::TensorOptions().dtype(dtype));
    reader.read(t.data_ptr(), meta.nbytes());
    if (meta.requires_grad() && at::isFloatingType(dtype)) t.requires_grad_(true);
    frame->tensors.push_back(std::move(t));
  }
  if (reader.remaining() != 0) {
    return absl::DataLossError(absl::StrCat(reader.remaining(), " trailing bytes after the frame"));
  }
  return absl::OkStatus();
}

}  // namespace ddprpc::rpc::internal
