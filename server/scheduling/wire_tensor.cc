// WireTensor: copies and decodes out of the received pieces.
#include "scheduling/wire_tensor.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

#include "attngrad/common/status_macros.h"
#include "attngrad/v1/tensor.pb.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/tensor.h"

namespace attngrad::server {

WireTensor::WireTensor(int dtype, std::vector<absl::string_view> pieces,
                       std::shared_ptr<const void> owner)
    : dtype_(dtype), pieces_(std::move(pieces)), owner_(std::move(owner)) {
  starts_.reserve(pieces_.size());
  for (absl::string_view piece : pieces_) {
    starts_.push_back(size_bytes_);
    size_bytes_ += piece.size();
  }
}

WireTensor WireTensor::FromFloats(std::vector<float> values) {
  auto owned = std::make_shared<std::vector<float>>(std::move(values));
  const absl::string_view bytes(reinterpret_cast<const char*>(owned->data()),
                                owned->size() * sizeof(float));
  return WireTensor(v1::DTYPE_FLOAT32, {bytes}, std::move(owned));
}

WireTensor WireTensor::FromBytes(int dtype, std::string bytes) {
  auto owned = std::make_shared<std::string>(std::move(bytes));
  const absl::string_view view(*owned);
  return WireTensor(dtype, {view}, std::move(owned));
}

absl::Status WireTensor::RefuseDeviceMemory(absl::string_view field) const {
  if (cuda_device_ < 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(field, ": the bytes are GPU memory of cuda:", cuda_device_,
                   " (a CUDA IPC region), which only that GPU's worker reads"));
}

WireTensor WireTensor::OnDevice(int dtype, const char* data, std::size_t size_bytes,
                                int cuda_device, std::shared_ptr<const void> owner) {
  WireTensor tensor;
  tensor.dtype_ = dtype;
  tensor.size_bytes_ = size_bytes;
  tensor.owner_ = std::move(owner);
  tensor.device_data_ = data;
  tensor.cuda_device_ = cuda_device;
  return tensor;
}

void WireTensor::DropBytes() {
  pieces_.clear();
  starts_.clear();
  size_bytes_ = 0;
  owner_.reset();
}

std::size_t WireTensor::element_size() const { return wire::DTypeSize(dtype_); }

std::size_t WireTensor::elements() const {
  const std::size_t size = element_size();
  return size == 0 ? 0 : size_bytes_ / size;
}

void WireTensor::CopyBytes(std::size_t offset, std::size_t size, void* destination) const {
  if (cuda_device_ >= 0) return;  // GPU memory: not readable here
  char* out = static_cast<char*>(destination);
  // The piece holding `offset`: the last one starting at or before it.
  std::size_t index = static_cast<std::size_t>(
      std::upper_bound(starts_.begin(), starts_.end(), offset) - starts_.begin());
  index = index == 0 ? 0 : index - 1;
  while (size > 0 && index < pieces_.size()) {
    const absl::string_view piece = pieces_[index];
    const std::size_t within = offset - starts_[index];
    const std::size_t count = std::min(size, piece.size() - within);
    if (count > 0) std::memcpy(out, piece.data() + within, count);
    out += count;
    offset += count;
    size -= count;
    ++index;
  }
}

absl::Status WireTensor::CopyFinite(std::size_t first, std::size_t count, void* destination,
                                    absl::string_view field) const {
  ATTNGRAD_RETURN_IF_ERROR(RefuseDeviceMemory(field));
  const std::size_t size = element_size();
  char* const start = static_cast<char*>(destination);
  if (size == 0 || count == 0) return absl::OkStatus();
  // Piece by piece, each piece's whole elements copied and checked in one pass
  // (wire::CopyAndCheckFinite); an element split between two pieces is checked once both halves
  // are in the destination.
  bool finite = true;
  std::size_t offset = first * size, remaining = count * size;
  char* out = start;
  std::size_t index = static_cast<std::size_t>(
      std::upper_bound(starts_.begin(), starts_.end(), offset) - starts_.begin());
  index = index == 0 ? 0 : index - 1;
  for (; remaining > 0 && index < pieces_.size(); ++index) {
    const absl::string_view piece = pieces_[index];
    const std::size_t within = offset - starts_[index];
    const std::size_t n = std::min(remaining, piece.size() - within);
    const char* source = piece.data() + within;
    // The bytes that complete an element begun in the previous piece.
    const std::size_t lead = std::min(n, (size - offset % size) % size);
    if (lead > 0) {
      std::memcpy(out, source, lead);
      if ((offset + lead) % size == 0) {
        finite =
            finite &&
            wire::CheckFiniteRaw(absl::string_view(out + lead - size, size), dtype_, field).ok();
      }
    }
    const std::size_t whole = (n - lead) / size * size;
    finite =
        wire::CopyAndCheckFinite(absl::string_view(source + lead, whole), dtype_, out + lead) &&
        finite;
    // The start of an element that the next piece completes.
    if (n > lead + whole) std::memcpy(out + lead + whole, source + lead + whole, n - lead - whole);
    out += n;
    offset += n;
    remaining -= n;
  }
  if (finite) return absl::OkStatus();
  // Names the first offender exactly as wire::CheckFinite does.
  return wire::CheckFiniteRaw(absl::string_view(start, count * size), dtype_, field, first);
}

absl::Status WireTensor::DecodeFinite(std::size_t first, absl::Span<float> out,
                                      absl::string_view field) const {
  ATTNGRAD_RETURN_IF_ERROR(RefuseDeviceMemory(field));
  const std::size_t size = element_size();
  if (dtype_ == v1::DTYPE_FLOAT32) {
    CopyBytes(first * size, out.size() * size, out.data());
    return wire::CheckFinite(out, field, first);
  }
  // 16-bit elements: through a small buffer that stays in the cache.
  constexpr std::size_t kBlock = 32 << 10;
  std::string raw(kBlock * size, '\0');
  for (std::size_t done = 0; done < out.size(); done += kBlock) {
    const std::size_t n = std::min(kBlock, out.size() - done);
    CopyBytes((first + done) * size, n * size, raw.data());
    const absl::Span<float> block = out.subspan(done, n);
    ATTNGRAD_RETURN_IF_ERROR(
        wire::DecodeToFloat(absl::string_view(raw.data(), n * size), dtype_, field, block));
    ATTNGRAD_RETURN_IF_ERROR(wire::CheckFinite(block, field, first + done));
  }
  return absl::OkStatus();
}

}  // namespace attngrad::server
