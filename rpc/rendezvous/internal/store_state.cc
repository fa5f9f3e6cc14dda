#include "rpc/rendezvous/internal/store_state.h"

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"

namespace ddprpc::rpc::internal {
namespace {

grpc::Status invalid(const std::string& why) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, why);
}

grpc::Status check_key(const std::string& key) {
  if (key.empty()) return invalid("empty key");
  if (key.size() > StoreState::kMaxKeyBytes) {
    return invalid(absl::StrCat("key of ", key.size(), " bytes (at most ",
                                StoreState::kMaxKeyBytes, ")"));
  }
  return grpc::Status::OK;
}

// `what` (a value of a request) within kMaxValueBytes.
grpc::Status check_value(const std::string& value, absl::string_view what) {
  if (value.size() > StoreState::kMaxValueBytes) {
    return invalid(absl::StrCat(what, " of ", value.size(), " bytes (at most ",
                                StoreState::kMaxValueBytes, ")"));
  }
  return grpc::Status::OK;
}

grpc::Status check_timeout(int64_t timeout_ms) {
  if (timeout_ms < 0 || timeout_ms > StoreState::kMaxTimeoutMs) {
    return invalid(absl::StrCat("timeout of ", timeout_ms, " ms"));
  }
  return grpc::Status::OK;
}

// A key for error messages: printable, short.
std::string shown(const std::string& key) {
  std::string out = key.substr(0, 128);
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) c = '?';
  }
  return out;
}

}  // namespace

grpc::Status StoreState::put(const std::string& key, std::string value) {
  auto it = data_.find(key);
  const size_t old = it == data_.end() ? 0 : key.size() + it->second.size();
  const size_t now = key.size() + value.size();
  if (it == data_.end() && data_.size() >= kMaxKeys) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("the store holds ", data_.size(), " keys already"));
  }
  if (bytes_ - old + now > kMaxBytes) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("the store holds ", bytes_, " bytes already"));
  }
  bytes_ = bytes_ - old + now;
  data_[key] = std::move(value);
  return grpc::Status::OK;
}

grpc::Status StoreState::set(const rendezvous::StoreRequest& req, rendezvous::StoreResponse*) {
  grpc::Status ok = check_key(req.key());
  if (ok.ok()) ok = check_value(req.value(), "value");
  if (!ok.ok()) return ok;
  absl::MutexLock lock(&mu_);
  return put(req.key(), req.value());
}

// The largest compare_set request gRPC lets through (key, both values and
// their tags and lengths) is one the store reads.
static_assert(StoreState::kMaxKeyBytes + 2 * StoreState::kMaxValueBytes + 64 <=
              static_cast<size_t>(StoreState::kMaxRequestBytes));

grpc::Status StoreState::compare_set(const rendezvous::StoreRequest& req,
                                     rendezvous::StoreResponse* resp) {
  const std::string& expected = req.value();
  grpc::Status ok = check_key(req.key());
  if (ok.ok()) ok = check_value(expected, "expected value");
  if (ok.ok()) ok = check_value(req.desired(), "value");
  if (!ok.ok()) return ok;
  absl::MutexLock lock(&mu_);
  auto it = data_.find(req.key());
  if (it == data_.end() && !expected.empty()) {
    resp->set_value(expected);
    return grpc::Status::OK;
  }
  if (it != data_.end() && it->second != expected) {
    resp->set_value(it->second);
    return grpc::Status::OK;
  }
  // put() changes data_ under mu_: its release re-evaluates the conditions
  // of blocked get()/wait() calls, as after set().
  ok = put(req.key(), req.desired());
  if (!ok.ok()) return ok;
  resp->set_value(req.desired());
  return grpc::Status::OK;
}

grpc::Status StoreState::get(const rendezvous::StoreRequest& req, rendezvous::StoreResponse* resp,
                             const std::function<bool()>& cancelled) {
  grpc::Status ok = check_key(req.key());
  if (ok.ok()) ok = check_timeout(req.timeout_ms());
  if (!ok.ok()) return ok;
  absl::MutexLock lock(&mu_);
  ok = await_keys({&req.key()}, req.timeout_ms(), cancelled);
  if (!ok.ok()) return ok;
  resp->set_value(data_[req.key()]);
  return grpc::Status::OK;
}

grpc::Status StoreState::add(const rendezvous::StoreRequest& req, rendezvous::StoreResponse* resp) {
  grpc::Status ok = check_key(req.key());
  if (!ok.ok()) return ok;
  absl::MutexLock lock(&mu_);
  int64_t current = 0;
  auto it = data_.find(req.key());
  if (it != data_.end() && !absl::SimpleAtoi(it->second, &current)) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("key '", shown(req.key()), "' does not hold an integer"));
  }
  if (__builtin_add_overflow(current, req.amount(), &current)) {
    return invalid(absl::StrCat("adding ", req.amount(), " to key '", shown(req.key()),
                                "' overflows"));
  }
  ok = put(req.key(), absl::StrCat(current));
  if (!ok.ok()) return ok;
  resp->set_number(current);
  return grpc::Status::OK;
}

grpc::Status StoreState::wait(const rendezvous::StoreRequest& req, rendezvous::StoreResponse*,
                              const std::function<bool()>& cancelled) {
  if (req.keys_size() > kMaxKeysPerRequest) {
    return invalid(absl::StrCat(req.keys_size(), " keys in one request (at most ",
                                kMaxKeysPerRequest, ")"));
  }
  grpc::Status ok = check_timeout(req.timeout_ms());
  for (const auto& k : req.keys()) {
    if (ok.ok()) ok = check_key(k);
  }
  if (!ok.ok()) return ok;
  std::vector<const std::string*> keys;
  keys.reserve(static_cast<size_t>(req.keys_size()));
  for (const std::string& k : req.keys()) keys.push_back(&k);
  absl::MutexLock lock(&mu_);
  return await_keys(keys, req.timeout_ms(), cancelled);
}

grpc::Status StoreState::check(const rendezvous::StoreRequest& req, rendezvous::StoreResponse* resp) {
  if (req.keys_size() > kMaxKeysPerRequest) {
    return invalid(absl::StrCat(req.keys_size(), " keys in one request (at most ",
                                kMaxKeysPerRequest, ")"));
  }
  absl::MutexLock lock(&mu_);
  bool all = true;
  for (const auto& k : req.keys()) all = all && data_.count(k) > 0;
  resp->set_number(all ? 1 : 0);
  return grpc::Status::OK;
}

void StoreState::stop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
}

grpc::Status StoreState::await_keys(const std::vector<const std::string*>& keys,
                                    int64_t timeout_ms, const std::function<bool()>& cancelled) {
  // Keys are never removed: the keys before `found` exist, and each
  // evaluation (on every change of the store while this waits) looks
  // only past them.
  size_t found = 0;
  auto present = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (found < keys.size() && data_.count(*keys[found])) ++found;
    return found == keys.size();
  };
  if (stopping_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the store is stopping");
  if (present()) return grpc::Status::OK;
  if (waiters_ >= max_waiters_) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat(waiters_, " requests wait for keys already"));
  }
  size_t key_bytes = 0;
  for (const std::string* k : keys) key_bytes += k->size() + kWaitingKeyOverhead;
  if (waiting_key_bytes_ + key_bytes > kMaxWaitingKeyBytes) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("requests wait for keys of ", waiting_key_bytes_ >> 20,
                                     " MiB already; ", keys.size(), " more keys (",
                                     key_bytes >> 10, " KiB) would pass ",
                                     kMaxWaitingKeyBytes >> 20, " MiB"));
  }
  ++waiters_;
  waiting_key_bytes_ += key_bytes;
  const absl::Time deadline = absl::Now() + absl::Milliseconds(timeout_ms);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || present(); };
  bool woken;
  // Wakes up periodically to notice a cancelled client.
  while (!(woken = mu_.AwaitWithDeadline(absl::Condition(&ready),
                                         std::min(deadline, absl::Now() + absl::Milliseconds(200))))) {
    if (cancelled() || absl::Now() >= deadline) break;
  }
  --waiters_;
  waiting_key_bytes_ -= key_bytes;
  if (stopping_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the store is stopping");
  if (!woken) {
    std::vector<std::string> missing;
    for (size_t i = found; i < keys.size() && missing.size() < 8; ++i) {
      if (!data_.count(*keys[i])) missing.push_back(shown(*keys[i]));
    }
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        absl::StrCat("timed out waiting for key(s) ", absl::StrJoin(missing, ", ")));
  }
  return grpc::Status::OK;
}

}  // namespace ddprpc::rpc::internal
