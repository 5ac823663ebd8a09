// Probe for same-host zero-copy: does CUDA inter-process memory sharing work between two processes
// on this machine? Two mechanisms are tried, each in a fresh child process pair (fork before any
// CUDA call, so that neither inherits a CUDA context):
//   legacy: cudaIpcGetMemHandle in the exporter, cudaIpcOpenMemHandle in the importer;
//   vmm:    cuMemCreate with a POSIX file-descriptor handle, the descriptor passed over a Unix
//           socket (SCM_RIGHTS), cuMemImportFromShareableHandle + cuMemMap in the importer.
// The exporter fills a buffer with one byte value; the importer checks it, writes another value and
// reports how long opening the handle took; the exporter checks the importer's write.
// Output: one line per mechanism, "legacy: ok ..." or "legacy: FAILED <step>: <CUDA error>".
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr size_t kBytes = 64u << 20;
constexpr unsigned char kExporterValue = 0x5A;
constexpr unsigned char kImporterValue = 0x3C;

// What a failed step says: the step's name and CUDA's own error string.
std::string RuntimeFailure(const char* step, cudaError_t error) {
  return std::string("FAILED ") + step + ": " + cudaGetErrorName(error) + " (" +
         cudaGetErrorString(error) + ")";
}
std::string DriverFailure(const char* step, CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  cuGetErrorName(result, &name);
  cuGetErrorString(result, &text);
  return std::string("FAILED ") + step + ": " + (name ? name : "?") + " (" + (text ? text : "?") +
         ")";
}

bool AllBytesEqual(const std::vector<unsigned char>& bytes, unsigned char value) {
  for (unsigned char byte : bytes) {
    if (byte != value) return false;
  }
  return true;
}

void SendBytes(int socket, const void* data, size_t size) {
  if (write(socket, data, size) != static_cast<ssize_t>(size)) perror("write");
}
bool ReceiveBytes(int socket, void* data, size_t size) {
  return read(socket, data, size) == static_cast<ssize_t>(size);
}
void SendText(int socket, const std::string& text) {
  const unsigned size = static_cast<unsigned>(text.size());
  SendBytes(socket, &size, sizeof size);
  SendBytes(socket, text.data(), size);
}
std::string ReceiveText(int socket) {
  unsigned size = 0;
  if (!ReceiveBytes(socket, &size, sizeof size)) return "FAILED peer: no answer";
  std::string text(size, '\0');
  if (!ReceiveBytes(socket, text.data(), size)) return "FAILED peer: short answer";
  return text;
}

void SendDescriptor(int socket, int descriptor) {
  char payload = 'd';
  iovec vector{&payload, 1};
  char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr message{};
  message.msg_iov = &vector;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof control;
  cmsghdr* header = CMSG_FIRSTHDR(&message);
  header->cmsg_level = SOL_SOCKET;
  header->cmsg_type = SCM_RIGHTS;
  header->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(header), &descriptor, sizeof(int));
  if (sendmsg(socket, &message, 0) < 0) perror("sendmsg");
}
int ReceiveDescriptor(int socket) {
  char payload = 0;
  iovec vector{&payload, 1};
  char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr message{};
  message.msg_iov = &vector;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof control;
  if (recvmsg(socket, &message, 0) <= 0) return -1;
  cmsghdr* header = CMSG_FIRSTHDR(&message);
  if (header == nullptr || header->cmsg_type != SCM_RIGHTS) return -1;
  int descriptor = -1;
  std::memcpy(&descriptor, CMSG_DATA(header), sizeof(int));
  return descriptor;
}

double MillisecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// Importer side of the legacy mechanism: opens the handle, checks, writes, reports.
std::string LegacyImporter(int socket) {
  cudaIpcMemHandle_t handle;
  if (!ReceiveBytes(socket, &handle, sizeof handle)) return "FAILED receive handle";
  const auto start = std::chrono::steady_clock::now();
  void* pointer = nullptr;
  cudaError_t error = cudaIpcOpenMemHandle(&pointer, handle, cudaIpcMemLazyEnablePeerAccess);
  if (error != cudaSuccess) return RuntimeFailure("cudaIpcOpenMemHandle", error);
  const double open_ms = MillisecondsSince(start);
  std::vector<unsigned char> host(kBytes);
  error = cudaMemcpy(host.data(), pointer, kBytes, cudaMemcpyDeviceToHost);
  if (error != cudaSuccess) return RuntimeFailure("cudaMemcpy from the shared buffer", error);
  if (!AllBytesEqual(host, kExporterValue)) return "FAILED the importer read other bytes";
  error = cudaMemset(pointer, kImporterValue, kBytes);
  if (error == cudaSuccess) error = cudaDeviceSynchronize();
  if (error != cudaSuccess) return RuntimeFailure("cudaMemset into the shared buffer", error);
  cudaIpcCloseMemHandle(pointer);
  return "importer open " + std::to_string(open_ms) + " ms";
}

std::string LegacyExporter(int socket) {
  void* pointer = nullptr;
  cudaError_t error = cudaMalloc(&pointer, kBytes);
  if (error != cudaSuccess) return RuntimeFailure("cudaMalloc", error);
  error = cudaMemset(pointer, kExporterValue, kBytes);
  if (error == cudaSuccess) error = cudaDeviceSynchronize();
  if (error != cudaSuccess) return RuntimeFailure("cudaMemset", error);
  cudaIpcMemHandle_t handle;
  error = cudaIpcGetMemHandle(&handle, pointer);
  if (error != cudaSuccess) return RuntimeFailure("cudaIpcGetMemHandle", error);
  SendBytes(socket, &handle, sizeof handle);
  const std::string importer = ReceiveText(socket);
  if (importer.rfind("FAILED", 0) == 0) return importer;
  std::vector<unsigned char> host(kBytes);
  error = cudaMemcpy(host.data(), pointer, kBytes, cudaMemcpyDeviceToHost);
  if (error != cudaSuccess) return RuntimeFailure("cudaMemcpy back", error);
  if (!AllBytesEqual(host, kImporterValue)) return "FAILED the importer's write is not visible";
  cudaFree(pointer);
  return "ok (" + importer + ")";
}

CUmemAllocationProp FileDescriptorAllocation() {
  CUmemAllocationProp properties{};
  properties.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  properties.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  properties.location.id = 0;
  properties.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return properties;
}

// Maps an allocation handle read-write on device 0; returns the address or a failure.
std::string MapOnDevice0(CUmemGenericAllocationHandle allocation, size_t size,
                         CUdeviceptr* address) {
  CUresult result = cuMemAddressReserve(address, size, 0, 0, 0);
  if (result != CUDA_SUCCESS) return DriverFailure("cuMemAddressReserve", result);
  result = cuMemMap(*address, size, 0, allocation, 0);
  if (result != CUDA_SUCCESS) return DriverFailure("cuMemMap", result);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = 0;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  result = cuMemSetAccess(*address, size, &access, 1);
  if (result != CUDA_SUCCESS) return DriverFailure("cuMemSetAccess", result);
  return "";
}

size_t GranularSize() {
  CUmemAllocationProp properties = FileDescriptorAllocation();
  size_t granularity = 0;
  cuMemGetAllocationGranularity(&granularity, &properties, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (granularity == 0) granularity = 2u << 20;
  return (kBytes + granularity - 1) / granularity * granularity;
}

std::string VmmImporter(int socket) {
  cudaFree(nullptr);  // creates the primary context the driver calls below use
  const int descriptor = ReceiveDescriptor(socket);
  if (descriptor < 0) return "FAILED receive descriptor over the Unix socket";
  const auto start = std::chrono::steady_clock::now();
  CUmemGenericAllocationHandle allocation;
  CUresult result = cuMemImportFromShareableHandle(
      &allocation, reinterpret_cast<void*>(static_cast<uintptr_t>(descriptor)),
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (result != CUDA_SUCCESS) return DriverFailure("cuMemImportFromShareableHandle", result);
  const size_t size = GranularSize();
  CUdeviceptr address = 0;
  const std::string failure = MapOnDevice0(allocation, size, &address);
  if (!failure.empty()) return failure;
  const double open_ms = MillisecondsSince(start);
  std::vector<unsigned char> host(kBytes);
  cudaError_t error =
      cudaMemcpy(host.data(), reinterpret_cast<void*>(address), kBytes, cudaMemcpyDeviceToHost);
  if (error != cudaSuccess) return RuntimeFailure("cudaMemcpy from the shared buffer", error);
  if (!AllBytesEqual(host, kExporterValue)) return "FAILED the importer read other bytes";
  error = cudaMemset(reinterpret_cast<void*>(address), kImporterValue, kBytes);
  if (error == cudaSuccess) error = cudaDeviceSynchronize();
  if (error != cudaSuccess) return RuntimeFailure("cudaMemset into the shared buffer", error);
  cuMemUnmap(address, size);
  cuMemAddressFree(address, size);
  cuMemRelease(allocation);
  close(descriptor);
  return "importer import+map " + std::to_string(open_ms) + " ms";
}

std::string VmmExporter(int socket) {
  cudaFree(nullptr);
  const size_t size = GranularSize();
  CUmemAllocationProp properties = FileDescriptorAllocation();
  CUmemGenericAllocationHandle allocation;
  CUresult result = cuMemCreate(&allocation, size, &properties, 0);
  if (result != CUDA_SUCCESS) return DriverFailure("cuMemCreate (POSIX fd handle type)", result);
  CUdeviceptr address = 0;
  const std::string failure = MapOnDevice0(allocation, size, &address);
  if (!failure.empty()) return failure;
  cudaError_t error = cudaMemset(reinterpret_cast<void*>(address), kExporterValue, kBytes);
  if (error == cudaSuccess) error = cudaDeviceSynchronize();
  if (error != cudaSuccess) return RuntimeFailure("cudaMemset", error);
  int descriptor = -1;
  result = cuMemExportToShareableHandle(&descriptor, allocation,
                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (result != CUDA_SUCCESS) return DriverFailure("cuMemExportToShareableHandle", result);
  SendDescriptor(socket, descriptor);
  const std::string importer = ReceiveText(socket);
  if (importer.rfind("FAILED", 0) == 0) return importer;
  std::vector<unsigned char> host(kBytes);
  error = cudaMemcpy(host.data(), reinterpret_cast<void*>(address), kBytes, cudaMemcpyDeviceToHost);
  if (error != cudaSuccess) return RuntimeFailure("cudaMemcpy back", error);
  if (!AllBytesEqual(host, kImporterValue)) return "FAILED the importer's write is not visible";
  close(descriptor);
  return "ok (" + importer + ")";
}

// Runs one mechanism in a fresh exporter/importer process pair and prints its line.
int RunPair(const char* name, std::string (*exporter)(int), std::string (*importer)(int)) {
  int sockets[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sockets) != 0) {
    perror("socketpair");
    return 1;
  }
  const pid_t importer_process = fork();
  if (importer_process == 0) {
    close(sockets[0]);
    SendText(sockets[1], importer(sockets[1]));
    _exit(0);
  }
  const pid_t exporter_process = fork();
  if (exporter_process == 0) {
    close(sockets[1]);
    const std::string line = exporter(sockets[0]);
    std::printf("%s: %s\n", name, line.c_str());
    std::fflush(stdout);
    _exit(line.rfind("ok", 0) == 0 ? 0 : 1);
  }
  close(sockets[0]);
  close(sockets[1]);
  int exporter_status = 0;
  waitpid(exporter_process, &exporter_status, 0);
  waitpid(importer_process, nullptr, 0);
  return WIFEXITED(exporter_status) ? WEXITSTATUS(exporter_status) : 1;
}

}  // namespace

int main() {
  const int legacy = RunPair("legacy cudaIpc", LegacyExporter, LegacyImporter);
  const int vmm = RunPair("vmm posix-fd", VmmExporter, VmmImporter);
  return legacy == 0 || vmm == 0 ? 0 : 1;
}
