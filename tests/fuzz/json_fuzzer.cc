// libFuzzer target: the JSON reading of the wire library: nlohmann::json::parse as it is called
// there (exceptions off, a discarded value on error), the dump of what parsed, and
// wire::ReadSafetensorsIndex (a checkpoint's model.safetensors.index.json: a "weight_map" object of
// shard file names) on the same bytes written to a memory file.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "attngrad/wire/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const char* text = reinterpret_cast<const char*>(data);
  const nlohmann::json value = nlohmann::json::parse(text, text + size, nullptr,
                                                     /*allow_exceptions=*/false);
  if (!value.is_discarded()) {
    const std::string dumped = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    const nlohmann::json again = nlohmann::json::parse(dumped, nullptr, false);
    if (again.is_discarded()) __builtin_trap();  // what it writes, it reads back
  }

  const int fd = memfd_create("index.json", MFD_CLOEXEC);
  if (fd < 0) return 0;
  std::size_t written = 0;
  while (written < size) {
    const ssize_t n = write(fd, text + written, size - written);
    if (n <= 0) break;
    written += static_cast<std::size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  absl::StatusOr<std::map<std::string, std::string>> shards =
      attngrad::wire::ReadSafetensorsIndex(path);
  if (shards.ok()) {
    for (const auto& [name, shard] : *shards) {
      if (shard.empty() || shard.front() == '/') __builtin_trap();  // stays in the index's folder
    }
  }
  close(fd);
  return 0;
}
