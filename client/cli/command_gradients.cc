// attngrad-cli fetch, zero and load-weights.
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cli_common.h"
#include "dtype.h"
#include "tensor_files.h"

namespace attngrad::cli {
namespace {

std::string StateLine(const v1::AccumulationState& s) {
  return absl::StrCat("window ", s.window_id(), ": ", s.batches(), " batches, ", s.tokens(),
                      " tokens, weights v", s.weights_version(), ", server ",
                      s.server_instance_id());
}

}  // namespace

int RunFetch() {
  const std::string command = "fetch";
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail(command, client.status());
  auto fetched = (*client)->Fetch(absl::GetFlag(FLAGS_zero_after), absl::GetFlag(FLAGS_window));
  if (!fetched.ok()) return Fail(command, fetched.status());
  std::cout << StateLine(fetched->state)
            << (absl::GetFlag(FLAGS_zero_after) ? " (zeroed: a new window started)" : "") << "\n";
  for (v1::WeightName name : WeightSet::Names()) {
    std::cout << "  grad_" << WeightShortName(name) << "  "
              << TensorSummary(fetched->gradients.Get(name)) << "\n";
  }
  const std::string output = absl::GetFlag(FLAGS_output);
  if (output.empty()) return 0;
  absl::Status status;
  if (absl::EndsWith(output, ".safetensors")) {
    std::vector<std::pair<std::string, const HostTensor*>> tensors;
    for (v1::WeightName name : WeightSet::Names()) {
      tensors.emplace_back(HuggingFaceName(absl::GetFlag(FLAGS_weights_layer), name),
                           &fetched->gradients.Get(name));
    }
    status = WriteSafetensors(output, tensors);
  } else {
    std::filesystem::create_directories(output);
    for (v1::WeightName name : WeightSet::Names()) {
      if (!status.ok()) break;
      status = WriteNpy(absl::StrCat(output, "/grad_", WeightShortName(name), ".npy"),
                        fetched->gradients.Get(name));
    }
  }
  if (!status.ok()) return Fail(command, status);
  std::cout << "wrote " << output << "\n";
  return 0;
}

int RunZero() {
  const std::string command = "zero";
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail(command, client.status());
  auto response = (*client)->Zero(absl::GetFlag(FLAGS_window));
  if (!response.ok()) return Fail(command, response.status());
  std::cout << "discarded " << StateLine(response->previous()) << "\n"
            << "now       " << StateLine(response->current()) << "\n";
  return 0;
}

int RunLoadWeights() {
  const std::string command = "load-weights";
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail(command, client.status());
  const v1::GetModelInfoResponse info = (*client)->cached_info();
  const LayerConfig config = ConfigFromInfo(info);
  const uint64_t expected = absl::GetFlag(FLAGS_expected_weights_version);
  const std::string path = absl::GetFlag(FLAGS_weights_file);
  absl::StatusOr<uint64_t> version;
  if (path.empty() || absl::GetFlag(FLAGS_wire_fp32)) {
    // Random weights of --weights_seed, or the file converted to fp32.
    auto weights = LocalWeights(config);
    if (!weights.ok()) return Fail(command, weights.status());
    version = (*client)->LoadWeights(*weights, expected);
  } else {
    // The file's own dtype on the wire when the server accepts it (half the bytes for bf16/fp16).
    auto file = SafetensorsFile::Open(path);
    if (!file.ok()) return Fail(command, file.status());
    std::vector<std::string> storage;
    std::vector<WeightUpload> uploads;
    storage.reserve(WeightSet::Names().size());
    for (v1::WeightName name : WeightSet::Names()) {
      const std::string tensor_name = HuggingFaceName(absl::GetFlag(FLAGS_weights_layer), name);
      auto entry = file->entries().find(tensor_name);
      if (entry == file->entries().end()) {
        return Fail(command, absl::NotFoundError(absl::StrCat(path, ": no tensor ", tensor_name)));
      }
      const v1::DType dtype = WireDTypeOf(entry->second.dtype);
      bool accepted = false;
      for (int d : info.supported_wire_dtypes()) accepted = accepted || d == dtype;
      if (dtype == v1::DTYPE_UNSPECIFIED || !accepted) {
        // Fall back to converting everything to fp32.
        auto weights = LocalWeights(config);
        if (!weights.ok()) return Fail(command, weights.status());
        uploads.clear();
        version = (*client)->LoadWeights(*weights, expected);
        break;
      }
      auto bytes = file->ReadBytes(tensor_name);
      if (!bytes.ok()) return Fail(command, bytes.status());
      storage.push_back(*std::move(bytes));
      uploads.push_back(WeightUpload{name, dtype, entry->second.shape, storage.back()});
    }
    if (!uploads.empty()) version = (*client)->LoadWeights(uploads, expected);
  }
  if (!version.ok()) return Fail(command, version.status());
  std::cout << "uploaded " << LocalWeightsSource() << ": weights version " << *version << "\n";
  return 0;
}

}  // namespace attngrad::cli
