#include "models/categorical.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace ddprpc::models {
namespace {

TEST(CategoricalTest, IndexFollowsTheCumulativeSum) {
  const std::vector<float> p = {0.25f, 0.0f, 0.5f, 0.25f};
  EXPECT_EQ(categorical_index(p.data(), 4, 0.0), 0);
  EXPECT_EQ(categorical_index(p.data(), 4, 0.2499), 0);
  EXPECT_EQ(categorical_index(p.data(), 4, 0.25), 2);  // skips the zero entry
  EXPECT_EQ(categorical_index(p.data(), 4, 0.7499), 2);
  EXPECT_EQ(categorical_index(p.data(), 4, 0.75), 3);
  EXPECT_EQ(categorical_index(p.data(), 4, 0.999999), 3);
}

TEST(CategoricalTest, UnnormalizedAndTrailingZeros) {
  const std::vector<float> p = {2.0f, 6.0f, 0.0f};
  EXPECT_EQ(categorical_index(p.data(), 3, 0.2), 0);
  EXPECT_EQ(categorical_index(p.data(), 3, 0.3), 1);
  EXPECT_EQ(categorical_index(p.data(), 3, 1.0), 1);  // never the trailing zero
}

TEST(CategoricalTest, FrequenciesMatchTheProbabilities) {
  const std::vector<float> p = {0.1f, 0.6f, 0.3f};
  std::mt19937_64 rng(7);
  std::vector<int> counts(3, 0);
  const int draws = 200000;
  for (int i = 0; i < draws; ++i) ++counts[sample_categorical(p.data(), 3, rng)];
  for (int k = 0; k < 3; ++k) {
    EXPECT_NEAR(counts[k] / static_cast<double>(draws), p[k], 0.005) << "action " << k;
  }
}

}  // namespace
}  // namespace ddprpc::models
