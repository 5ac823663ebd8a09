// NCCL, loaded at run time. The server does not link libnccl (218 MB, absent from slim images and
// some GPU machines): NcclLibrary dlopen()s "libnccl.so.2" and resolves only the entry points the
// cross-device gradient sum uses; NcclCommunicators holds one communicator per GPU worker. The
// types come from nccl.h at compile time, so all of this exists only when the build found that
// header (ATTNGRAD_HAVE_NCCL_HEADER, set by server/CMakeLists.txt); without it Load() says so and
// the server sums the devices' accumulators on the host.
#ifndef ATTNGRAD_SERVER_NCCL_LIBRARY_H_
#define ATTNGRAD_SERVER_NCCL_LIBRARY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#ifdef ATTNGRAD_HAVE_NCCL_HEADER
#include <nccl.h>
#endif

namespace attngrad::server {

inline constexpr char kNcclLibraryName[] = "libnccl.so.2";

// "2.28.9" from a version code as ncclGetVersion reports it (X*1000+Y*100+Z before 2.9,
// X*10000+Y*100+Z from 2.9 on).
std::string NcclVersionString(int version_code);

// An open libnccl (dlclose on destruction) and its resolved entry points.
class NcclLibrary {
 public:
  // dlopen(`name`, RTLD_NOW | RTLD_LOCAL), resolves the symbols and asks ncclGetVersion. Errors
  // (all UNAVAILABLE, naming `name`): the library cannot be opened (with dlerror's text), a symbol
  // is missing, ncclGetVersion fails, or this build has no nccl.h.
  static absl::StatusOr<std::unique_ptr<NcclLibrary>> Load(
      const std::string& name = kNcclLibraryName);
  ~NcclLibrary();
  NcclLibrary(const NcclLibrary&) = delete;
  NcclLibrary& operator=(const NcclLibrary&) = delete;

  const std::string& name() const { return name_; }
  int version_code() const { return version_code_; }
  std::string version() const { return NcclVersionString(version_code_); }

#ifdef ATTNGRAD_HAVE_NCCL_HEADER
  // OK for ncclSuccess, else INTERNAL "what: <ncclGetErrorString> (<ncclGetLastError>)".
  absl::Status Check(ncclResult_t result, const std::string& what) const;

  // The entry points (always set after a successful Load, except get_last_error: NCCL >= 2.13).
  decltype(&::ncclGetVersion) get_version = nullptr;
  decltype(&::ncclGetErrorString) get_error_string = nullptr;
  const char* (*get_last_error)(ncclComm_t) = nullptr;  // spelled out: older nccl.h lack it
  decltype(&::ncclCommInitAll) comm_init_all = nullptr;
  decltype(&::ncclCommDestroy) comm_destroy = nullptr;
  decltype(&::ncclReduce) reduce = nullptr;
  decltype(&::ncclCommAbort) comm_abort = nullptr;                    // nccl_abort.h
  decltype(&::ncclCommGetAsyncError) comm_get_async_error = nullptr;  // nccl_abort.h
#endif

 private:
  NcclLibrary(void* handle, std::string name) : handle_(handle), name_(std::move(name)) {}

  void* handle_ = nullptr;
  std::string name_;
  int version_code_ = 0;
};

#ifdef ATTNGRAD_HAVE_NCCL_HEADER
// One NCCL communicator per device of `devices` (rank i on devices[i]) made by one
// ncclCommInitAll call, destroyed (ncclCommDestroy, one after the other from the destroying
// thread) when this goes away; nothing may use them then. Each communicator must be used by one
// thread at a time. A rank's communicator can be aborted (nccl_abort.h); it is then gone (null).
class NcclCommunicators {
 public:
  static absl::StatusOr<std::unique_ptr<NcclCommunicators>> Create(
      std::shared_ptr<const NcclLibrary> library, const std::vector<int>& devices);
  ~NcclCommunicators();
  NcclCommunicators(const NcclCommunicators&) = delete;
  NcclCommunicators& operator=(const NcclCommunicators&) = delete;

  const NcclLibrary& library() const { return *library_; }
  int size() const { return static_cast<int>(comms_.size()); }
  ncclComm_t comm(int rank) const { return comms_[static_cast<std::size_t>(rank)]; }
  // ncclCommAbort of rank `rank`'s communicator (from the thread that uses it): a collective it
  // is in stops; comm(rank) is null afterwards. Nothing when it is already gone.
  void Abort(int rank);

 private:
  NcclCommunicators(std::shared_ptr<const NcclLibrary> library, std::vector<ncclComm_t> comms)
      : library_(std::move(library)), comms_(std::move(comms)) {}

  std::shared_ptr<const NcclLibrary> library_;
  std::vector<ncclComm_t> comms_;
};
#endif

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_NCCL_LIBRARY_H_
