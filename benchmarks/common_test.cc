// The percentile method both sides of every comparison use: numpy's default.
#include "benchmarks/common.h"

#include <vector>

#include "benchmarks/testing/subprocess.h"
#include "gtest/gtest.h"

namespace ddprpc::benchmarks {
namespace {

TEST(PercentileTest, MatchesNumpysLinearInterpolation) {
  // numpy.percentile([3, 1, 4, 1, 5, 9, 2, 6], [0, 50, 75, 90, 95, 100])
  // = [1.0, 3.5, 5.25, 6.9, 7.95, 9.0] (python3-numpy 1.24).
  const std::vector<double> v = {3, 1, 4, 1, 5, 9, 2, 6};
  const double want[][2] = {{0, 1.0}, {50, 3.5}, {75, 5.25}, {90, 6.9}, {95, 7.95}, {100, 9.0}};
  for (const auto& [pct, value] : want) {
    EXPECT_NEAR(percentile(v, pct / 100), value, 1e-12) << "p" << pct;
    EXPECT_NEAR(testing::numpy_percentile(v, pct), value, 1e-12) << "p" << pct;
  }
  EXPECT_EQ(percentile({7.5}, 0.9), 7.5);
  EXPECT_EQ(percentile({}, 0.5), 0);
  // The median of an even count is the mean of the middle two.
  EXPECT_EQ(percentile({4, 1, 3, 2}, 0.5), 2.5);
}

// This test binary does not link //third_party:tcmalloc: the lookup must
// not name an allocator that is not there (the benchmarks' tests see the
// other side).
TEST(AllocatorNameTest, NamesGlibcWithoutTcmalloc) { EXPECT_EQ(allocator_name(), "glibc malloc"); }

}  // namespace
}  // namespace ddprpc::benchmarks
