// Rotary inputs that must be refused (both were once accepted): a position id of INT64_MIN passed
// the range check (std::llabs(INT64_MIN) overflows to a negative number), and rope_theta = 5e-324
// (finite, > 0) built NaN cos/sin tables that poisoned an accumulation window. Checked through
// ParseBackwardRequest (what the service calls) and CheckRotaryInputs itself.
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "attngrad/wire/tensor.h"
#include "rpc/backward_request.h"
#include "rpc/rotary.h"

namespace attngrad::server {
namespace {

// A one-token request of the Gemma-3 4B layer with the given position ids and theta.
v1::BackwardRequest PositionsRequest(const std::vector<std::int64_t>& ids, double theta) {
  const LayerConfig config = LayerConfig::Gemma3_4B();
  const int seq_len = static_cast<int>(ids.size());
  const std::vector<float> values(static_cast<size_t>(seq_len) * config.hidden_size, 0.01f);
  const std::vector<std::int64_t> shape = {1, seq_len, config.hidden_size};
  v1::BackwardRequest request;
  request.set_mode(v1::GRADIENT_MODE_RETURN);
  *request.mutable_hidden_states() = wire::MakeTensor(values, shape);
  *request.mutable_grad_output() = wire::MakeTensor(values, shape);
  for (std::int64_t id : ids) request.mutable_positions()->add_position_ids(id);
  request.mutable_positions()->set_rope_theta(theta);
  return request;
}

absl::StatusOr<ParsedBackward> Parse(const v1::BackwardRequest& request) {
  return ParseBackwardRequest(request, LayerConfig::Gemma3_4B(), BatchLimits());
}

bool AllFinite(const std::vector<float>& values) {
  for (float value : values) {
    if (!std::isfinite(value)) return false;
  }
  return true;
}

TEST(RotaryInputTest, Int64MinPositionIsRefused) {
  const std::int64_t lowest = std::numeric_limits<std::int64_t>::min();
  const absl::StatusOr<ParsedBackward> parsed = Parse(PositionsRequest({0, lowest}, 0));
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("position_ids"), std::string::npos) << parsed.status();
}

TEST(RotaryInputTest, SubnormalThetaIsRefused) {
  // The 5e-324 with the first positions; 1e-310 overflows only with a large position.
  for (const auto& [theta, last_id] :
       std::vector<std::pair<double, std::int64_t>>{{5e-324, 3}, {1e-310, kMaxRotaryPosition}}) {
    const absl::StatusOr<ParsedBackward> parsed =
        Parse(PositionsRequest({0, 1, 2, last_id}, theta));
    ASSERT_FALSE(parsed.ok()) << theta << ": accepted; tables finite: "
                              << (AllFinite(parsed->job->request.cos) &&
                                  AllFinite(parsed->job->request.sin));
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find("rope_theta"), std::string::npos) << parsed.status();
  }
}

TEST(RotaryInputTest, AcceptedPositionsMakeFiniteTables) {
  // The extremes: |id| = 2^40 with a small but normal theta, the default, a huge theta (accepted,
  // finite tables); with a subnormal theta 1e-310 those ids overflow the angle (refused).
  for (double theta : {0.0, 1e-300, 1e-310, 1.0, 1e6, 1e300}) {
    const absl::StatusOr<ParsedBackward> parsed =
        Parse(PositionsRequest({-kMaxRotaryPosition, 0, kMaxRotaryPosition}, theta));
    if (theta == 1e-310) {
      EXPECT_FALSE(parsed.ok()) << theta;
      continue;
    }
    ASSERT_TRUE(parsed.ok()) << theta << ": " << parsed.status();
    EXPECT_TRUE(AllFinite(parsed->job->request.cos)) << theta;
    EXPECT_TRUE(AllFinite(parsed->job->request.sin)) << theta;
  }
}

// Positions shared by every sequence ([S]) give each sequence the tables of the same positions
// given per sequence ([B,S]), bit for bit (the shared tables are computed once and copied).
TEST(RotaryInputTest, SharedPositionsGiveEverySequenceTheSameTables) {
  constexpr int kBatch = 3, kSeqLen = 5, kHeadDim = 8;
  const std::vector<std::int64_t> shared = {0, 7, 3, 100000, -2};
  std::vector<std::int64_t> per_sequence;
  for (int b = 0; b < kBatch; ++b)
    per_sequence.insert(per_sequence.end(), shared.begin(), shared.end());
  const std::size_t size = kBatch * kSeqLen * kHeadDim;
  std::vector<float> cos_shared(size), sin_shared(size), cos_each(size), sin_each(size);
  BuildRotaryTables(shared, kBatch, kSeqLen, kHeadDim, 10000.0, absl::MakeSpan(cos_shared),
                    absl::MakeSpan(sin_shared));
  BuildRotaryTables(per_sequence, kBatch, kSeqLen, kHeadDim, 10000.0, absl::MakeSpan(cos_each),
                    absl::MakeSpan(sin_each));
  EXPECT_EQ(cos_shared, cos_each);
  EXPECT_EQ(sin_shared, sin_each);
  EXPECT_NE(cos_shared[kSeqLen * kHeadDim + kHeadDim], 1.0f);  // sequence 1, position 7: filled
}

TEST(RotaryInputTest, CheckRotaryInputs) {
  const std::int64_t lowest = std::numeric_limits<std::int64_t>::min();
  const std::int64_t highest = std::numeric_limits<std::int64_t>::max();
  const std::vector<std::int64_t> ordinary = {0, 1, 4095};
  EXPECT_TRUE(CheckRotaryInputs(ordinary, 128, 10000.0).ok());
  EXPECT_TRUE(CheckRotaryInputs({-kMaxRotaryPosition, kMaxRotaryPosition}, 128, 10000.0).ok());
  EXPECT_FALSE(CheckRotaryInputs({lowest}, 128, 10000.0).ok());
  EXPECT_FALSE(CheckRotaryInputs({highest}, 128, 10000.0).ok());
  EXPECT_FALSE(CheckRotaryInputs({-kMaxRotaryPosition - 1}, 128, 10000.0).ok());
  EXPECT_FALSE(CheckRotaryInputs({kMaxRotaryPosition + 1}, 128, 10000.0).ok());
  EXPECT_FALSE(CheckRotaryInputs(ordinary, 128, 5e-324).ok());
  EXPECT_FALSE(CheckRotaryInputs(ordinary, 128, 0.0).ok());
  EXPECT_FALSE(CheckRotaryInputs(ordinary, 128, -1.0).ok());
  EXPECT_FALSE(CheckRotaryInputs(ordinary, 128, std::nan("")).ok());
  EXPECT_FALSE(CheckRotaryInputs(ordinary, 128, std::numeric_limits<double>::infinity()).ok());
  // A small theta is fine for small positions and refused once position * inv_freq overflows.
  EXPECT_TRUE(CheckRotaryInputs({0, 1}, 128, 1e-310).ok());
  EXPECT_FALSE(CheckRotaryInputs({0, kMaxRotaryPosition}, 128, 1e-310).ok());
  EXPECT_TRUE(CheckRotaryInputs({0, kMaxRotaryPosition}, 128, 1e-300).ok());
  // A linear RoPE scaling factor divides the frequencies: a tiny one overflows, 8 (Gemma-3's
  // global layers) only shrinks the angles.
  EXPECT_FALSE(CheckRotaryInputs({0, 1}, 128, 10000.0, 1e-310).ok());
  EXPECT_TRUE(CheckRotaryInputs({0, kMaxRotaryPosition}, 128, 10000.0, 8.0).ok());
  // Every accepted input builds finite tables.
  for (double theta : {1e-310, 1e-300, 1e-3, 1.0, 10000.0, 1e300}) {
    for (std::int64_t id : {std::int64_t{0}, std::int64_t{1}, std::int64_t{12345},
                            kMaxRotaryPosition, -kMaxRotaryPosition}) {
      const std::vector<std::int64_t> ids = {id};
      if (!CheckRotaryInputs(ids, 128, theta).ok()) continue;
      std::vector<float> cos(128), sin(128);
      BuildRotaryTables(ids, 1, 1, 128, theta, absl::MakeSpan(cos), absl::MakeSpan(sin));
      EXPECT_TRUE(AllFinite(cos) && AllFinite(sin)) << theta << " " << id;
    }
  }
}

}  // namespace
}  // namespace attngrad::server
