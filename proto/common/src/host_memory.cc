// Huge-page advice for big host buffers (Linux madvise; a no-op elsewhere).
#include "attngrad/common/host_memory.h"

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace attngrad::common {

void AdviseHugePages(void* data, std::size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t kHugePage = std::uintptr_t{2} << 20;
  const std::uintptr_t begin =
      (reinterpret_cast<std::uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const std::uintptr_t end = (reinterpret_cast<std::uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

void ResizeForOverwrite(std::vector<float>* values, std::size_t count) {
  if (count > values->capacity()) {
    values->reserve(count);
    AdviseHugePages(values->data(), count * sizeof(float));
  }
  values->resize(count);
}

}  // namespace attngrad::common
