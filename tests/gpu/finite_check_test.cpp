// The GPU finite check (attngrad/finite_check.h, kernels/src/cuda/finite_check.cu):
// CountNonFiniteDevice counts NaN and Inf per gradient (every position of a tensor larger than one
// launch covers, through the grid-stride loop), AccumulateIfFiniteDevice adds the gradients when
// every count is 0 and leaves the accumulators bit-identical otherwise. Skipped without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "attngrad/attngrad.h"
#include "attngrad/cuda_resources.h"
#include "attngrad/finite_check.h"
#include "attngrad/layer_weights.h"

namespace {

using attngrad::CountIndexOf;
using attngrad::kAllWeights;
using attngrad::NonFiniteCounts;
using attngrad::PerWeight;
using attngrad::Weight;
using attngrad::cuda::DeviceBuffer;

#define ASSERT_CUDA(expression) ASSERT_EQ((expression), cudaSuccess) << #expression

const attngrad::LayerConfig kConfig = attngrad::LayerConfig::Gemma3_4B();

// Host copies of grad_hidden_states and six weight gradients, with their device twins, plus six
// accumulators and the counts.
class FiniteCheckTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (attngrad_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }

  // Values i * 1e-3 (exact sums with accumulators of 1.0 + i * 1e-3 are not needed: the test
  // compares with the same fp32 addition done on the host).
  void Fill(std::size_t activations) {
    grad_hidden.assign(activations, 0.f);
    for (std::size_t i = 0; i < activations; ++i)
      grad_hidden[i] = 1e-3f * static_cast<float>(i % 97);
    for (Weight weight : kAllWeights) {
      gradients[weight].assign(attngrad::WeightElements(kConfig, weight), 0.f);
      accumulators[weight].assign(gradients[weight].size(), 0.f);
      for (std::size_t i = 0; i < gradients[weight].size(); ++i) {
        gradients[weight][i] = 1e-2f * static_cast<float>(i % 13);
        accumulators[weight][i] = 0.5f + static_cast<float>(i % 7);
      }
    }
  }

  void Upload() {
    ASSERT_CUDA(DeviceBuffer<float>::Create(grad_hidden.size(), &device_grad_hidden));
    ASSERT_CUDA(cudaMemcpy(device_grad_hidden.get(), grad_hidden.data(),
                           grad_hidden.size() * sizeof(float), cudaMemcpyHostToDevice));
    for (Weight weight : kAllWeights) {
      ASSERT_CUDA(DeviceBuffer<float>::Create(gradients[weight].size(), &device_gradients[weight]));
      ASSERT_CUDA(
          DeviceBuffer<float>::Create(accumulators[weight].size(), &device_accumulators[weight]));
      ASSERT_CUDA(cudaMemcpy(device_gradients[weight].get(), gradients[weight].data(),
                             gradients[weight].size() * sizeof(float), cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaMemcpy(device_accumulators[weight].get(), accumulators[weight].data(),
                             accumulators[weight].size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    ASSERT_CUDA(DeviceBuffer<unsigned long long>::Create(attngrad::kCheckedCounts, &counts));
    ASSERT_CUDA(cudaMemset(counts.get(), 0, counts.bytes()));
  }

  // Runs both calls on the default stream; returns the counts.
  NonFiniteCounts CheckAndAccumulate() {
    PerWeight<const float*> gradient_pointers;
    PerWeight<float*> accumulator_pointers;
    for (Weight weight : kAllWeights) {
      gradient_pointers[weight] = device_gradients[weight].get();
      accumulator_pointers[weight] = device_accumulators[weight].get();
    }
    NonFiniteCounts result{};
    EXPECT_TRUE(attngrad::CountNonFiniteDevice(kConfig, device_grad_hidden.get(),
                                               grad_hidden.size(), gradient_pointers, counts.get(),
                                               nullptr)
                    .ok());
    PerWeight<const float*> sums;
    for (Weight weight : kAllWeights) sums[weight] = accumulator_pointers[weight];
    EXPECT_TRUE(attngrad::CountOverflowingSumsDevice(kConfig, gradient_pointers, sums, counts.get(),
                                                     nullptr)
                    .ok());
    EXPECT_TRUE(attngrad::AccumulateIfFiniteDevice(kConfig, gradient_pointers, accumulator_pointers,
                                                   counts.get(), nullptr)
                    .ok());
    EXPECT_EQ(cudaMemcpy(result.data(), counts.get(), counts.bytes(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return result;
  }

  std::vector<float> DeviceAccumulator(Weight weight) {
    std::vector<float> values(accumulators[weight].size());
    EXPECT_EQ(cudaMemcpy(values.data(), device_accumulators[weight].get(),
                         values.size() * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return values;
  }

  std::vector<float> grad_hidden;
  PerWeight<std::vector<float>> gradients, accumulators;
  DeviceBuffer<float> device_grad_hidden;
  PerWeight<DeviceBuffer<float>> device_gradients, device_accumulators;
  DeviceBuffer<unsigned long long> counts;
};

TEST_F(FiniteCheckTest, FiniteGradientsAreAdded) {
  Fill(3 * 2560);
  Upload();
  const NonFiniteCounts counts = CheckAndAccumulate();
  for (unsigned long long count : counts) EXPECT_EQ(count, 0u);
  for (Weight weight : kAllWeights) {
    const std::vector<float> sum = DeviceAccumulator(weight);
    for (std::size_t i = 0; i < sum.size(); ++i) {
      ASSERT_EQ(sum[i], accumulators[weight][i] + gradients[weight][i])
          << attngrad::WeightModuleName(weight) << "[" << i << "]";
    }
  }
}

TEST_F(FiniteCheckTest, AnyNonFiniteValueIsCountedAndNothingIsAdded) {
  // grad_hidden_states larger than one launch's threads (1024 blocks of 256), so the last values
  // are reached only through the grid-stride loop.
  const std::size_t activations = 1024 * 256 * 3 + 11;
  Fill(activations);
  const float inf = std::numeric_limits<float>::infinity();
  grad_hidden[5] = std::numeric_limits<float>::quiet_NaN();
  grad_hidden[activations - 1] = -inf;
  gradients[Weight::kKNorm][3] = inf;
  gradients[Weight::kOProj].back() = std::numeric_limits<float>::quiet_NaN();
  Upload();
  const NonFiniteCounts counts = CheckAndAccumulate();
  EXPECT_EQ(counts[0], 2u);
  EXPECT_EQ(counts[CountIndexOf(Weight::kQProj)], 0u);
  EXPECT_EQ(counts[CountIndexOf(Weight::kOProj)], 1u);
  EXPECT_EQ(counts[CountIndexOf(Weight::kKNorm)], 1u);
  for (Weight weight : kAllWeights) {
    EXPECT_EQ(DeviceAccumulator(weight), accumulators[weight])
        << attngrad::WeightModuleName(weight) << ": changed although the batch was not finite";
  }
}

TEST_F(FiniteCheckTest, MisalignedTensorsAreCheckedElementByElement) {
  // The kernels read 16 bytes at a time from 16-byte aligned tensors; one starting 4 bytes past
  // an alignment boundary goes through the element-wise loop, with the same counts.
  const std::size_t activations = 1024 * 256 * 2 + 7;
  Fill(activations);
  grad_hidden[1] = std::numeric_limits<float>::quiet_NaN();
  grad_hidden[4] = std::numeric_limits<float>::infinity();
  grad_hidden[activations - 1] = -std::numeric_limits<float>::infinity();
  Upload();
  PerWeight<const float*> gradient_pointers;
  for (Weight weight : kAllWeights) gradient_pointers[weight] = device_gradients[weight].get();
  ASSERT_TRUE(attngrad::CountNonFiniteDevice(kConfig, device_grad_hidden.get() + 1, activations - 1,
                                             gradient_pointers, counts.get(), nullptr)
                  .ok());
  NonFiniteCounts result{};
  ASSERT_CUDA(cudaMemcpy(result.data(), counts.get(), counts.bytes(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(result[0], 3u);
  for (Weight weight : kAllWeights) EXPECT_EQ(result[CountIndexOf(weight)], 0u);
}

// Finite gradients whose add would overflow a sum: counted per weight, and nothing is added.
TEST_F(FiniteCheckTest, AnAddThatWouldOverflowASumIsCountedAndNotMade) {
  Fill(2560);
  const float big = 0.75f * std::numeric_limits<float>::max();
  gradients[Weight::kVProj][5] = big;
  accumulators[Weight::kVProj][5] = big;
  gradients[Weight::kKNorm][0] = -big;
  accumulators[Weight::kKNorm][0] = -big;
  Upload();
  const NonFiniteCounts counts = CheckAndAccumulate();
  for (Weight weight : kAllWeights) EXPECT_EQ(counts[CountIndexOf(weight)], 0u);
  EXPECT_EQ(counts[attngrad::OverflowIndexOf(Weight::kVProj)], 1u);
  EXPECT_EQ(counts[attngrad::OverflowIndexOf(Weight::kKNorm)], 1u);
  EXPECT_EQ(counts[attngrad::OverflowIndexOf(Weight::kQProj)], 0u);
  for (Weight weight : kAllWeights) EXPECT_EQ(DeviceAccumulator(weight), accumulators[weight]);
}

TEST_F(FiniteCheckTest, NonFiniteGradHiddenStatesAloneBlocksTheAdd) {
  Fill(2560);
  grad_hidden[0] = std::numeric_limits<float>::infinity();
  Upload();
  const NonFiniteCounts counts = CheckAndAccumulate();
  EXPECT_EQ(counts[0], 1u);
  for (Weight weight : kAllWeights) EXPECT_EQ(DeviceAccumulator(weight), accumulators[weight]);
}

}  // namespace
