#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "ddp/internal/ring_socket.h"
#include "ddp/internal/tcp_ring.h"

// TcpRing's allreduce: the writer thread and the reader.
namespace ddprpc::ddp::internal {
namespace {

using ring::get_u32;
using ring::get_u64;
using ring::put_u32;
using ring::put_u64;
using ring::overdue;
using ring::rank_name;
using ring::recv_all;
using ring::recv_some;
using ring::send_all;
using ring::slice_until;

// Each allreduce's header: magic, u32 sequence, u64 elements, u32 element
// size, u32 dtype, u32 reduction, u32 op, u64 elements of the whole
// allreduce, u32 part, u32 parts.
constexpr char kHeaderMagic[4] = {'D', 'D', 'R', '2'};
constexpr size_t kHeaderBytes = 48;
// Reduce-scatter bytes are read into the staging buffer this much at a
// time, then reduced into the caller's buffer; allgather bytes go straight
// there, at most this much per read. Between 4 network namespaces on 2
// cores, pieces of 128 KiB, 256 KiB and 1 MiB (and writes of 256 KiB to 4
// MiB) all came within 1.04-1.23x of a plain TCP ring at 4-64 MiB, the
// differences inside the runs' spread. Reads wait for the receive
// low-water mark (ring::recv_all), so a piece wakes the reader once or
// twice whatever its size.
constexpr size_t kPieceBytes = 1 << 20;
// The writer sends at most this much per call.
constexpr int64_t kMaxWriteBytes = 1 << 20;

}  // namespace

TcpRing::TcpRing(int rank, int size, int to_next, int from_previous)
    : rank_(rank), size_(size), to_next_(to_next), from_previous_(from_previous),
      staging_(kPieceBytes) {}

TcpRing::~TcpRing() {
  if (to_next_ >= 0) ::close(to_next_);
  if (from_previous_ >= 0) ::close(from_previous_);
}

std::string TcpRing::who() const { return absl::StrCat("TcpRing (rank ", rank_, " of ", size_, ")"); }

void TcpRing::fail(const std::string& error) {
  if (broken_.empty()) broken_ = error;
  failed_.store(true);
  ::shutdown(to_next_, SHUT_RDWR);
  ::shutdown(from_previous_, SHUT_RDWR);
  std::lock_guard<std::mutex> lock(mu_);
  progress_.notify_all();
}

void TcpRing::write_items(const char* header, size_t header_bytes,
                          const std::vector<int64_t>& offsets, const std::vector<int64_t>& lengths,
                          const std::vector<int64_t>& needed, char* base, absl::Time deadline) {
  const std::string next = rank_name((rank_ + 1) % size_);
  std::string error = send_all(to_next_, header, header_bytes, deadline, &failed_, next);
  for (size_t k = 0; error.empty() && k < offsets.size(); ++k) {
    int64_t sent = 0;
    while (error.empty() && sent < lengths[k]) {
      // Item k > 0 is what the reader received as item k - 1: only the
      // bytes it has finished may go on.
      int64_t ready = lengths[k];
      if (k > 0) {
        ready = std::min(lengths[k], received_.load() - needed[k]);
        if (ready <= sent) {
          std::unique_lock<std::mutex> lock(mu_);
          writer_waiting_.store(true);
          progress_.wait_for(lock, slice_until(deadline),
                             [&] { return received_.load() - needed[k] > sent || failed_.load(); });
          writer_waiting_.store(false);
          lock.unlock();
          if (failed_.load()) error = "cancelled";
          else if (absl::Now() >= deadline && received_.load() - needed[k] <= sent) {
            error = absl::StrCat("waited past the deadline for rank ", (rank_ + size_ - 1) % size_,
                                 "'s bytes");
          }
          continue;
        }
      }
      const int64_t n = std::min(ready - sent, kMaxWriteBytes);
      error = send_all(to_next_, base + offsets[k] + sent, static_cast<size_t>(n), deadline,
                       &failed_, next);
      sent += n;
    }
    if (error.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      items_sent_ = static_cast<int>(k) + 1;
      progress_.notify_all();
    }
  }
  // The first failure of the call: the reader's error is only its echo.
  if (!error.empty() && first_failure(from_previous_)) writer_error_ = std::move(error);
}

bool TcpRing::first_failure(int fd) {
  if (failed_.exchange(true)) return false;
  ::shutdown(fd, SHUT_RDWR);  // wakes the other side in a socket call
  std::lock_guard<std::mutex> lock(mu_);  // and in a wait
  progress_.notify_all();
  return true;
}

void TcpRing::allreduce(void* data, int64_t numel, size_t element_size, int dtype,
                        Reduction reduction, ReduceFn reduce, absl::Time deadline,
                        RingCall call) {
  if (!broken_.empty()) {
    throw std::runtime_error(
        absl::StrCat(who(), ": the ring failed in an earlier allreduce: ", broken_));
  }
  if (numel < 0 || element_size < 1 || element_size > 16) {
    throw std::invalid_argument(absl::StrCat(who(), ": ", numel, " elements of ", element_size,
                                             " bytes"));
  }
  ++sequence_;
  const int n = size_, r = rank_;
  const int previous = (r + n - 1) % n;
  auto chunk_begin = [&](int c) { return c * (numel / n) + std::min<int64_t>(c, numel % n); };
  auto chunk = [&](int c) { return ((c % n) + n) % n; };
  // Item i of the reader is chunk r - i - 1 (n - 1 reduce-scatter steps),
  // then chunk r - j (allgather step j = i - (n - 1)). The writer sends
  // chunk r first, then each item the reader finished: its item k is the
  // reader's item k - 1, of which it may send the first
  // received_ - needed[k] bytes.
  const int items = 2 * (n - 1);
  std::vector<int64_t> recv_offsets(items), recv_lengths(items);
  const auto bytes = static_cast<int64_t>(element_size);
  for (int i = 0; i < items; ++i) {
    const int c = i < n - 1 ? chunk(r - i - 1) : chunk(r - (i - (n - 1)));
    recv_offsets[i] = chunk_begin(c) * bytes;
    recv_lengths[i] = (chunk_begin(c + 1) - chunk_begin(c)) * bytes;
  }
  std::vector<int64_t> send_offsets{chunk_begin(r) * bytes};
  std::vector<int64_t> send_lengths{(chunk_begin(r + 1) - chunk_begin(r)) * bytes};
  send_offsets.insert(send_offsets.end(), recv_offsets.begin(), recv_offsets.end() - 1);
  send_lengths.insert(send_lengths.end(), recv_lengths.begin(), recv_lengths.end() - 1);
  std::vector<int64_t> needed(items, 0);
  for (int k = 2; k < items; ++k) needed[k] = needed[k - 1] + recv_lengths[k - 2];
  char header[kHeaderBytes] = {};
  std::memcpy(header, kHeaderMagic, 4);
  put_u32(header + 4, sequence_);
  put_u64(header + 8, static_cast<uint64_t>(numel));
  put_u32(header + 16, static_cast<uint32_t>(element_size));
  put_u32(header + 20, static_cast<uint32_t>(dtype));
  put_u32(header + 24, static_cast<uint32_t>(reduction));
  put_u32(header + 28, call.op);
  put_u64(header + 32, static_cast<uint64_t>(call.whole < 0 ? numel : call.whole));
  put_u32(header + 40, call.part);
  put_u32(header + 44, call.parts);

  char* base = static_cast<char*>(data);
  received_.store(0);
  items_sent_ = 0;
  failed_.store(false);
  writer_error_.clear();
  std::thread writer;
  try {
    writer = std::thread([&] {
      try {
        write_items(header, kHeaderBytes, send_offsets, send_lengths, needed, base, deadline);
      } catch (const std::exception& e) {
        if (first_failure(from_previous_)) writer_error_ = e.what();
      }
    });
  } catch (const std::system_error& e) {
    fail(absl::StrCat("cannot start the writing thread: ", e.what()));
    throw std::runtime_error(absl::StrCat(who(), " allreduce ", sequence_, ": ", broken_));
  }
  const std::string from = rank_name(previous);
  auto done = [this](int64_t n_bytes) {
    received_.fetch_add(n_bytes);
    if (writer_waiting_.load()) {
      std::lock_guard<std::mutex> lock(mu_);
      progress_.notify_one();
    }
  };
  std::string error;
  // Nothing may leave this block by an exception while the writer runs.
  try {
    char theirs[kHeaderBytes];
    error = recv_all(from_previous_, theirs, kHeaderBytes, deadline, &failed_, from, &low_water_);
    if (error.empty() && std::memcmp(theirs, kHeaderMagic, 4) != 0) {
      error = absl::StrCat("rank ", previous, " sent no allreduce header");
    } else if (error.empty() && std::memcmp(theirs, header, kHeaderBytes) != 0) {
      auto describe = [](const char* h) {
        return absl::StrCat("allreduce ", get_u32(h + 4), " of ", get_u64(h + 8),
                            " elements of ", get_u32(h + 16), " bytes (dtype ", get_u32(h + 20),
                            ", reduction ", get_u32(h + 24), ", op ", get_u32(h + 28), ", part ",
                            get_u32(h + 40), " of ", get_u32(h + 44), " of ", get_u64(h + 32),
                            " elements)");
      };
      error = absl::StrCat("rank ", previous, " started ", describe(theirs), "; this rank's is ",
                           describe(header));
    }
    for (int i = 0; error.empty() && i < items; ++i) {
      const bool reducing = i < n - 1;
      if (!reducing) {
        // Allgather step j overwrites the chunk the writer sent as its item j.
        // Those bytes went round the ring before these final ones could come
        // back, so the writer is long done; waiting for it here makes that
        // order visible to the memory model (and to ThreadSanitizer).
        const int j = i - (n - 1);
        std::unique_lock<std::mutex> lock(mu_);
        while (items_sent_ <= j && !failed_.load() && absl::Now() < deadline) {
          progress_.wait_for(lock, slice_until(deadline));
        }
        if (items_sent_ <= j) {
          error = failed_.load() ? "cancelled"
                                 : absl::StrCat("this rank's writes to rank ", (r + 1) % n,
                                                " did not end before the deadline");
          break;
        }
      }
      char* at = base + recv_offsets[i];
      int64_t left = recv_lengths[i];
      while (error.empty() && left > 0) {
        if (reducing) {
          const auto piece = static_cast<size_t>(
              std::min<int64_t>(left, kPieceBytes - kPieceBytes % element_size));
          error = recv_all(from_previous_, staging_.data(), piece, deadline, &failed_, from,
                           &low_water_);
          if (!error.empty()) break;
          reduce(at, at, staging_.data(), piece / element_size);
          at += piece;
          left -= static_cast<int64_t>(piece);
          done(static_cast<int64_t>(piece));
        } else {
          size_t k = 0;
          error = recv_some(from_previous_, at,
                            static_cast<size_t>(std::min<int64_t>(left, kPieceBytes)),
                            static_cast<size_t>(left), deadline, &failed_, from, &low_water_, &k);
          if (!error.empty()) break;
          at += k;
          left -= static_cast<int64_t>(k);
          done(static_cast<int64_t>(k));
          if (left > 0) error = overdue(deadline, &failed_, from);
        }
      }
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty()) first_failure(to_next_);
  writer.join();
  // Whichever side failed first says why (writer_error_ is set only then).
  if (!writer_error_.empty()) error = writer_error_;
  if (!error.empty()) {
    fail(error);
    throw std::runtime_error(absl::StrCat(who(), " allreduce ", sequence_, ": ", error));
  }
}
}  // namespace ddprpc::ddp::internal
