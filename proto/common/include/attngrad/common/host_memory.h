// Big host buffers that are written once, soon after they are allocated (a decoded answer, a
// request's or an answer's bytes): asked to be backed by transparent huge pages, so that writing
// 50 MB faults 25 times instead of 12,800 (measured on the build machine, THP in `madvise` mode:
// allocating, zeroing and filling a 50 MB std::vector<float> 51 ms -> 21 ms). Advice only: where
// the kernel has no THP, or the range holds no whole 2 MiB page, nothing changes.
#ifndef ATTNGRAD_COMMON_HOST_MEMORY_H_
#define ATTNGRAD_COMMON_HOST_MEMORY_H_

#include <cstddef>
#include <vector>

namespace attngrad::common {

// Advises huge pages for the whole 2 MiB pages inside [data, data + bytes).
void AdviseHugePages(void* data, std::size_t bytes);

// `values` resized to `count` elements, its memory advised (AdviseHugePages) before it is first
// written when it grows.
void ResizeForOverwrite(std::vector<float>* values, std::size_t count);

}  // namespace attngrad::common

#endif  // ATTNGRAD_COMMON_HOST_MEMORY_H_
