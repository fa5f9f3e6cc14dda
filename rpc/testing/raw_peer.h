// Hostile peers for tests: a stream to a worker's transport written by hand
// (any bytes, any metadata, replies read or not), so that tests can send
// what no well-behaved agent would.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/sync_stream.h>

#include <memory>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "rpc/wire/codec.h"
#include "rpc/wire/wire.pb.h"

namespace ddprpc::rpc::testing {

class RawStream {
 public:
  // How the stream proves the job's token (DDPRPC_AUTH_TOKEN, as the local
  // launcher sets it): as a worker of the job would, not at all, or with a
  // token that is not the job's. TLS material also comes from the
  // environment (security.h).
  enum class Auth { kJobToken, kNone, kWrongToken };

  // Opens a stream to worker `to` listening at `address`, naming worker
  // `worker` in its metadata (none if nullopt, `worker_text` verbatim if
  // set); the proof names `to` as its destination. Every operation gives
  // up after `timeout` from opening. `credentials`: the channel's
  // (default: the job's, from the environment).
  RawStream(const std::string& address, int to, std::optional<int> worker,
            absl::Duration timeout = absl::Seconds(20), const std::string& worker_text = "",
            Auth auth = Auth::kJobToken,
            std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);
  ~RawStream();

  // Writes raw bytes as one message; false once the stream is broken.
  bool write_bytes(const std::string& bytes);
  // Writes `header` followed by `body` (the tensors' bytes) as a frame,
  // with the 4-byte header size prefix computed from the header.
  bool write_frame(const wire::Header& header, const std::string& body = "");
  // Reads the next reply frame; nullopt when the stream has ended.
  std::optional<internal::Frame> read();
  // Half-closes, reads what is left, and returns how the stream ended
  // (once; the destructor cancels a stream not finished).
  grpc::Status finish();

 private:
  grpc::ClientContext ctx_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream_;
  bool finished_ = false;
};

// A request frame for `function` with `args` encoded as a well-behaved
// caller would (worker `src`, request `id`).
internal::Frame request_frame(int src, uint64_t id, const std::string& function,
                              std::vector<c10::IValue> args);
// The frame's bytes as one string: 4-byte header size, header, tensor bytes.
std::string frame_bytes(const internal::Frame& frame);
// `header` with `body` after it, as frame bytes.
std::string raw_frame(const wire::Header& header, const std::string& body = "");

// This process's resident memory, in bytes.
int64_t resident_bytes();

}  // namespace ddprpc::rpc::testing
