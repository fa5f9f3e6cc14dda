#include "rpc/testing/raw_http2.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/time/clock.h"

namespace ddprpc::rpc::testing {
namespace {

constexpr uint8_t kData = 0, kHeaders = 1, kRstStream = 3, kSettings = 4, kPing = 6,
                  kGoaway = 7, kWindowUpdate = 8;
constexpr uint8_t kEndStream = 1, kAck = 1, kEndHeaders = 4;
constexpr size_t kMaxFrame = 16384;

// HPACK integer with an n-bit prefix (RFC 7541, 5.1).
void hpack_int(std::string* out, uint8_t first, int prefix_bits, size_t value) {
  const size_t max = (size_t{1} << prefix_bits) - 1;
  if (value < max) {
    out->push_back(static_cast<char>(first | value));
    return;
  }
  out->push_back(static_cast<char>(first | max));
  value -= max;
  while (value >= 128) {
    out->push_back(static_cast<char>((value & 127) | 128));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

// A literal header field without indexing, new name, no Huffman coding.
void hpack_literal(std::string* out, const std::string& name, const std::string& value) {
  out->push_back(0);
  hpack_int(out, 0, 7, name.size());
  *out += name;
  hpack_int(out, 0, 7, value.size());
  *out += value;
}

uint32_t be32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return (uint32_t{u[0]} << 24) | (uint32_t{u[1]} << 16) | (uint32_t{u[2]} << 8) | u[3];
}

}  // namespace

RawHttp2::~RawHttp2() {
  if (fd_ >= 0) ::close(fd_);
}

bool RawHttp2::connect(int port) {
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd_);
    fd_ = -1;
    return false;
  }
  int one = 1;
  setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  out_ = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  frame(kSettings, 0, 0, "");
  return flush();
}

uint32_t RawHttp2::open_call(const std::string& path,
                             const std::vector<std::pair<std::string, std::string>>& metadata) {
  const uint32_t id = next_stream_;
  next_stream_ += 2;
  std::string block;
  hpack_literal(&block, ":method", "POST");
  hpack_literal(&block, ":scheme", "http");
  hpack_literal(&block, ":path", path);
  hpack_literal(&block, ":authority", "localhost");
  hpack_literal(&block, "content-type", "application/grpc");
  hpack_literal(&block, "te", "trailers");
  for (const auto& [name, value] : metadata) hpack_literal(&block, name, value);
  frame(kHeaders, kEndHeaders, id, block);
  streams_[id].window = initial_window_;
  return id;
}

void RawHttp2::send_partial_message(uint32_t stream, uint32_t claimed, size_t body) {
  Stream& s = streams_[stream];
  char prefix[5] = {0, static_cast<char>(claimed >> 24), static_cast<char>(claimed >> 16),
                    static_cast<char>(claimed >> 8), static_cast<char>(claimed)};
  s.pending.append(prefix, sizeof(prefix));
  s.zeros += body;
}

bool RawHttp2::ended(uint32_t stream) const {
  auto it = streams_.find(stream);
  return it != streams_.end() && it->second.ended;
}

int RawHttp2::open_streams() const {
  int n = 0;
  for (const auto& [id, s] : streams_) n += s.ended ? 0 : 1;
  return n;
}

void RawHttp2::frame(uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload) {
  const size_t n = payload.size();
  const char head[9] = {static_cast<char>(n >> 16), static_cast<char>(n >> 8),
                        static_cast<char>(n),       static_cast<char>(type),
                        static_cast<char>(flags),   static_cast<char>(stream >> 24),
                        static_cast<char>(stream >> 16), static_cast<char>(stream >> 8),
                        static_cast<char>(stream)};
  out_.append(head, sizeof(head));
  out_ += payload;
}

void RawHttp2::on_frame(uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload) {
  switch (type) {
    case kSettings:
      if (flags & kAck) return;
      for (size_t i = 0; i + 6 <= payload.size(); i += 6) {
        const uint16_t id = static_cast<uint16_t>((static_cast<unsigned char>(payload[i]) << 8) |
                                                  static_cast<unsigned char>(payload[i + 1]));
        if (id == 4) {  // SETTINGS_INITIAL_WINDOW_SIZE
          const int64_t value = be32(payload.data() + i + 2);
          for (auto& [sid, s] : streams_) s.window += value - initial_window_;
          initial_window_ = value;
        }
      }
      frame(kSettings, kAck, 0, "");
      return;
    case kPing:
      if (!(flags & kAck)) frame(kPing, kAck, 0, payload);
      return;
    case kWindowUpdate:
      if (payload.size() < 4) return;
      if (stream == 0) {
        conn_window_ += be32(payload.data()) & 0x7fffffff;
      } else if (auto it = streams_.find(stream); it != streams_.end()) {
        it->second.window += be32(payload.data()) & 0x7fffffff;
      }
      return;
    case kHeaders:
      if ((flags & kEndStream) && streams_.count(stream)) streams_[stream].ended = true;
      return;
    case kRstStream:
      if (streams_.count(stream)) streams_[stream].ended = true;
      return;
    case kGoaway:
      closed_ = true;
      return;
    default:
      return;
  }
}

void RawHttp2::write_data() {
  for (auto& [id, s] : streams_) {
    while (!s.ended && (!s.pending.empty() || s.zeros > 0) && out_.size() < (256 << 10)) {
      const int64_t room = std::min<int64_t>({s.window, conn_window_, int64_t{kMaxFrame}});
      if (room <= 0) break;
      std::string payload = s.pending.substr(0, static_cast<size_t>(room));
      s.pending.erase(0, payload.size());
      const size_t zeros = std::min(s.zeros, static_cast<size_t>(room) - payload.size());
      payload.append(zeros, '\0');
      s.zeros -= zeros;
      s.window -= static_cast<int64_t>(payload.size());
      conn_window_ -= static_cast<int64_t>(payload.size());
      sent_body_ += payload.size();
      frame(kData, 0, id, payload);
    }
  }
}

bool RawHttp2::flush() {
  while (!out_.empty()) {
    const ssize_t n = send(fd_, out_.data(), out_.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      out_.erase(0, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    closed_ = true;
    return false;
  }
  return true;
}

bool RawHttp2::pump(absl::Duration duration) {
  const absl::Time deadline = absl::Now() + duration;
  while (!closed()) {
    write_data();
    if (!flush()) return false;
    pollfd p{fd_, static_cast<short>(POLLIN | (out_.empty() ? 0 : POLLOUT)), 0};
    const int64_t left = std::max<int64_t>(absl::ToInt64Milliseconds(deadline - absl::Now()), 0);
    const int ready = poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 10)));
    if (ready <= 0) {
      if (absl::Now() >= deadline) break;
      continue;
    }
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      char buf[64 << 10];
      const ssize_t n = recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        closed_ = true;
        break;
      }
      if (n > 0) in_.append(buf, static_cast<size_t>(n));
      size_t at = 0;
      while (in_.size() - at >= 9) {
        const auto* h = reinterpret_cast<const unsigned char*>(in_.data() + at);
        const size_t len = (size_t{h[0]} << 16) | (size_t{h[1]} << 8) | h[2];
        if (in_.size() - at < 9 + len) break;
        on_frame(h[3], h[4], be32(in_.data() + at + 5) & 0x7fffffff, in_.substr(at + 9, len));
        at += 9 + len;
      }
      in_.erase(0, at);
    }
    if (absl::Now() >= deadline) break;
  }
  write_data();
  flush();
  return !closed();
}

}  // namespace ddprpc::rpc::testing
