#include "devices/stream_memory_operations.h"

#include "absl/strings/str_cat.h"

namespace attngrad::server {
namespace {

// The driver API version whose signature ValueOperation matches (cuStreamWriteValue32_v2).
constexpr unsigned int kDriverApiVersion = 12000;

template <typename Function>
Function LookUp(const char* symbol) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &function, kDriverApiVersion, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();  // not sticky: only this lookup failed
    return nullptr;
  }
  return reinterpret_cast<Function>(function);
}

absl::Status DriverStatus(int result, const char* what) {
  if (result == 0) return absl::OkStatus();  // CUDA_SUCCESS
  return absl::InternalError(absl::StrCat(what, " failed with CUresult ", result));
}

}  // namespace

StreamMemoryOperations::StreamMemoryOperations()
    : write_value_(LookUp<ValueOperation>("cuStreamWriteValue32")) {}

absl::Status StreamMemoryOperations::Write(cudaStream_t stream, void* address,
                                           std::uint32_t value) const {
  if (!usable()) return absl::FailedPreconditionError("no cuStreamWriteValue32 in this driver");
  constexpr unsigned int kDefault = 0x0;  // CU_STREAM_WRITE_VALUE_DEFAULT: fenced
  return DriverStatus(
      write_value_(stream, reinterpret_cast<unsigned long long>(address), value, kDefault),
      "cuStreamWriteValue32");
}

}  // namespace attngrad::server
