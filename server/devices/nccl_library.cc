// NcclLibrary (dlopen of libnccl.so.2) and NcclCommunicators; see nccl_library.h.
#include "devices/nccl_library.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"

namespace attngrad::server {

std::string NcclVersionString(int version_code) {
  if (version_code <= 0) return "unknown";
  int major, minor, patch;
  if (version_code >= 10000) {  // 2.9 and later: X*10000 + Y*100 + Z
    major = version_code / 10000;
    minor = version_code % 10000 / 100;
  } else {  // before 2.9: X*1000 + Y*100 + Z
    major = version_code / 1000;
    minor = version_code % 1000 / 100;
  }
  patch = version_code % 100;
  return absl::StrCat(major, ".", minor, ".", patch);
}

NcclLibrary::~NcclLibrary() {
  if (handle_ != nullptr) dlclose(handle_);
}

#ifdef ATTNGRAD_HAVE_NCCL_HEADER

namespace {

template <typename Function>
absl::Status Resolve(void* handle, const std::string& library, const char* symbol,
                     Function* function) {
  dlerror();
  void* address = dlsym(handle, symbol);
  if (address == nullptr) {
    const char* error = dlerror();
    return absl::UnavailableError(
        absl::StrCat(library, ": symbol ", symbol, " not found",
                     error != nullptr ? absl::StrCat(" (", error, ")") : ""));
  }
  *function = reinterpret_cast<Function>(address);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclLibrary>> NcclLibrary::Load(const std::string& name) {
  dlerror();
  void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    return absl::UnavailableError(
        absl::StrCat("cannot load NCCL: dlopen(\"", name,
                     "\") failed: ", error != nullptr ? error : "unknown error",
                     " (install NCCL 2 or put its lib directory on LD_LIBRARY_PATH)"));
  }
  std::unique_ptr<NcclLibrary> library(new NcclLibrary(handle, name));
  for (absl::Status status : {
           Resolve(handle, name, "ncclGetVersion", &library->get_version),
           Resolve(handle, name, "ncclGetErrorString", &library->get_error_string),
           Resolve(handle, name, "ncclCommInitAll", &library->comm_init_all),
           Resolve(handle, name, "ncclCommDestroy", &library->comm_destroy),
           Resolve(handle, name, "ncclReduce", &library->reduce),
           Resolve(handle, name, "ncclCommAbort", &library->comm_abort),
           Resolve(handle, name, "ncclCommGetAsyncError", &library->comm_get_async_error),
       }) {
    if (!status.ok()) return status;
  }
  // Optional (NCCL >= 2.13): the detailed message of the last error.
  if (!Resolve(handle, name, "ncclGetLastError", &library->get_last_error).ok()) {
    library->get_last_error = nullptr;
  }
  int version = 0;
  const ncclResult_t result = library->get_version(&version);
  if (result != ncclSuccess) {
    return absl::UnavailableError(
        absl::StrCat(name, ": ncclGetVersion failed: ", library->get_error_string(result)));
  }
  if (version / 1000 < 2) {  // 1.x has a different API; 2.x codes are >= 2000
    return absl::UnavailableError(
        absl::StrCat(name, ": NCCL version code ", version, " is not NCCL 2"));
  }
  library->version_code_ = version;
  return library;
}

absl::Status NcclLibrary::Check(ncclResult_t result, const std::string& what) const {
  if (result == ncclSuccess) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": NCCL error ", static_cast<int>(result), " (",
                                     get_error_string(result), ")");
  if (get_last_error != nullptr) {
    const char* last = get_last_error(nullptr);
    if (last != nullptr && *last != '\0') absl::StrAppend(&message, ": ", last);
  }
  return absl::InternalError(message);
}

absl::StatusOr<std::unique_ptr<NcclCommunicators>> NcclCommunicators::Create(
    std::shared_ptr<const NcclLibrary> library, const std::vector<int>& devices) {
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  absl::Status status = library->Check(
      library->comm_init_all(comms.data(), static_cast<int>(devices.size()), devices.data()),
      "ncclCommInitAll");
  if (!status.ok()) return status;
  return std::unique_ptr<NcclCommunicators>(
      new NcclCommunicators(std::move(library), std::move(comms)));
}

void NcclCommunicators::Abort(int rank) {
  ncclComm_t& comm = comms_[static_cast<std::size_t>(rank)];
  if (comm == nullptr) return;
  library_->comm_abort(comm);
  comm = nullptr;
}

NcclCommunicators::~NcclCommunicators() {
  // As in NCCL's single-thread, several-devices example: destroy them one after the other.
  for (ncclComm_t comm : comms_) {
    if (comm != nullptr) library_->comm_destroy(comm);
  }
}

#else  // !ATTNGRAD_HAVE_NCCL_HEADER

absl::StatusOr<std::unique_ptr<NcclLibrary>> NcclLibrary::Load(const std::string& name) {
  return absl::UnavailableError(
      absl::StrCat("cannot load NCCL (", name,
                   "): this server was built without nccl.h (no CUDA backend, or "
                   "the CUDA include directories have no nccl.h)"));
}

#endif  // ATTNGRAD_HAVE_NCCL_HEADER

}  // namespace attngrad::server
