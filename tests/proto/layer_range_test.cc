// attngrad/wire/layer_range.h: the layer maps of tests/fixtures/layer_maps.json (the examples the
// Python client's parser is tested on too) parse to their ranges and are written back as given, or
// are refused; and the span alone, as the server's --layers uses it.
#include "attngrad/wire/layer_range.h"

#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "attngrad/common/read_file.h"

namespace attngrad::wire {
namespace {

nlohmann::json LayerMapExamples() {
  const absl::StatusOr<std::string> text =
      common::ReadFileToString(std::string(ATTNGRAD_FIXTURE_DIR) + "/layer_maps.json");
  EXPECT_TRUE(text.ok()) << text.status();
  return nlohmann::json::parse(text.value_or("{}"));
}

// A fixture layer as the parser gives it: null (every layer) is -1.
int LayerOf(const nlohmann::json& value) { return value.is_null() ? -1 : value.get<int>(); }

TEST(LayerMapExamplesTest, ValidMapsParseToTheirRanges) {
  const nlohmann::json examples = LayerMapExamples();
  ASSERT_FALSE(examples["valid"].empty());
  for (const nlohmann::json& example : examples["valid"]) {
    const std::string text = example["map"].get<std::string>();
    const absl::StatusOr<std::vector<LayerRange>> map = ParseLayerMap(text);
    ASSERT_TRUE(map.ok()) << "\"" << text << "\": " << map.status();
    ASSERT_EQ(map->size(), example["ranges"].size()) << text;
    for (std::size_t i = 0; i < map->size(); ++i) {
      const nlohmann::json& expected = example["ranges"][i];
      EXPECT_EQ((*map)[i].first, LayerOf(expected[0])) << text;
      EXPECT_EQ((*map)[i].last, LayerOf(expected[1])) << text;
      EXPECT_EQ((*map)[i].target, expected[2].get<std::string>()) << text;
    }
    EXPECT_EQ(LayerMapString(*map), example["written"].get<std::string>()) << text;
  }
}

TEST(LayerMapExamplesTest, InvalidMapsAreRefused) {
  const nlohmann::json examples = LayerMapExamples();
  ASSERT_FALSE(examples["invalid"].empty());
  for (const nlohmann::json& example : examples["invalid"]) {
    const std::string text = example.get<std::string>();
    const absl::StatusOr<std::vector<LayerRange>> map = ParseLayerMap(text);
    ASSERT_FALSE(map.ok()) << "\"" << text << "\" was accepted";
    EXPECT_EQ(map.status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
}

TEST(LayerSpanTest, SpansHaveNoTarget) {
  const absl::StatusOr<LayerRange> range = ParseLayerSpan(" 3 - 5 ");
  ASSERT_TRUE(range.ok()) << range.status();
  EXPECT_EQ(range->first, 3);
  EXPECT_EQ(range->last, 5);
  EXPECT_EQ(range->ToString(), "3-5");
  EXPECT_EQ(ParseLayerSpan("7")->ToString(), "7");
  EXPECT_TRUE(ParseLayerSpan("7")->Contains(7));
  EXPECT_FALSE(ParseLayerSpan("7")->Contains(8));
  for (const char* bad : {"", "-1", "+1", "5-2", "a", "1-", "1-2-3"}) {
    EXPECT_FALSE(ParseLayerSpan(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace attngrad::wire
