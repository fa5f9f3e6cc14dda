// gRPC transport of the RPC agent: one bidirectional stream per (caller,
// callee) pair carries serialized frames (see codec.h) both ways.
//
// - TransportServer: accepts streams; each request frame is handed to the
//   agent with a Responder that sends exactly one reply on the same stream.
// - PeerStream: the caller's side of a stream; replies go to a callback.
// Writes to a stream are serialized by FrameWriter without a writer thread.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/sync_stream.h>

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "rpc/internal/codec.h"

namespace ddprpc::rpc::internal {

using Stream = grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;

// Serializes writes to one gRPC stream. Any thread may send; a sender that
// finds the stream idle writes everything queued meanwhile (flat combining),
// hinting gRPC to coalesce all but the last frame.
class FrameWriter {
 public:
  using WriteFn = std::function<bool(const grpc::ByteBuffer&, grpc::WriteOptions)>;
  explicit FrameWriter(WriteFn write) : write_(std::move(write)) {}

  // Queues a frame; false when the writer is closed (the frame is dropped).
  bool send(grpc::ByteBuffer buffer);
  // Rejects further frames and waits until no write is in progress.
  void close();

 private:
  const WriteFn write_;
  absl::Mutex mu_;
  // State below is protected by mu_.
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

class ServerStream;

// Sends the single reply to one request. Dropping it unsent counts the
// request as answered (e.g. one-way notices).
class Responder {
 public:
  explicit Responder(std::shared_ptr<ServerStream> stream);
  ~Responder();
  Responder(const Responder&) = delete;
  Responder& operator=(const Responder&) = delete;
  void send(grpc::ByteBuffer reply);

 private:
  std::shared_ptr<ServerStream> stream_;
};

class TransportServer {
 public:
  using OnRequest = std::function<void(std::shared_ptr<Responder>, Frame)>;
  // Listens on host:0. Each request is passed either to `run_inline`, which
  // serves it on the calling (stream) thread, or to `offload`, which must
  // hand it to another thread (when both stream threads are busy). Frames
  // that fail to parse end their stream with INVALID_ARGUMENT. Throws
  // RpcError if it cannot listen.
  static std::unique_ptr<TransportServer> start(const std::string& host, OnRequest run_inline,
                                                OnRequest offload);
  ~TransportServer();
  int port() const { return port_; }
  // Ends all streams; waits at most `grace` for replies still in flight.
  void shutdown(absl::Duration grace);

  class Service;

 private:
  TransportServer() = default;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// The caller's end of a stream to one peer.
class PeerStream {
 public:
  using OnFrame = std::function<void(Frame)>;
  // Called once when the stream ends, with why (OK after close()).
  using OnClose = std::function<void(const grpc::Status&)>;

  PeerStream(const std::string& address, OnFrame on_frame, OnClose on_close);
  ~PeerStream();

  // False when the stream is already closed or broken.
  bool send(grpc::ByteBuffer frame) { return writer_.send(std::move(frame)); }
  bool broken() const;
  // graceful: half-close and wait for the peer to end the stream;
  // otherwise cancel at once. Joins the reader thread.
  void close(bool graceful);

 private:
  void read_loop();

  const OnFrame on_frame_;
  const OnClose on_close_;
  grpc::ClientContext ctx_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream_;
  FrameWriter writer_;
  mutable absl::Mutex mu_;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reader_;
};

// Channel arguments tuned for large tensors on fast links.
grpc::ChannelArguments channel_arguments();

}  // namespace ddprpc::rpc::internal
