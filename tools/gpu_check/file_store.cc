// gpu_check's store in the CMake build (no gRPC on the GPU machine): the
// methods of rpc::Store over a directory, one file per key. Only one
// process uses it, so a key's file is written whole and renamed into place.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tools/gpu_check/check_store.h"

namespace ddprpc::rpc {
namespace {

std::string key_path(const std::string& dir, std::string key) {
  for (char& c : key) {
    if (c == '/') c = '_';
  }
  return dir + "/" + key;
}

}  // namespace

Store::Store(const std::string& host, int, absl::Duration timeout, const Security&)
    : address_(host), timeout_(timeout) {}
Store::~Store() = default;

void Store::set(const std::string& key, const std::string& value) {
  const std::string path = key_path(address_, key);
  {
    std::ofstream out(path + ".tmp", std::ios::binary);
    out << value;
  }
  std::rename((path + ".tmp").c_str(), path.c_str());
}

std::string Store::get(const std::string& key) {
  const std::string path = key_path(address_, key);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::stringstream s;
      s << in.rdbuf();
      return s.str();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  throw std::runtime_error("gpu_check file store: timed out waiting for " + key);
}

int64_t Store::add(const std::string& key, int64_t amount) {
  std::string old;
  std::ifstream in(key_path(address_, key));
  if (in) std::getline(in, old);
  const int64_t value = (old.empty() ? 0 : std::stoll(old)) + amount;
  set(key, std::to_string(value));
  return value;
}

void Store::wait(const std::vector<std::string>& keys, absl::Duration) {
  for (const auto& k : keys) get(k);
}

bool Store::check(const std::vector<std::string>& keys) {
  for (const auto& k : keys) {
    if (!std::ifstream(key_path(address_, k))) return false;
  }
  return true;
}

}  // namespace ddprpc::rpc

namespace gpu_check {

std::shared_ptr<ddprpc::rpc::Store> make_store() {
  char dir[] = "/tmp/gpu_check_store.XXXXXX";
  if (mkdtemp(dir) == nullptr) throw std::runtime_error("gpu_check: mkdtemp failed");
  return std::make_shared<ddprpc::rpc::Store>(dir, 0, absl::Seconds(60), ddprpc::rpc::Security{});
}

}  // namespace gpu_check
