#include "rpc/transport/internal/frame_capture.h"

#include <cstdint>
#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"

namespace ddprpc::rpc::internal {

void capture_frame(const std::string& dir, const char* kind, const grpc::ByteBuffer& frame) {
  std::vector<grpc::Slice> slices;
  if (!frame.Dump(&slices).ok()) return;
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  uint64_t hash = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : bytes) hash = (hash ^ c) * 1099511628211ull;
  const std::string path = absl::StrCat(dir, "/", kind, "-", absl::Hex(hash, absl::kZeroPad16));
  if (FILE* f = std::fopen(path.c_str(), "wb")) {
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
  }
}

}  // namespace ddprpc::rpc::internal
