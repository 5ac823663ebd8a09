// The C++ client of an installed attngrad (attngrad/client.h, attngrad::client) against a running
// server: connect, GetModelInfo and a health check. Usage: attngrad_consumer_client HOST:PORT.
// Exit status 0 when the server answered both and the answer is a sane layer.
#include <cstdio>
#include <memory>
#include <string>

#include <attngrad/client.h>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s HOST:PORT\n", argv[0]);
    return 2;
  }
  attngrad::ClientOptions options;
  options.connect_timeout = absl::Seconds(120);  // the server may still be starting
  options.deadline = absl::Seconds(60);
  options.channels = 1;
  absl::StatusOr<std::unique_ptr<attngrad::Client>> client =
      attngrad::Client::Connect(argv[1], options);
  if (!client.ok()) {
    std::fprintf(stderr, "Connect(%s): %s\n", argv[1], client.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<attngrad::v1::GetModelInfoResponse> info = (*client)->Info();
  if (!info.ok()) {
    std::fprintf(stderr, "GetModelInfo: %s\n", info.status().ToString().c_str());
    return 1;
  }
  if (info->server_instance_id().empty() || info->config().hidden_size() <= 0 ||
      info->devices_size() == 0) {
    std::fprintf(stderr, "GetModelInfo answered an incomplete model: %s\n",
                 info->ShortDebugString().c_str());
    return 1;
  }
  absl::StatusOr<attngrad::HealthStatus> health = (*client)->Health();
  if (!health.ok() || *health != attngrad::HealthStatus::kServing) {
    std::fprintf(stderr, "Health: %s\n",
                 health.ok() ? std::string(attngrad::HealthStatusName(*health)).c_str()
                             : health.status().ToString().c_str());
    return 1;
  }
  std::printf("client: server %s (%s), hidden_size %d, %d device(s), health SERVING\n",
              info->server_version().c_str(), info->server_instance_id().c_str(),
              info->config().hidden_size(), info->devices_size());
  return 0;
}
