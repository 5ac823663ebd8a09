// A tensor as it arrived on the wire: raw little-endian elements of a wire dtype (fp32, fp16 or
// bf16), in the pieces of the received message (gRPC's receive slices), kept alive by `owner`.
// The copy-free batch path hands these to the device workers, which copy them once, straight into
// the memory the computation reads: a GPU slot's pinned staging buffer (widened to fp32 on the
// GPU), or the CPU backend's fp32 inputs (widened on the worker's thread).
#ifndef ATTNGRAD_SERVER_WIRE_TENSOR_H_
#define ATTNGRAD_SERVER_WIRE_TENSOR_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace attngrad::server {

class WireTensor {
 public:
  WireTensor() = default;
  // `pieces` in order; `owner` keeps their memory alive.
  WireTensor(int dtype, std::vector<absl::string_view> pieces, std::shared_ptr<const void> owner);
  // fp32 values it owns (tests, and requests that were parsed as whole messages).
  static WireTensor FromFloats(std::vector<float> values);
  // Raw bytes it owns.
  static WireTensor FromBytes(int dtype, std::string bytes);
  // `size_bytes` bytes of GPU memory at `data` on CUDA device `cuda_device` (a client's memory
  // opened over CUDA IPC: rpc/regions.h), kept open by `owner`. Only that device's GPU worker
  // reads it (from the device); the host copies below refuse it (FAILED_PRECONDITION, CopyBytes
  // copies nothing).
  static WireTensor OnDevice(int dtype, const char* data, std::size_t size_bytes, int cuda_device,
                             std::shared_ptr<const void> owner);

  int dtype() const { return dtype_; }
  void set_dtype(int dtype) { dtype_ = dtype; }
  std::size_t size_bytes() const { return size_bytes_; }
  // size_bytes / the dtype's size (0 for an unsupported dtype).
  std::size_t elements() const;
  std::size_t element_size() const;
  // The CUDA device of a tensor made by OnDevice, else -1 (host memory).
  int cuda_device() const { return cuda_device_; }
  // OnDevice's `data` (null for host tensors).
  const char* device_data() const { return device_data_; }

  // Lets the bytes go (their owner too), keeping the dtype: for a host tensor whose bytes have
  // been copied to where the computation reads them.
  void DropBytes();

  // Copies bytes [offset, offset + size) (within size_bytes) to `destination`.
  void CopyBytes(std::size_t offset, std::size_t size, void* destination) const;
  // Copies raw elements [first, first + count) to `destination` (count * element_size bytes) and
  // checks on their bits that each is finite (INVALID_ARGUMENT naming `field` and the element,
  // as wire::CheckFinite): one pass per piece with streaming stores (wire::CopyAndCheckFinite),
  // for a destination the CPU does not read again (page-locked staging).
  absl::Status CopyFinite(std::size_t first, std::size_t count, void* destination,
                          absl::string_view field) const;
  // Elements [first, first + out.size()) widened to fp32 (exactly; fp32 copied as they are), each
  // checked to be finite.
  absl::Status DecodeFinite(std::size_t first, absl::Span<float> out,
                            absl::string_view field) const;

 private:
  // FAILED_PRECONDITION naming `field` for a tensor in GPU memory.
  absl::Status RefuseDeviceMemory(absl::string_view field) const;

  int dtype_ = 0;
  std::vector<absl::string_view> pieces_;
  std::vector<std::size_t> starts_;  // byte offset of each piece
  std::size_t size_bytes_ = 0;
  std::shared_ptr<const void> owner_;
  const char* device_data_ = nullptr;
  int cuda_device_ = -1;
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_WIRE_TENSOR_H_
