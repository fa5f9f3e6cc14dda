#include "rpc/testing/raw_peer.h"

#include <grpcpp/impl/rpc_method.h>
#include <unistd.h>

#include <fstream>

#include "absl/strings/str_cat.h"
#include "rpc/core/internal/auth.h"
#include "rpc/transport/grpc_transport.h"

namespace ddprpc::rpc::testing {
namespace {

const grpc::internal::RpcMethod& stream_method() {
  static const grpc::internal::RpcMethod method("/ddprpc.Transport/Stream",
                                                grpc::internal::RpcMethod::BIDI_STREAMING);
  return method;
}

}  // namespace

RawStream::RawStream(const std::string& address, int to, std::optional<int> worker,
                     absl::Duration timeout, const std::string& worker_text, Auth auth,
                     std::shared_ptr<grpc::ChannelCredentials> credentials) {
  const Security security = Security::from_environment();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (!credentials) credentials = internal::channel_credentials(security);
  channel_ = grpc::CreateCustomChannel(address, credentials, args);
  ctx_.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  if (!worker_text.empty()) {
    ctx_.AddMetadata(internal::kWorkerMetadataKey, worker_text);
  } else if (worker) {
    ctx_.AddMetadata(internal::kWorkerMetadataKey, absl::StrCat(*worker));
  }
  if (auth != Auth::kNone && security.authenticated()) {
    const std::string token = auth == Auth::kJobToken ? security.token : security.token + "x";
    ctx_.AddMetadata(internal::kAuthMetadataKey,
                     internal::auth_proof(token, {"rpc", "grpc", worker ? *worker : -1, to}));
  }
  stream_.reset(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel_.get(), stream_method(), &ctx_));
}

RawStream::~RawStream() {
  if (finished_) return;
  ctx_.TryCancel();
  stream_->Finish();
}

bool RawStream::write_bytes(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return stream_->Write(grpc::ByteBuffer(&slice, 1));
}

bool RawStream::write_frame(const wire::Header& header, const std::string& body) {
  return write_bytes(raw_frame(header, body));
}

std::optional<internal::Frame> RawStream::read() {
  grpc::ByteBuffer buffer;
  if (!stream_->Read(&buffer)) return std::nullopt;
  internal::Frame frame;
  if (!internal::parse_frame(buffer, &frame).ok()) return std::nullopt;
  return frame;
}

grpc::Status RawStream::finish() {
  stream_->WritesDone();
  grpc::ByteBuffer ignored;
  while (stream_->Read(&ignored)) {
  }
  finished_ = true;
  return stream_->Finish();
}

internal::Frame request_frame(int src, uint64_t id, const std::string& function,
                              std::vector<c10::IValue> args) {
  internal::Frame frame;
  frame.header.set_kind(wire::REQUEST);
  frame.header.set_id(id);
  frame.header.set_src(src);
  frame.header.set_function(function);
  internal::encode_value(c10::IValue(c10::ivalue::Tuple::create(std::move(args))),
                         frame.header.mutable_payload(), &frame);
  return frame;
}

std::string frame_bytes(const internal::Frame& frame) {
  std::vector<grpc::Slice> slices;
  (void)internal::serialize_frame(frame).Dump(&slices);
  std::string out;
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

std::string raw_frame(const wire::Header& header, const std::string& body) {
  const std::string head = header.SerializeAsString();
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((head.size() >> (8 * i)) & 0xff);
  return out + head + body;
}

int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

}  // namespace ddprpc::rpc::testing
