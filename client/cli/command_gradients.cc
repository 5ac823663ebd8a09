// attngrad-cli fetch, zero and load-weights.
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_cat.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/safetensors.h"
#include "attngrad/wire/tensor.h"
#include "cli_common.h"
#include "tensor_files.h"

namespace attngrad::cli {
namespace {

std::string StateLine(const v1::AccumulationState& s) {
  return absl::StrCat("window ", s.window_id(), ": ", s.batches(), " batches, ", s.tokens(),
                      " tokens, weights v", s.weights_version(), ", server ",
                      s.server_instance_id());
}

}  // namespace

namespace {

// --layer: unset (-1) = the server's first layer.
std::optional<int> OptionalLayer() {
  const int layer = absl::GetFlag(FLAGS_layer);
  return layer >= 0 ? std::optional<int>(layer) : std::nullopt;
}

}  // namespace

int RunFetch() {
  const std::string command = "fetch";
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail(command, client.status());
  const std::optional<int> layer = OptionalLayer();
  if (!absl::GetFlag(FLAGS_layers).empty()) {
    // Several layers: one summary per layer (--output is for a single layer).
    std::vector<int> layers;
    for (absl::string_view text : absl::StrSplit(absl::GetFlag(FLAGS_layers), ',')) {
      int value = 0;
      if (!absl::SimpleAtoi(text, &value)) {
        return Fail(command, absl::InvalidArgumentError(
                                 absl::StrCat("--layers: \"", text, "\" is not a layer index")));
      }
      layers.push_back(value);
    }
    auto all = (*client)->FetchLayers(layers, absl::GetFlag(FLAGS_zero_after));
    if (!all.ok()) return Fail(command, all.status());
    for (const FetchedGradients& fetched : *all) {
      std::cout << "layer " << fetched.state.layer() << ": " << StateLine(fetched.state) << "\n";
      for (Weight weight : kAllWeights) {
        std::cout << "  grad_" << WeightModuleName(weight) << "  "
                  << TensorSummary(fetched.gradients[weight]) << "\n";
      }
    }
    return 0;
  }
  auto fetched =
      (*client)->Fetch(absl::GetFlag(FLAGS_zero_after), absl::GetFlag(FLAGS_window), layer);
  if (!fetched.ok()) return Fail(command, fetched.status());
  std::cout << StateLine(fetched->state)
            << (absl::GetFlag(FLAGS_zero_after) ? " (zeroed: a new window started)" : "") << "\n";
  for (Weight weight : kAllWeights) {
    std::cout << "  grad_" << WeightModuleName(weight) << "  "
              << TensorSummary(fetched->gradients[weight]) << "\n";
  }
  const std::string output = absl::GetFlag(FLAGS_output);
  if (output.empty()) return 0;
  absl::Status status;
  if (absl::EndsWith(output, ".safetensors")) {
    std::vector<wire::SafetensorsTensor> tensors;
    for (Weight weight : kAllWeights) {
      const HostTensor& gradient = fetched->gradients[weight];
      tensors.push_back(
          {wire::HuggingFaceTensorName(
               layer.has_value() ? *layer : absl::GetFlag(FLAGS_weights_layer), weight),
           gradient.shape, gradient.data});
    }
    status = wire::WriteSafetensors(output, tensors);
  } else {
    std::filesystem::create_directories(output);
    for (Weight weight : kAllWeights) {
      if (!status.ok()) break;
      status = WriteNpy(absl::StrCat(output, "/grad_", WeightModuleName(weight), ".npy"),
                        fetched->gradients[weight]);
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
  auto response = (*client)->Zero(absl::GetFlag(FLAGS_window), OptionalLayer());
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
  const LayerConfig config = wire::LayerConfigFromWire(info.config());
  const uint64_t expected = absl::GetFlag(FLAGS_expected_weights_version);
  const std::string path = absl::GetFlag(FLAGS_weights_file);
  absl::StatusOr<uint64_t> version;
  if (path.empty() || absl::GetFlag(FLAGS_wire_fp32)) {
    // Random weights of --weights_seed, or the file converted to fp32.
    auto weights = LocalWeights(config);
    if (!weights.ok()) return Fail(command, weights.status());
    version = (*client)->LoadWeights(*weights, expected, OptionalLayer());
  } else {
    // The file's own dtype on the wire when the server accepts it (half the bytes for bf16/fp16).
    auto checkpoint = wire::SafetensorsCheckpoint::Open(path);
    if (!checkpoint.ok()) return Fail(command, checkpoint.status());
    std::vector<std::string> storage;
    std::vector<WeightUpload> uploads;
    storage.reserve(kNumWeights);
    for (Weight weight : kAllWeights) {
      auto tensor_name = LayerTensorName(*checkpoint, weight);
      if (!tensor_name.ok()) return Fail(command, tensor_name.status());
      auto entry = checkpoint->Find(*tensor_name);
      if (!entry.ok()) return Fail(command, entry.status());
      const v1::DType dtype = wire::DTypeFromSafetensors((*entry)->dtype);
      bool accepted = false;
      for (int d : info.supported_wire_dtypes()) accepted = accepted || d == dtype;
      if (dtype == v1::DTYPE_UNSPECIFIED || !accepted) {
        // Fall back to converting everything to fp32.
        auto weights = LocalWeights(config);
        if (!weights.ok()) return Fail(command, weights.status());
        uploads.clear();
        version = (*client)->LoadWeights(*weights, expected, OptionalLayer());
        break;
      }
      auto bytes = checkpoint->ReadBytes(*tensor_name);
      if (!bytes.ok()) return Fail(command, bytes.status());
      storage.push_back(*std::move(bytes));
      uploads.push_back(WeightUpload{weight, dtype, (*entry)->shape, storage.back()});
    }
    if (!uploads.empty()) version = (*client)->LoadWeights(uploads, expected, OptionalLayer());
  }
  if (!version.ok()) return Fail(command, version.status());
  std::cout << "uploaded " << LocalWeightsSource() << ": weights version " << *version << "\n";
  return 0;
}

}  // namespace attngrad::cli
