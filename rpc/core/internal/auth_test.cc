#include "rpc/core/internal/auth.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace ddprpc::rpc::internal {
namespace {

const ProofScope kScope{"store", "grpc", -1, -1};

TEST(AuthCheckerTest, AProofIsAcceptedOnceForItsScopeAndToken) {
  AuthChecker checker("secret");
  const std::string proof = auth_proof("secret", kScope);
  EXPECT_EQ(checker.check_proof(auth_proof("other", kScope), kScope).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(checker.check_proof(proof, {"rpc", "grpc", -1, -1}).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(checker.check_proof(proof, kScope).ok());
  const grpc::Status again = checker.check_proof(proof, kScope);
  EXPECT_EQ(again.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(again.error_message().find("replayed"), std::string::npos) << again.error_message();
}

// More proofs than the process remembers within the window: the ones it
// forgot still cannot be replayed, and fresh ones still get in.
TEST(AuthCheckerTest, ProofsPastTheBoundAreNotForgottenIntoReplayableOnes) {
  AuthChecker checker("secret");
  std::vector<std::string> first;
  for (int i = 0; i < 8; ++i) {
    first.push_back(auth_proof("secret", kScope));
    ASSERT_TRUE(checker.check_proof(first.back(), kScope).ok());
  }
  for (size_t i = 0; i < AuthChecker::kMaxRemembered; ++i) {
    const grpc::Status s = checker.check_proof(auth_proof("secret", kScope), kScope);
    ASSERT_TRUE(s.ok()) << i << ": " << s.error_message();
  }
  for (const std::string& proof : first) {
    EXPECT_EQ(checker.check_proof(proof, kScope).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  const grpc::Status fresh = checker.check_proof(auth_proof("secret", kScope), kScope);
  EXPECT_TRUE(fresh.ok()) << fresh.error_message();
}

}  // namespace
}  // namespace ddprpc::rpc::internal
