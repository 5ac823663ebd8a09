// libFuzzer target: the safetensors header parser (wire::ParseSafetensorsHeader, nlohmann::json
// underneath). The first 8 bytes are the data section's size (little-endian), the rest the JSON
// header text. Every accepted entry must lie inside the data section and have begin <= end.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/strings/string_view.h"
#include "attngrad/wire/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 8) return 0;
  std::uint64_t data_size = 0;
  std::memcpy(&data_size, data, 8);
  const absl::string_view json(reinterpret_cast<const char*>(data) + 8, size - 8);
  absl::StatusOr<attngrad::wire::SafetensorsHeader> header =
      attngrad::wire::ParseSafetensorsHeader(json, data_size, "fuzz");
  if (header.ok()) {
    for (const auto& [name, entry] : header->tensors) {
      if (entry.begin > entry.end || entry.end > data_size) __builtin_trap();
    }
  }
  return 0;
}
