// attngrad/wire/safetensors.h: what WriteSafetensors writes reads back (fp32, fp16, bf16), files as
// Hugging Face writes them, sharded checkpoints through their index, and malformed files (bad JSON,
// offsets outside the file, wrong byte counts) giving errors, never crashes.
#include "attngrad/wire/safetensors.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attngrad/wire/dtype.h"
#include "temp_dir.h"

namespace attngrad::wire {
namespace {

using testing::TempDir;

// A safetensors file of `header` (JSON text, written as it is) followed by `data`.
void WriteRawSafetensors(const std::string& path, const std::string& header,
                         const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  const std::uint64_t length = header.size();
  out.write(reinterpret_cast<const char*>(&length), 8);
  out << header << data;
}

void WriteText(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(SafetensorsTest, ReadsWhatItWrites) {
  TempDir dir;
  const std::vector<float> a = {1, 2, 3, 4};
  const std::vector<float> b = {-1, 0.5f, 8};
  const std::vector<float> c = {1.5f, -2.0f, 0.25f};
  const std::string path = dir.File("x.safetensors");
  ASSERT_TRUE(WriteSafetensors(path,
                               {{"a", {2, 2}, a},
                                {"b.weight", {3}, b, v1::DTYPE_FLOAT16},
                                {"c \"quoted\"", {3}, c, v1::DTYPE_BFLOAT16}},
                               {{"format", "pt"}})
                  .ok());
  EXPECT_EQ(std::filesystem::file_size(path) % 8, (4 * 4 + 3 * 2 + 3 * 2) % 8);
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->tensors().size(), 3u);
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_EQ(file->tensors().at("a").dtype, "F32");
  EXPECT_EQ(file->tensors().at("a").shape, (std::vector<std::int64_t>{2, 2}));
  EXPECT_EQ(file->tensors().at("b.weight").dtype, "F16");
  EXPECT_EQ(file->tensors().at("c \"quoted\"").dtype, "BF16");
  EXPECT_EQ(*file->ReadFloats("a"), a);
  EXPECT_EQ(*file->ReadFloats("b.weight"), b);
  EXPECT_EQ(*file->ReadFloats("c \"quoted\""), c);
  absl::StatusOr<std::string> bytes = file->ReadBytes("b.weight");
  ASSERT_TRUE(bytes.ok());
  ASSERT_EQ(bytes->size(), 6u);
  EXPECT_EQ(static_cast<unsigned char>((*bytes)[0]) | static_cast<unsigned char>((*bytes)[1]) << 8,
            FloatToHalf(-1.0f));
  EXPECT_EQ(file->ReadBytes("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(file->Find("nope").status().code(), absl::StatusCode::kNotFound);

  // Shapes must match the values; names are unique.
  EXPECT_FALSE(WriteSafetensors(dir.File("y.safetensors"), {{"a", {3}, a}}).ok());
  EXPECT_FALSE(WriteSafetensors(dir.File("y.safetensors"), {{"a", {4}, a}, {"a", {4}, a}}).ok());
  // No tensors at all is a valid file.
  ASSERT_TRUE(WriteSafetensors(dir.File("empty.safetensors"), {}).ok());
  EXPECT_TRUE(SafetensorsFile::Open(dir.File("empty.safetensors"))->tensors().empty());
}

TEST(SafetensorsTest, ReadsHuggingFaceFilesWithOtherDTypes) {
  TempDir dir;
  const std::uint16_t bf16[2] = {FloatToBFloat16(1.5f), FloatToBFloat16(-2.0f)};
  const std::int64_t steps[1] = {7};
  std::string data(reinterpret_cast<const char*>(bf16), 4);
  data.append(reinterpret_cast<const char*>(steps), 8);
  const std::string path = dir.File("hf.safetensors");
  WriteRawSafetensors(path,
                      R"({"__metadata__":{"format":"pt"},)"
                      R"("w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
                      R"("step":{"dtype":"I64","shape":[],"data_offsets":[4,12]}})",
                      data);
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(*file->ReadFloats("w"), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(file->ReadBytes("step")->size(), 8u);
  absl::Status not_float = file->ReadFloats("step").status();
  EXPECT_EQ(not_float.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(not_float.message()).find("I64"), std::string::npos) << not_float;
}

TEST(SafetensorsTest, MalformedFilesAreErrorsNotCrashes) {
  TempDir dir;
  const std::string eight_bytes(8, '\0');
  struct Case {
    const char* what;
    std::string header;
    std::string data;
  };
  const Case cases[] = {
      {"truncated JSON", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0})", eight_bytes},
      {"not JSON", "hello", eight_bytes},
      {"not an object", "[1,2]", eight_bytes},
      {"end past the data", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})",
       eight_bytes},
      {"begin after end", R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", eight_bytes},
      {"huge offsets",
       R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551608,18446744073709551615]}})",
       eight_bytes},
      {"offsets too big for uint64", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,1e30]}})",
       eight_bytes},
      {"negative offset", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})",
       eight_bytes},
      {"three offsets", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}})", eight_bytes},
      {"bytes != shape x dtype", R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
       eight_bytes},
      {"negative dimension", R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})",
       eight_bytes},
      {"overflowing shape",
       R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}})",
       eight_bytes},
      {"fractional dimension", R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})",
       eight_bytes},
      {"no dtype", R"({"w":{"shape":[2],"data_offsets":[0,8]}})", eight_bytes},
      {"dtype not a string", R"({"w":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", eight_bytes},
      {"entry not an object", R"({"w":[1]})", eight_bytes},
      {"metadata not an object", R"({"__metadata__":3})", eight_bytes},
      {"deeply nested", std::string(100000, '['), eight_bytes},
  };
  for (const Case& test_case : cases) {
    const std::string path = dir.File("bad.safetensors");
    WriteRawSafetensors(path, test_case.header, test_case.data);
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument)
        << test_case.what << ": " << file.status();
  }
  // Header lengths that point past the file, and files shorter than the length field.
  {
    const std::string path = dir.File("long.safetensors");
    std::ofstream out(path, std::ios::binary);
    const std::uint64_t length = 1000;
    out.write(reinterpret_cast<const char*>(&length), 8);
    out << "{}";
  }
  EXPECT_EQ(SafetensorsFile::Open(dir.File("long.safetensors")).status().code(),
            absl::StatusCode::kInvalidArgument);
  {
    const std::string path = dir.File("huge.safetensors");
    std::ofstream out(path, std::ios::binary);
    const std::uint64_t length = ~std::uint64_t{0};
    out.write(reinterpret_cast<const char*>(&length), 8);
  }
  EXPECT_EQ(SafetensorsFile::Open(dir.File("huge.safetensors")).status().code(),
            absl::StatusCode::kInvalidArgument);
  WriteText(dir.File("short.safetensors"), "abc");
  EXPECT_EQ(SafetensorsFile::Open(dir.File("short.safetensors")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SafetensorsFile::Open(dir.File("missing.safetensors")).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, HeaderJsonIsReadInFull) {
  // Escapes in names (as the old hand-written readers had to get right), numbers written as
  // integers, whitespace, and metadata of other types (ignored).
  absl::StatusOr<SafetensorsHeader> header = ParseSafetensorsHeader(
      R"( {"__metadata__": {"format": "pt", "step": 3},
           "x\"\u00e9\ud83d\ude00": {"dtype": "BF16", "shape": [1, 2], "data_offsets": [0, 4]}} )",
      4, "memory");
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->metadata.size(), 1u);
  EXPECT_EQ(header->metadata.at("format"), "pt");
  ASSERT_EQ(header->tensors.count("x\"\xc3\xa9\xf0\x9f\x98\x80"), 1u);
  for (const char* bad : {"", "{", R"({"a":})", "[1,]", R"({"a":1} x)", R"("\q")", "01x", "[1 2]",
                          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},})"}) {
    EXPECT_EQ(ParseSafetensorsHeader(bad, 4, "memory").status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(SafetensorsTest, ParsesAHeaderInMemory) {
  absl::StatusOr<SafetensorsHeader> header = ParseSafetensorsHeader(
      R"({"a":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]}})", 8, "memory");
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->tensors.at("a").end, 8u);
  absl::Status outside =
      ParseSafetensorsHeader(R"({"a":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]}})", 7,
                             "memory")
          .status();
  EXPECT_NE(std::string(outside.message()).find("memory: tensor a: data_offsets [0,8] outside"),
            std::string::npos)
      << outside;
}

class ShardedCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(WriteSafetensors(dir_.File("model-00001-of-00002.safetensors"),
                                 {{"model.embed.weight", {2}, first_},
                                  {"model.layers.0.self_attn.q_proj.weight", {2}, second_}})
                    .ok());
    ASSERT_TRUE(WriteSafetensors(
                    dir_.File("model-00002-of-00002.safetensors"),
                    {{"model.layers.1.self_attn.q_proj.weight", {2}, third_, v1::DTYPE_BFLOAT16},
                     {"not.in.the.index", {2}, first_}})
                    .ok());
  }
  void WriteIndex(const std::string& weight_map) {
    WriteText(dir_.File("model.safetensors.index.json"),
              R"({"metadata":{"total_size":20},"weight_map":)" + weight_map + "}");
  }

  TempDir dir_;
  const std::vector<float> first_ = {1, 2}, second_ = {3, 4}, third_ = {5, 6};
};

TEST_F(ShardedCheckpointTest, ReadsEveryTensorThroughTheIndex) {
  WriteIndex(R"({"model.embed.weight":"model-00001-of-00002.safetensors",
                 "model.layers.0.self_attn.q_proj.weight":"model-00001-of-00002.safetensors",
                 "model.layers.1.self_attn.q_proj.weight":"model-00002-of-00002.safetensors"})");
  absl::StatusOr<std::map<std::string, std::string>> index =
      ReadSafetensorsIndex(dir_.File("model.safetensors.index.json"));
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->size(), 3u);
  EXPECT_EQ(index->at("model.embed.weight"), "model-00001-of-00002.safetensors");
  // The folder and the index file open the same checkpoint.
  for (const std::string& path : {dir_.path(), dir_.File("model.safetensors.index.json")}) {
    absl::StatusOr<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::Open(path);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    EXPECT_EQ(
        checkpoint->TensorNames(),
        (std::vector<std::string>{"model.embed.weight", "model.layers.0.self_attn.q_proj.weight",
                                  "model.layers.1.self_attn.q_proj.weight"}));
    EXPECT_EQ(*checkpoint->ReadFloats("model.embed.weight"), first_);
    EXPECT_EQ(*checkpoint->ReadFloats("model.layers.0.self_attn.q_proj.weight"), second_);
    EXPECT_EQ(*checkpoint->ReadFloats("model.layers.1.self_attn.q_proj.weight"), third_);
    EXPECT_EQ((*checkpoint->Find("model.layers.1.self_attn.q_proj.weight"))->dtype, "BF16");
    EXPECT_EQ(checkpoint->ReadBytes("model.layers.1.self_attn.q_proj.weight")->size(), 4u);
    EXPECT_EQ(checkpoint->ReadFloats("not.in.the.index").status().code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(checkpoint->FileOf("not.in.the.index"), nullptr);
  }
}

TEST_F(ShardedCheckpointTest, ASingleFileIsACheckpointToo) {
  absl::StatusOr<SafetensorsCheckpoint> checkpoint =
      SafetensorsCheckpoint::Open(dir_.File("model-00002-of-00002.safetensors"));
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ(checkpoint->TensorNames().size(), 2u);
  EXPECT_EQ(*checkpoint->ReadFloats("not.in.the.index"), first_);
}

TEST_F(ShardedCheckpointTest, BadIndexesAreErrors) {
  const std::string index = dir_.File("model.safetensors.index.json");
  WriteIndex(R"({"model.embed.weight":"model-00003-of-00002.safetensors"})");
  EXPECT_EQ(SafetensorsCheckpoint::Open(index).status().code(), absl::StatusCode::kNotFound);
  WriteIndex(R"({"model.missing.weight":"model-00001-of-00002.safetensors"})");
  EXPECT_EQ(SafetensorsCheckpoint::Open(index).status().code(), absl::StatusCode::kInvalidArgument);
  WriteIndex(R"({"model.embed.weight":"../elsewhere.safetensors"})");
  EXPECT_EQ(SafetensorsCheckpoint::Open(index).status().code(), absl::StatusCode::kInvalidArgument);
  WriteIndex(R"({"model.embed.weight":7})");
  EXPECT_EQ(SafetensorsCheckpoint::Open(index).status().code(), absl::StatusCode::kInvalidArgument);
  WriteIndex(R"(["not a map"])");
  EXPECT_EQ(SafetensorsCheckpoint::Open(index).status().code(), absl::StatusCode::kInvalidArgument);
  WriteText(index, R"({"weight_map": {"a": "b",}})");
  EXPECT_EQ(SafetensorsCheckpoint::Open(index).status().code(), absl::StatusCode::kInvalidArgument);
  TempDir empty;
  EXPECT_EQ(SafetensorsCheckpoint::Open(empty.path()).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace attngrad::wire
