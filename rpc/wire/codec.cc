#include "rpc/wire/codec.h"

#include <ATen/ops/_sparse_coo_tensor_unsafe.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/ScalarType.h>
#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "rpc/core/value.h"

namespace ddprpc::rpc::internal {
namespace {

constexpr int32_t kUndefinedTensor = -1;

void encode_tensor(const at::Tensor& tensor, wire::Value* out, Frame* frame) {
  if (frame->tensors.size() >= static_cast<size_t>(kMaxTensorsPerFrame)) {
    throw TypeMismatch(absl::StrCat("a message may carry at most ", kMaxTensorsPerFrame,
                                    " tensors"));
  }
  auto* meta = frame->header.add_tensors();
  out->set_tensor(static_cast<uint32_t>(frame->tensors.size()));
  if (!tensor.defined()) {
    meta->set_dtype(kUndefinedTensor);
    frame->tensors.emplace_back();
    return;
  }
  if (tensor.layout() == c10::kSparse) {
    // Its indices and values go as two dense tensors (the slot reserved
    // above stays empty, as for an undefined tensor).
    meta->set_dtype(kUndefinedTensor);
    frame->tensors.emplace_back();
    if (tensor.dim() > kMaxTensorDims) {
      throw TypeMismatch(absl::StrCat("tensors of more than ", kMaxTensorDims,
                                      " dimensions cannot be sent"));
    }
    at::Tensor data = tensor.detach();
    if (!data.device().is_cpu()) data = data.cpu();
    wire::Value indices, values;
    encode_tensor(data._indices(), &indices, frame);
    encode_tensor(data._values(), &values, frame);
    wire::SparseCoo* coo = out->mutable_sparse_coo();
    coo->set_indices(indices.tensor());
    coo->set_values(values.tensor());
    for (int64_t s : data.sizes()) coo->add_sizes(s);
    coo->set_requires_grad(tensor.requires_grad());
    return;
  }
  if (tensor.layout() != c10::kStrided) {
    throw TypeMismatch("only dense (strided) and sparse COO tensors can be sent, got layout " +
                       c10::str(tensor.layout()));
  }
  if (!sendable_dtype(static_cast<int32_t>(tensor.scalar_type()))) {
    throw TypeMismatch(std::string("tensors of dtype ") + c10::toString(tensor.scalar_type()) +
                       " cannot be sent");
  }
  if (tensor.dim() > kMaxTensorDims) {
    throw TypeMismatch(absl::StrCat("tensors of more than ", kMaxTensorDims,
                                    " dimensions cannot be sent"));
  }
  // Only its bytes travel. A CPU tensor laid out as they go, whose bytes
  // are its values, is held as it is (no new tensor); any other (a lazy
  // conjugate or negative view among them) is detached and copied into
  // that layout with its values.
  at::Tensor data = tensor;
  if (!data.device().is_cpu() || !data.is_contiguous() || data.is_conj() || data.is_neg()) {
    data = tensor.detach();
    if (!data.device().is_cpu()) data = data.cpu();
    data = data.resolve_conj().resolve_neg().contiguous();
  }
  meta->set_dtype(static_cast<int32_t>(data.scalar_type()));
  for (int64_t s : data.sizes()) meta->add_sizes(s);
  meta->set_nbytes(data.numel() * data.element_size());
  meta->set_requires_grad(tensor.requires_grad());
  frame->tensors.push_back(std::move(data));
}

// The codec of the extension that claims capsule `v`, or nullptr.
const ExtensionCodec* codec_of(const c10::IValue& v, const CodecContext& ctx) {
  if (!ctx.extensions) return nullptr;
  for (const ExtensionCodec& codec : *ctx.extensions) {
    if (codec.claims_capsule(v)) return &codec;
  }
  return nullptr;
}

void encode_at(const c10::IValue& v, wire::Value* out, Frame* frame, const CodecContext& ctx,
               int depth);

void encode_list(const c10::List<c10::IValue>& items, wire::Value::List* out, Frame* frame,
                 const CodecContext& ctx, int depth) {
  for (const c10::IValue& item : items) encode_at(item, out->add_items(), frame, ctx, depth + 1);
}

void encode_at(const c10::IValue& v, wire::Value* out, Frame* frame, const CodecContext& ctx,
               int depth) {
  if (depth >= kMaxValueDepth) {
    throw TypeMismatch(absl::StrCat("values nested more than ", kMaxValueDepth,
                                    " deep cannot be sent over RPC"));
  }
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
      encode_at(item, list->add_items(), frame, ctx, depth + 1);
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
    encode_list(list, all_strings ? out->mutable_string_list() : out->mutable_list(), frame, ctx,
                depth);
  } else if (const ExtensionCodec* codec = v.isCapsule() ? codec_of(v, ctx) : nullptr) {
    codec->encode_capsule(v, ctx.peer, out->mutable_ext());
  } else {
    throw TypeMismatch("values of type " + ivalue_type_name(v) +
                       " cannot be sent over RPC");
  }
}

// Headers up to this size are parsed without counting their fields: at a
// byte or more each, they hold at most 65536.
constexpr size_t kCountedHeaderBytes = 64 << 10;
// Fields of a header written after its value is encoded, besides two per
// tensor (see check_header_fields).
constexpr int64_t kFieldsWrittenLater = 8;
// Nesting of messages a header count follows (protobuf parses 100).
constexpr int kMaxCountedDepth = 100;

// The fields of `m` as kMaxHeaderFields counts them: one per field written
// (each item of a repeated message field, each string of a repeated
// string), its messages' fields, and one per element of a packed list.
int64_t header_fields(const google::protobuf::Message& m) {
  const google::protobuf::Reflection* r = m.GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  int64_t n = 0;
  for (const google::protobuf::FieldDescriptor* f : fields) {
    const bool message = f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE;
    if (!f->is_repeated()) {
      n += 1 + (message ? header_fields(r->GetMessage(m, f)) : 0);
    } else if (message) {
      for (int i = 0; i < r->FieldSize(m, f); ++i) {
        n += 1 + header_fields(r->GetRepeatedMessage(m, f, i));
      }
    } else {
      n += r->FieldSize(m, f) + (f->is_packed() ? 1 : 0);
    }
  }
  return n;
}

// Throws TypeMismatch when `frame`'s header would pass kMaxHeaderFields at a
// receiver.
void check_header_fields(const Frame& frame) {
  if (frame.header.ByteSizeLong() > kCountedHeaderBytes) {
    // With room for what is written after the value: the header's id,
    // source, kind and error (the agent), the framing's more_in_flight, and
    // a bulk path's lent and pushed marks on each tensor.
    const int64_t fields =
        header_fields(frame.header) + kFieldsWrittenLater + 2 * frame.header.tensors_size();
    if (fields > kMaxHeaderFields) {
      throw TypeMismatch(absl::StrCat("a message may hold at most ", kMaxHeaderFields,
                                      " values, tensor sizes and other fields; this one would "
                                      "hold ", fields, " (send long lists as tensors)"));
    }
  }
}

bool read_varint(const uint8_t** p, const uint8_t* end, uint64_t* out) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64 && *p < end; shift += 7) {
    const uint8_t b = *(*p)++;
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) {
      *out = v;
      return true;
    }
  }
  return false;
}

enum class Count { kOk, kMalformed, kTooMany };

// Counts into `*fields`, as header_fields would count the message it
// parses into, the fields of `type` encoded in [p, end), without parsing
// them: fields unknown to `type` count one each (protobuf keeps them).
Count count_fields(const uint8_t* p, const uint8_t* end,
                   const google::protobuf::Descriptor* type, int depth, int64_t limit,
                   int64_t* fields) {
  using google::protobuf::FieldDescriptor;
  if (depth > kMaxCountedDepth) return Count::kMalformed;
  while (p < end) {
    uint64_t tag;
    if (!read_varint(&p, end, &tag)) return Count::kMalformed;
    const FieldDescriptor* field =
        tag >> 3 <= 0x1fffffff ? type->FindFieldByNumber(static_cast<int>(tag >> 3)) : nullptr;
    if (++*fields > limit) return Count::kTooMany;
    switch (tag & 7) {
      case 0: {
        uint64_t ignored;
        if (!read_varint(&p, end, &ignored)) return Count::kMalformed;
        break;
      }
      case 1:
        if (end - p < 8) return Count::kMalformed;
        p += 8;
        break;
      case 5:
        if (end - p < 4) return Count::kMalformed;
        p += 4;
        break;
      case 2: {
        uint64_t len;
        if (!read_varint(&p, end, &len) || len > static_cast<uint64_t>(end - p)) {
          return Count::kMalformed;
        }
        const uint8_t* body = p;
        p += len;
        if (field == nullptr) break;
        if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
          const Count c = count_fields(body, p, field->message_type(), depth + 1, limit, fields);
          if (c != Count::kOk) return c;
        } else if (field->is_repeated() && field->is_packable()) {
          switch (field->type()) {
            case FieldDescriptor::TYPE_DOUBLE:
            case FieldDescriptor::TYPE_FIXED64:
            case FieldDescriptor::TYPE_SFIXED64:
              *fields += static_cast<int64_t>(len / 8);
              break;
            case FieldDescriptor::TYPE_FLOAT:
            case FieldDescriptor::TYPE_FIXED32:
            case FieldDescriptor::TYPE_SFIXED32:
              *fields += static_cast<int64_t>(len / 4);
              break;
            default:  // varints: one per byte that ends one
              for (const uint8_t* b = body; b < p; ++b) *fields += (*b & 0x80) == 0;
          }
          if (*fields > limit) return Count::kTooMany;
        }
        break;
      }
      default:  // groups: never sent
        return Count::kMalformed;
    }
  }
  return Count::kOk;
}

}  // namespace

int64_t count_message_fields(absl::string_view bytes, const google::protobuf::Descriptor* type,
                             int64_t limit) {
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  int64_t fields = 0;
  return count_fields(p, p + bytes.size(), type, 0, limit, &fields) == Count::kOk ? fields : -1;
}

bool sendable_dtype(int32_t dtype) {
  // ScalarType is 8 bits wide: range-check before the cast.
  if (dtype < 0 || dtype >= static_cast<int32_t>(c10::ScalarType::NumOptions)) return false;
  switch (static_cast<c10::ScalarType>(dtype)) {
    case c10::ScalarType::Byte:
    case c10::ScalarType::Char:
    case c10::ScalarType::Short:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::Half:
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::ComplexFloat:
    case c10::ScalarType::ComplexDouble:
    case c10::ScalarType::Bool:
    case c10::ScalarType::BFloat16:
      return true;
    default:
      return false;
  }
}

namespace {
// Header.more_in_flight = true, appended to a serialized Header (protobuf
// takes the last value of a repeated scalar field).
constexpr char kMoreInFlight[] = {(10 << 3) | 0, 1};
}  // namespace

uint64_t Frame::size() const {
  uint64_t n = 4 + header.ByteSizeLong() + (more_in_flight ? sizeof(kMoreInFlight) : 0);
  for (const auto& meta : header.tensors()) n += meta.lent() == 0 ? meta.nbytes() : 0;
  return n;
}

uint64_t Frame::lent_bytes() const {
  uint64_t n = 0;
  for (const auto& meta : header.tensors()) n += meta.lent() != 0 ? meta.nbytes() : 0;
  return n;
}

at::Tensor allocate_tensor(const wire::TensorMeta& meta, const EmptyTensor& empty) {
  const auto dtype = static_cast<c10::ScalarType>(meta.dtype());
  const c10::IntArrayRef sizes(meta.sizes().data(), static_cast<size_t>(meta.sizes().size()));
  // Straight from the CPU allocator: a factory op through the dispatcher
  // costs more than the allocation for a small tensor.
  at::Tensor t = empty ? empty(dtype, sizes) : at::detail::empty_cpu(sizes, dtype);
  if (meta.requires_grad() && (at::isFloatingType(dtype) || at::isComplexType(dtype))) {
    t.requires_grad_(true);  // writing its bytes through data_ptr() afterwards is fine
  }
  return t;
}

void encode_value(const c10::IValue& v, wire::Value* out, Frame* frame, const CodecContext& ctx) {
  encode_at(v, out, frame, ctx, 0);
  check_header_fields(*frame);
}

namespace {

// Decodes one value; `used` marks the frame's tensors already taken.
class Decoder {
 public:
  Decoder(const Frame& frame, const CodecContext& ctx)
      : frame_(frame), ctx_(ctx), used_(frame.tensors.size(), false) {}

  c10::IValue decode(const wire::Value& v, int depth) {
    if (depth >= kMaxValueDepth) {
      throw std::invalid_argument(absl::StrCat("value nested more than ", kMaxValueDepth, " deep"));
    }
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
        return c10::IValue(take_tensor(v.tensor()));
      case wire::Value::kTuple: {
        std::vector<c10::IValue> elems;
        elems.reserve(v.tuple().items_size());
        for (const auto& item : v.tuple().items()) elems.push_back(decode(item, depth + 1));
        return c10::IValue(c10::ivalue::Tuple::create(std::move(elems)));
      }
      case wire::Value::kIntList:
        return typed_list<int64_t>(v.int_list(), wire::Value::kI, "int",
                                   [](const wire::Value& x) { return x.i(); });
      case wire::Value::kDoubleList:
        return typed_list<double>(v.double_list(), wire::Value::kD, "float",
                                  [](const wire::Value& x) { return x.d(); });
      case wire::Value::kBoolList:
        return typed_list<bool>(v.bool_list(), wire::Value::kB, "bool",
                                [](const wire::Value& x) { return x.b(); });
      case wire::Value::kStringList:
        return typed_list<std::string>(v.string_list(), wire::Value::kS, "str",
                                       [](const wire::Value& x) { return x.s(); });
      case wire::Value::kTensorList: {
        c10::List<at::Tensor> out;
        out.reserve(v.tensor_list().items_size());
        for (const auto& item : v.tensor_list().items()) {
          if (item.kind_case() == wire::Value::kTensor) {
            out.push_back(take_tensor(item.tensor()));
          } else if (item.kind_case() == wire::Value::kSparseCoo) {
            out.push_back(sparse_coo(item.sparse_coo()));
          } else {
            throw std::invalid_argument("malformed value: an item of a list of Tensor is not a Tensor");
          }
        }
        return c10::IValue(std::move(out));
      }
      case wire::Value::kList: {
        c10::impl::GenericList out(c10::AnyType::get());
        out.reserve(v.list().items_size());
        for (const auto& item : v.list().items()) out.push_back(decode(item, depth + 1));
        return c10::IValue(std::move(out));
      }
      case wire::Value::kSparseCoo:
        return c10::IValue(sparse_coo(v.sparse_coo()));
      case wire::Value::kExt:
        if (ctx_.extensions) {
          for (const ExtensionCodec& codec : *ctx_.extensions) {
            if (codec.type == v.ext().type()) return codec.decode_capsule(v.ext(), ctx_.peer);
          }
        }
        throw std::invalid_argument("extension value '" + v.ext().type().substr(0, 64) +
                                    "' unexpected here");
      case wire::Value::KIND_NOT_SET:
        break;
    }
    throw std::invalid_argument("malformed value: no kind set");
  }

 private:
  template <typename T, typename Get>
  c10::IValue typed_list(const wire::Value::List& list, wire::Value::KindCase kind,
                         const char* name, Get get) {
    c10::List<T> out;
    out.reserve(list.items_size());
    for (const auto& item : list.items()) {
      if (item.kind_case() != kind) {
        throw std::invalid_argument(absl::StrCat("malformed value: an item of a list of ", name,
                                                 " is not a ", name));
      }
      out.push_back(get(item));
    }
    return c10::IValue(std::move(out));
  }

  // A sparse COO tensor, checked before libtorch sees it: int64 indices of
  // [sparse dims, nnz], values of [nnz, dense dims...] matching `sizes`,
  // every index within its dimension.
  at::Tensor sparse_coo(const wire::SparseCoo& coo) {
    const at::Tensor& indices = take_tensor(coo.indices());
    const at::Tensor& values = take_tensor(coo.values());
    auto bad = [](const std::string& why) {
      return std::invalid_argument("malformed sparse tensor: " + why);
    };
    if (!indices.defined() || !values.defined()) throw bad("missing indices or values");
    if (indices.scalar_type() != at::kLong || indices.dim() != 2) {
      throw bad("indices must be a 2-D int64 tensor");
    }
    const int64_t sparse_dims = indices.size(0), nnz = indices.size(1);
    if (sparse_dims < 1) throw bad("no sparse dimension");
    if (values.dim() < 1 || values.size(0) != nnz) throw bad("values do not match the indices' nnz");
    const int64_t dims = coo.sizes_size();
    if (dims != sparse_dims + values.dim() - 1 || dims > kMaxTensorDims) {
      throw bad("sizes do not match the indices and values");
    }
    std::vector<int64_t> sizes(coo.sizes().begin(), coo.sizes().end());
    int64_t elements = 1;
    for (int64_t d = 0; d < dims; ++d) {
      if (sizes[d] < 0) throw bad("negative size");
      if (d >= sparse_dims && sizes[d] != values.size(d - sparse_dims + 1)) {
        throw bad("sizes do not match the values' dense dimensions");
      }
      if (sizes[d] != 0 && elements > std::numeric_limits<int64_t>::max() / sizes[d]) {
        throw bad("too many elements");
      }
      elements *= sizes[d];
    }
    const at::Tensor rows = indices.contiguous();
    const int64_t* idx = rows.data_ptr<int64_t>();
    for (int64_t d = 0; d < sparse_dims; ++d) {
      for (int64_t i = 0; i < nnz; ++i) {
        const int64_t v = idx[d * nnz + i];
        if (v < 0 || v >= sizes[d]) throw bad("an index is out of its dimension's range");
      }
    }
    at::Tensor out = at::_sparse_coo_tensor_unsafe(rows, values, sizes);
    if (coo.requires_grad() && (at::isFloatingType(values.scalar_type()) ||
                                at::isComplexType(values.scalar_type()))) {
      out.requires_grad_(true);
    }
    return out;
  }

  // Each tensor of a frame is referenced once (encode_value writes one
  // entry per occurrence): a tensor shared by two values could not be told
  // apart from two received tensors.
  const at::Tensor& take_tensor(uint32_t index) {
    if (index >= frame_.tensors.size()) {
      throw std::invalid_argument(absl::StrCat("tensor index ", index, " out of range (",
                                               frame_.tensors.size(), " tensors)"));
    }
    if (used_[index]) {
      throw std::invalid_argument(absl::StrCat("tensor index ", index, " used twice"));
    }
    used_[index] = true;
    return frame_.tensors[index];
  }

  const Frame& frame_;
  const CodecContext& ctx_;
  std::vector<bool> used_;
};

}  // namespace

c10::IValue decode_value(const wire::Value& v, const Frame& frame, const CodecContext& ctx) {
  return Decoder(frame, ctx).decode(v, 0);
}

namespace {

void release_tensor(void* tensor) { delete static_cast<at::Tensor*>(tensor); }

// Reads consecutive bytes across a list of contiguous pieces.
class PieceReader {
 public:
  struct Piece {
    const uint8_t* data;
    size_t size;
  };
  explicit PieceReader(std::vector<Piece> pieces) : pieces_(std::move(pieces)) {
    for (const auto& p : pieces_) remaining_ += p.size;
  }
  uint64_t remaining() const { return remaining_; }
  bool read(void* dst, uint64_t n) {
    if (n > remaining_) return false;
    auto* out = static_cast<uint8_t*>(dst);
    while (n > 0) {
      const Piece& p = pieces_[index_];
      uint64_t take = std::min<uint64_t>(n, p.size - offset_);
      std::memcpy(out, p.data + offset_, take);
      out += take;
      n -= take;
      remaining_ -= take;
      offset_ += take;
      if (offset_ == p.size) {
        ++index_;
        offset_ = 0;
      }
    }
    return true;
  }

 private:
  const std::vector<Piece> pieces_;
  size_t index_ = 0;
  uint64_t offset_ = 0;
  uint64_t remaining_ = 0;
};

// The element count and byte count `meta` describes, overflow-checked;
// an error if it is not a tensor encode_value could have sent.
absl::Status check_tensor_meta(const wire::TensorMeta& meta, int index, uint64_t* nbytes) {
  *nbytes = 0;
  if (meta.dtype() == kUndefinedTensor) {
    if (meta.sizes_size() != 0 || meta.nbytes() != 0) {
      return absl::DataLossError(absl::StrCat("undefined tensor ", index, " has a shape or bytes"));
    }
    return absl::OkStatus();
  }
  if (!sendable_dtype(meta.dtype())) {
    return absl::DataLossError(absl::StrCat("tensor ", index, " has unsupported dtype ",
                                            meta.dtype()));
  }
  if (meta.sizes_size() > kMaxTensorDims) {
    return absl::DataLossError(absl::StrCat("tensor ", index, " has ", meta.sizes_size(),
                                            " dimensions (at most ", kMaxTensorDims, ")"));
  }
  // The contiguous strides libtorch computes when it allocates the tensor,
  // the products of the sizes with zeros counted as ones, fit in int64: a
  // shape with a zero has no elements, yet huge other sizes would overflow
  // its strides. The element count (libtorch's numel), never larger, fits
  // then too; bytes must fit in uint64.
  uint64_t numel = 1, span = 1;
  for (int64_t s : meta.sizes()) {
    if (s < 0) return absl::DataLossError(absl::StrCat("tensor ", index, " has a negative size"));
    if (__builtin_mul_overflow(span, static_cast<uint64_t>(std::max<int64_t>(s, 1)), &span) ||
        span > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::DataLossError(absl::StrCat("tensor ", index, " has too many elements"));
    }
    numel *= static_cast<uint64_t>(s);
  }
  const uint64_t item = c10::elementSize(static_cast<c10::ScalarType>(meta.dtype()));
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(numel, item, &bytes) || bytes != meta.nbytes()) {
    return absl::DataLossError(absl::StrCat("tensor ", index, " of ", meta.nbytes(),
                                            " bytes does not match its shape"));
  }
  *nbytes = bytes;
  return absl::OkStatus();
}

// Parses the header of a frame from `head` (size prefix included, nothing
// after it), checks every tensor's metadata and that their bytes add up to
// `tensor_bytes`, then allocates each tensor and has `fill` write its bytes.
absl::Status parse_parts(absl::string_view head, uint64_t tensor_bytes, const TensorFiller& fill,
                         Frame* frame, const ParseOptions& options) {
  frame->header.Clear();
  frame->tensors.clear();
  if (head.size() < 4) return absl::DataLossError("frame shorter than its size prefix");
  const auto* size_bytes = reinterpret_cast<const uint8_t*>(head.data());
  const uint32_t header_size = size_bytes[0] | (size_bytes[1] << 8) | (size_bytes[2] << 16) |
                               (static_cast<uint32_t>(size_bytes[3]) << 24);
  if (header_size != head.size() - 4) {
    return absl::DataLossError(absl::StrCat("frame header of ", header_size,
                                            " bytes does not match the frame (", head.size() - 4,
                                            " bytes of header)"));
  }
  if (header_size > static_cast<uint32_t>(std::numeric_limits<int>::max())) {
    return absl::DataLossError(absl::StrCat("frame header of ", header_size,
                                            " bytes is larger than protobuf parses"));
  }
  const auto* header_bytes = reinterpret_cast<const uint8_t*>(head.data() + 4);
  if (header_size > kCountedHeaderBytes) {
    int64_t fields = 0;
    switch (count_fields(header_bytes, header_bytes + header_size, wire::Header::descriptor(), 0,
                         kMaxHeaderFields, &fields)) {
      case Count::kOk:
        break;
      case Count::kMalformed:
        return absl::DataLossError("frame header does not parse");
      case Count::kTooMany:
        return absl::DataLossError(absl::StrCat("frame header holds more than ",
                                                kMaxHeaderFields, " fields"));
    }
  }
  if (!frame->header.ParseFromArray(header_bytes, static_cast<int>(header_size))) {
    return absl::DataLossError("frame header does not parse");
  }
  frame->more_in_flight = frame->header.more_in_flight();

  const auto& metas = frame->header.tensors();
  if (metas.size() > kMaxTensorsPerFrame) {
    return absl::DataLossError(absl::StrCat("frame has ", metas.size(), " tensors (at most ",
                                            kMaxTensorsPerFrame, ")"));
  }
  // Every tensor is checked, and the bytes counted, before any is allocated.
  uint64_t total = 0;
  for (int i = 0; i < metas.size(); ++i) {
    uint64_t bytes;
    absl::Status ok = check_tensor_meta(metas[i], i, &bytes);
    if (!ok.ok()) return ok;
    if (metas[i].pushed() != 0 && metas[i].lent() == 0) {
      return absl::DataLossError(absl::StrCat("tensor ", i, " was pushed but not lent"));
    }
    if (metas[i].lent() != 0) {
      if (!options.accept_lent) {
        return absl::DataLossError(absl::StrCat("tensor ", i, " was lent, on a path without lending"));
      }
      if (metas[i].dtype() == kUndefinedTensor) {
        return absl::DataLossError(absl::StrCat("undefined tensor ", i, " was lent"));
      }
      continue;  // its bytes are not in the frame
    }
    if (__builtin_add_overflow(total, bytes, &total) || total > tensor_bytes) {
      return absl::DataLossError("the frame's tensors need more bytes than it has");
    }
  }
  if (total != tensor_bytes) {
    return absl::DataLossError(absl::StrCat(tensor_bytes - total,
                                            " trailing bytes after the frame"));
  }
  frame->tensors.reserve(metas.size());
  for (int i = 0; i < metas.size(); ++i) {
    const auto& meta = metas[i];
    if (meta.dtype() == kUndefinedTensor || meta.lent() != 0) {
      frame->tensors.emplace_back();
      continue;
    }
    at::Tensor t = allocate_tensor(meta);
    if (meta.nbytes() > 0) {
      absl::Status filled = fill(i, t.data_ptr(), meta.nbytes());
      if (!filled.ok()) return filled;
    }
    frame->tensors.push_back(std::move(t));
  }
  return absl::OkStatus();
}

absl::Status parse_pieces(PieceReader reader, Frame* frame, const ParseOptions& options) {
  frame->header.Clear();
  frame->tensors.clear();
  uint8_t size_bytes[4];
  if (!reader.read(size_bytes, 4)) return absl::DataLossError("frame shorter than its size prefix");
  const uint32_t header_size = size_bytes[0] | (size_bytes[1] << 8) | (size_bytes[2] << 16) |
                               (static_cast<uint32_t>(size_bytes[3]) << 24);
  if (header_size > reader.remaining()) {
    return absl::DataLossError(absl::StrCat("frame header of ", header_size,
                                            " bytes exceeds the frame (", reader.remaining(),
                                            " bytes left)"));
  }
  std::string head(4 + header_size, '\0');
  std::memcpy(head.data(), size_bytes, 4);
  reader.read(head.data() + 4, header_size);
  return parse_parts(head, reader.remaining(), [&reader](int, void* dst, uint64_t n) {
    return reader.read(dst, n) ? absl::OkStatus()
                               : absl::DataLossError("frame shorter than its tensors");
  }, frame, options);
}

}  // namespace

std::string serialize_head(const Frame& frame) {
  const uint32_t proto_size = static_cast<uint32_t>(frame.header.ByteSizeLong());
  const uint32_t header_size =
      proto_size + (frame.more_in_flight ? sizeof(kMoreInFlight) : 0);
  std::string head(4 + header_size, '\0');
  for (int i = 0; i < 4; ++i) head[i] = static_cast<char>((header_size >> (8 * i)) & 0xff);
  frame.header.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(head.data() + 4));
  if (frame.more_in_flight) {
    std::memcpy(head.data() + 4 + proto_size, kMoreInFlight, sizeof(kMoreInFlight));
  }
  return head;
}

grpc::ByteBuffer serialize_frame(const Frame& frame) {
  const std::string head = serialize_head(frame);
  std::vector<grpc::Slice> slices;
  slices.reserve(1 + frame.tensors.size());
  slices.emplace_back(head);
  const auto& metas = frame.header.tensors();
  for (size_t i = 0; i < frame.tensors.size(); ++i) {
    const at::Tensor& t = frame.tensors[i];
    if (!t.defined() || t.numel() == 0) continue;
    if (static_cast<int>(i) < metas.size() && metas[static_cast<int>(i)].lent() != 0) continue;
    // The slice keeps the tensor (and so its memory) alive until gRPC is done.
    slices.emplace_back(t.data_ptr(), t.numel() * t.element_size(), &release_tensor,
                        new at::Tensor(t));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

absl::Status parse_frame(const grpc::ByteBuffer& buffer, Frame* frame,
                         const ParseOptions& options) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return absl::DataLossError("unreadable byte buffer");
  std::vector<PieceReader::Piece> pieces;
  pieces.reserve(slices.size());
  for (const auto& s : slices) pieces.push_back({s.begin(), s.size()});
  return parse_pieces(PieceReader(std::move(pieces)), frame, options);
}

absl::Status parse_frame(const uint8_t* data, size_t size, Frame* frame,
                         const ParseOptions& options) {
  return parse_pieces(PieceReader({{data, size}}), frame, options);
}

absl::Status parse_frame(absl::string_view head, uint64_t tensor_bytes, const TensorFiller& fill,
                         Frame* frame) {
  return parse_parts(head, tensor_bytes, fill, frame, ParseOptions{});
}

}  // namespace ddprpc::rpc::internal
