// attngrad/wire/layer.h (wire and Hugging Face names of the six weights) and
// attngrad/common/status_macros.h.
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attngrad/common/status_macros.h"
#include "attngrad/wire/layer.h"

namespace attngrad::wire {
namespace {

TEST(LayerNamesTest, WireNamesMapBothWays) {
  EXPECT_EQ(WireWeightName(Weight::kQProj), v1::WEIGHT_NAME_Q_PROJ);
  EXPECT_EQ(WireWeightName(Weight::kKNorm), v1::WEIGHT_NAME_K_NORM);
  for (Weight weight : kAllWeights) {
    ASSERT_TRUE(WeightOfWireName(WireWeightName(weight)).has_value());
    EXPECT_EQ(*WeightOfWireName(WireWeightName(weight)), weight);
    // The enum value's name ends with the module name: WEIGHT_NAME_Q_PROJ and "q_proj".
    std::string module = WeightModuleName(weight);
    for (char& c : module) c = static_cast<char>(std::toupper(c));
    EXPECT_EQ(v1::WeightName_Name(WireWeightName(weight)), "WEIGHT_NAME_" + module);
  }
  EXPECT_FALSE(WeightOfWireName(v1::WEIGHT_NAME_UNSPECIFIED).has_value());
  EXPECT_FALSE(WeightOfWireName(7).has_value());
  EXPECT_FALSE(WeightOfWireName(-1).has_value());
}

TEST(LayerNamesTest, GradientFieldsAndConfig) {
  v1::WeightGradients gradients;
  for (Weight weight : kAllWeights)
    MutableGradientTensor(&gradients, weight)->add_shape(IndexOf(weight));
  for (Weight weight : kAllWeights) {
    // The field named like the module holds the weight's gradient.
    const google::protobuf::FieldDescriptor* field =
        gradients.GetDescriptor()->FindFieldByName(WeightModuleName(weight));
    ASSERT_NE(field, nullptr) << WeightModuleName(weight);
    EXPECT_EQ(&gradients.GetReflection()->GetMessage(gradients, field),
              &GradientTensor(gradients, weight));
    EXPECT_EQ(GradientTensor(gradients, weight).shape(0), IndexOf(weight));
  }
  const LayerConfig config{640, 4, 1, 256};
  v1::LayerConfig wire_config;
  LayerConfigToWire(config, &wire_config);
  EXPECT_EQ(wire_config.hidden_size(), 640);
  EXPECT_EQ(wire_config.head_dim(), 256);
  const LayerConfig back = LayerConfigFromWire(wire_config);
  EXPECT_EQ(back.hidden_size, 640);
  EXPECT_EQ(back.num_heads, 4);
  EXPECT_EQ(back.num_kv_heads, 1);
  EXPECT_EQ(back.head_dim, 256);
}

TEST(LayerNamesTest, HuggingFaceNames) {
  EXPECT_EQ(HuggingFaceTensorName(3, Weight::kQProj), "model.layers.3.self_attn.q_proj.weight");
  EXPECT_EQ(HuggingFaceTensorName(0, Weight::kKNorm), "model.layers.0.self_attn.k_norm.weight");
  const std::vector<std::string> plain = {"model.layers.1.self_attn.q_proj.weight",
                                          "model.layers.11.self_attn.q_proj.weight"};
  EXPECT_EQ(*FindLayerTensorName(plain, 1, Weight::kQProj, "ckpt"), plain[0]);
  const std::vector<std::string> multimodal = {
      "language_model.model.layers.2.self_attn.v_proj.weight",
      "model.language_model.layers.3.self_attn.v_proj.weight",
      "vision_tower.model.layers.2.self_attn.v_proj.weightx"};
  EXPECT_EQ(*FindLayerTensorName(multimodal, 2, Weight::kVProj, "ckpt"), multimodal[0]);
  EXPECT_EQ(*FindLayerTensorName(multimodal, 3, Weight::kVProj, "ckpt"), multimodal[1]);
  absl::Status missing = FindLayerTensorName(plain, 5, Weight::kQProj, "ckpt").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(missing.message()).find("ckpt: no tensor model.layers.5"),
            std::string::npos);
  const std::vector<std::string> twice = {"a.model.layers.0.self_attn.o_proj.weight",
                                          "b.model.layers.0.self_attn.o_proj.weight"};
  EXPECT_EQ(FindLayerTensorName(twice, 0, Weight::kOProj, "ckpt").status().code(),
            absl::StatusCode::kInvalidArgument);
}

absl::Status FailIf(bool fail) {
  return fail ? absl::InvalidArgumentError("failed") : absl::OkStatus();
}
absl::StatusOr<std::unique_ptr<int>> MakeValue(bool fail, int value) {
  if (fail) return absl::NotFoundError("no value");
  return std::make_unique<int>(value);
}

absl::Status ReturnIfError(bool fail, int* reached) {
  ATTNGRAD_RETURN_IF_ERROR(FailIf(fail));
  ATTNGRAD_RETURN_IF_ERROR(MakeValue(fail, 1));  // a StatusOr works too
  ++*reached;
  return absl::OkStatus();
}

absl::StatusOr<int> AssignOrReturn(bool fail_first, bool fail_second) {
  ATTNGRAD_ASSIGN_OR_RETURN(auto first, MakeValue(fail_first, 2));  // move-only, new variable
  std::unique_ptr<int> second;
  ATTNGRAD_ASSIGN_OR_RETURN(second, MakeValue(fail_second, 3));        // an existing variable
  ATTNGRAD_ASSIGN_OR_RETURN(const int third, absl::StatusOr<int>(4));  // twice on one name
  return *first * *second * third;
}

TEST(StatusMacrosTest, ReturnIfError) {
  int reached = 0;
  EXPECT_TRUE(ReturnIfError(false, &reached).ok());
  EXPECT_EQ(reached, 1);
  const absl::Status failed = ReturnIfError(true, &reached);
  EXPECT_EQ(failed.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(failed.message(), "failed");
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacrosTest, AssignOrReturn) {
  EXPECT_EQ(*AssignOrReturn(false, false), 24);
  EXPECT_EQ(AssignOrReturn(true, false).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(AssignOrReturn(false, true).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace attngrad::wire
