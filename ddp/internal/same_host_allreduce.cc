#include "ddp/internal/same_host_allreduce.h"

#include <ATen/ops/empty.h>
#include <gloo/barrier.h>
#include <gloo/context.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>

#include "absl/strings/str_cat.h"
#include "ddp/internal/same_host_common.h"

namespace ddprpc::ddp::internal {
namespace {

std::atomic<int64_t> g_runs{0};

// Peer bytes read and reduced per step.
constexpr int64_t kScratchBytes = int64_t{256} << 10;  // stays in cache while it is added

}  // namespace

std::unique_ptr<SameHostAllreduce> SameHostAllreduce::connect(
    const std::shared_ptr<gloo::Context>& context, bool willing) {
  const int n = context->size;
  // {pid, address of the nonce, nonce (2 words)}, from every rank.
  std::random_device random;
  auto nonce = std::make_unique<int64_t[]>(2);
  nonce[0] = (static_cast<int64_t>(random()) << 32) ^ random();
  nonce[1] = (static_cast<int64_t>(random()) << 32) ^ random() ^ ::getpid();
  const std::vector<int64_t> info = allgather(
      context, {::getpid(), static_cast<int64_t>(reinterpret_cast<uintptr_t>(nonce.get())),
                nonce[0], nonce[1]});
  int64_t ok = willing ? 1 : 0;
  for (int r = 0; r < n && ok; ++r) {
    if (r == context->rank) continue;
    int64_t seen[2] = {0, 0};
    iovec local{seen, sizeof(seen)};
    iovec remote{reinterpret_cast<void*>(static_cast<uintptr_t>(info[4 * r + 1])), sizeof(seen)};
    const ssize_t got = ::process_vm_readv(static_cast<pid_t>(info[4 * r]), &local, 1, &remote, 1, 0);
    ok = got == static_cast<ssize_t>(sizeof(seen)) && seen[0] == info[4 * r + 2] &&
         seen[1] == info[4 * r + 3];
  }
  // The nonce stays alive until every rank has read it.
  const std::vector<int64_t> oks = allgather(context, {ok});
  if (std::any_of(oks.begin(), oks.end(), [](int64_t v) { return v == 0; })) return nullptr;
  std::vector<int64_t> pids(n);
  for (int r = 0; r < n; ++r) pids[r] = info[4 * r];
  return std::unique_ptr<SameHostAllreduce>(new SameHostAllreduce(context, std::move(pids)));
}

SameHostAllreduce::SameHostAllreduce(std::shared_ptr<gloo::Context> context,
                                     std::vector<int64_t> pids)
    : context_(std::move(context)), pids_(std::move(pids)) {}

int64_t SameHostAllreduce::runs() { return g_runs.load(); }

void SameHostAllreduce::read(int peer, uint64_t address, void* out, size_t bytes) const {
  char* dst = static_cast<char*>(out);
  while (bytes > 0) {
    iovec local{dst, bytes};
    iovec remote{reinterpret_cast<void*>(static_cast<uintptr_t>(address)), bytes};
    const ssize_t got = ::process_vm_readv(static_cast<pid_t>(pids_[peer]), &local, 1, &remote, 1, 0);
    if (got <= 0) {
      throw std::runtime_error(absl::StrCat("same-host allreduce: reading rank ", peer, " (pid ",
                                            pids_[peer], ") failed: ", std::strerror(errno)));
    }
    dst += got;
    address += got;
    bytes -= got;
  }
}

void SameHostAllreduce::barrier() const {
  gloo::BarrierOptions opts(context_);
  gloo::barrier(opts);
}

void SameHostAllreduce::run(at::Tensor& flat, Reduction op) {
  const int n = context_->size, me = context_->rank;
  const int64_t numel = flat.numel(), item = flat.element_size();
  // Each rank's buffer, and what it is calling: ranks that disagree (a
  // different size, dtype or reduction) fail together here, before any
  // rank reads another's memory.
  constexpr size_t kFields = 4;
  const std::vector<int64_t> all = allgather(
      context_, {static_cast<int64_t>(reinterpret_cast<uintptr_t>(flat.data_ptr())), numel,
                 static_cast<int64_t>(flat.scalar_type()), static_cast<int64_t>(op)});
  std::vector<int64_t> addresses(n);
  for (int r = 0; r < n; ++r) {
    addresses[r] = all[r * kFields];
    if (all[r * kFields + 1] != numel || all[r * kFields + 2] != all[me * kFields + 2] ||
        all[r * kFields + 3] != all[me * kFields + 3]) {
      throw std::runtime_error(absl::StrCat(
          "same-host allreduce: rank ", r, " allreduces ", all[r * kFields + 1],
          " elements (dtype ", all[r * kFields + 2], ", reduction ", all[r * kFields + 3],
          "), rank ", me, " ", numel, " (dtype ", all[me * kFields + 2], ", reduction ",
          all[me * kFields + 3], "): every rank must make the same call"));
    }
  }
  const ReduceFn reduce = reduce_fn(flat.scalar_type(), op);
  auto begin = [&](int r) { return numel * r / n; };
  // 1. This rank's part: every peer's copy reduced into its own. Peers
  //    write only their own parts, so this part of theirs holds still.
  const int64_t lo = begin(me), hi = begin(me + 1);
  const int64_t step = std::max<int64_t>(1, kScratchBytes / item);
  if (!scratch_.defined() || scratch_.scalar_type() != flat.scalar_type()) {
    scratch_ = at::empty({step}, flat.options());
  }
  for (int peer = 0; peer < n; ++peer) {
    if (peer == me) continue;
    for (int64_t pos = lo; pos < hi; pos += step) {
      const int64_t len = std::min(step, hi - pos);
      char* mine = static_cast<char*>(flat.data_ptr()) + pos * item;
      read(peer, addresses[peer] + pos * item, scratch_.data_ptr(), len * item);
      reduce(mine, mine, scratch_.data_ptr(), len);
    }
  }
  barrier();
  // 2. The peers' reduced parts into this buffer; they read only this
  //    rank's part, which stays as it is.
  for (int peer = 0; peer < n; ++peer) {
    if (peer == me) continue;
    const int64_t from = begin(peer), to = begin(peer + 1);
    read(peer, addresses[peer] + from * item, static_cast<char*>(flat.data_ptr()) + from * item,
         (to - from) * item);
  }
  // No rank may change its buffer while another still reads it.
  barrier();
  g_runs.fetch_add(1);
}

}  // namespace ddprpc::ddp::internal
