// attngrad-cli info and health.
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/strings/str_join.h"
#include "attngrad/wire/dtype.h"
#include "cli_common.h"

namespace attngrad::cli {

int RunInfo() {
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail("info", client.status());
  auto info = (*client)->Info();
  if (!info.ok()) return Fail("info", info.status());
  const v1::LayerConfig& c = info->config();
  for (int i = 0; (*client)->server_count() > 1 && i < (*client)->server_count(); ++i) {
    const Client& server = (*client)->server(i);
    std::cout << "server               " << (*client)->map()[i].ToString() << "  instance "
              << server.server_instance_id() << "\n";
  }
  std::cout << "target               " << (*client)->target() << "\n"
            << "server_version       " << info->server_version() << "\n"
            << "server_instance_id   " << info->server_instance_id() << "\n"
            << "layer                hidden=" << c.hidden_size() << " heads=" << c.num_heads()
            << " kv_heads=" << c.num_kv_heads() << " head_dim=" << c.head_dim() << "\n"
            << "weights              version " << info->weights_version() << ", "
            << info->weights_source() << "\n"
            << "accumulation_window  " << info->accumulation_window_id() << "\n"
            << "limits               max_message_bytes=" << info->max_message_bytes()
            << " max_batch_tokens=" << info->max_batch_tokens() << "\n"
            << "defaults             scaling=" << info->default_scaling()
            << " softcap=" << info->default_softcap() << " eps=" << info->default_eps() << "\n";
  std::vector<std::string> precisions, dtypes;
  for (int p : info->supported_precisions()) precisions.push_back(v1::Precision_Name(p));
  for (int d : info->supported_wire_dtypes()) dtypes.push_back(wire::DTypeName(d));
  std::cout << "precisions           " << absl::StrJoin(precisions, " ") << "\n"
            << "wire dtypes          " << absl::StrJoin(dtypes, " ") << "\n";
  for (const v1::DeviceInfo& d : info->devices()) {
    std::cout << "device " << d.index() << "             " << d.backend() << " " << d.name()
              << "  memory " << FormatBytes(static_cast<double>(d.memory_used_bytes())) << " / "
              << FormatBytes(static_cast<double>(d.memory_total_bytes())) << "\n";
  }
  if (!info->model_name().empty() || info->layers_size() > 1) {
    std::cout << "model                " << info->model_name() << ", " << info->num_hidden_layers()
              << " decoder layers, " << info->layers_size() << " held here\n";
  }
  for (const v1::LayerInfo& layer : info->layers()) {
    std::cout << "layer " << layer.index() << "              "
              << (layer.type() == v1::ATTENTION_TYPE_SLIDING ? "sliding" : "full")
              << " window=" << layer.sliding_window() << " rope_theta=" << layer.rope_theta()
              << " rope_scaling=" << layer.rope_scaling_factor() << " scaling=" << layer.scaling()
              << " softcap=" << layer.softcap() << " weights v" << layer.weights_version() << "\n";
  }
  return 0;
}

int RunHealth() {
  auto client = ConnectFromFlags(/*read_info=*/false);
  if (!client.ok()) return Fail("health", client.status());
  auto status = (*client)->Health(absl::GetFlag(FLAGS_service));
  if (!status.ok()) return Fail("health", status.status());
  std::cout << HealthStatusName(*status) << "\n";
  return *status == HealthStatus::kServing ? 0 : 1;
}

}  // namespace attngrad::cli
