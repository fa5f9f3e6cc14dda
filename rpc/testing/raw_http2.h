// A client that speaks HTTP/2 by hand to a gRPC server over plain TCP, for
// tests of what strangers and members can make a server hold: it opens
// calls with any metadata and sends the start of a message that it never
// finishes, as far as the windows the server grants allow.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace ddprpc::rpc::testing {

class RawHttp2 {
 public:
  RawHttp2() = default;
  ~RawHttp2();
  RawHttp2(const RawHttp2&) = delete;
  RawHttp2& operator=(const RawHttp2&) = delete;

  // Connects to 127.0.0.1:`port` and sends the connection preface; false
  // if it cannot connect.
  bool connect(int port);
  // Opens a call to `path` (e.g. "/pkg.Service/Method") with `metadata`
  // besides gRPC's own headers; returns its stream id.
  uint32_t open_call(const std::string& path,
                     const std::vector<std::pair<std::string, std::string>>& metadata = {});
  // Queues a gRPC message prefix claiming `claimed` bytes, then `body`
  // bytes of it (zeros), sent as the stream's window allows.
  void send_partial_message(uint32_t stream, uint32_t claimed, size_t body);
  // Reads what the server sends (answering its settings and pings) and
  // writes what the windows allow, for `duration`; false once the
  // connection is closed.
  bool pump(absl::Duration duration);
  // Whether the server ended `stream` (trailers or a reset).
  bool ended(uint32_t stream) const;
  // Streams open and not ended.
  int open_streams() const;
  bool closed() const { return fd_ < 0 || closed_; }
  // Message bytes (prefix included) the server's windows let through.
  size_t sent_body_bytes() const { return sent_body_; }

 private:
  struct Stream {
    std::string pending;  // DATA payload still to send
    size_t zeros = 0;     // then this many zero bytes
    int64_t window = 65535;
    bool ended = false;
  };
  void frame(uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload);
  void on_frame(uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload);
  void write_data();
  bool flush();

  int fd_ = -1;
  bool closed_ = false;
  uint32_t next_stream_ = 1;
  int64_t conn_window_ = 65535;
  int64_t initial_window_ = 65535;
  size_t sent_body_ = 0;
  std::map<uint32_t, Stream> streams_;
  std::string out_;
  std::string in_;
};

}  // namespace ddprpc::rpc::testing
