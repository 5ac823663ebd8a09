// attngrad-cli metrics: reads the server's Prometheus exposition (/metrics on --metrics_target) and
// prints a summary: every attngrad_ counter and gauge sample, and each histogram series as its
// count and mean (buckets left out).
#include <iostream>
#include <cstring>
#include <map>
#include <set>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cli/http_get.h"
#include "cli_common.h"

ABSL_FLAG(std::string, metrics_target, "127.0.0.1:9464",
          "metrics: host:port of the server's Prometheus endpoint (--metrics_listen)");

namespace attngrad::cli {

int RunMetrics() {
  const std::string address = absl::GetFlag(FLAGS_metrics_target);
  auto response = cli::HttpGet(address, "/metrics");
  if (!response.ok()) return Fail("metrics", response.status());
  if (response->status != 200) {
    return Fail("metrics", absl::UnavailableError(absl::StrCat(
                               "GET http://", address, "/metrics: HTTP ", response->status)));
  }
  std::set<std::string> histograms;
  std::map<std::string, std::pair<double, double>> histogram_series;  // series -> (count, sum)
  std::vector<std::pair<std::string, std::string>> samples;
  for (absl::string_view line : absl::StrSplit(response->body, '\n', absl::SkipEmpty())) {
    if (absl::StartsWith(line, "# TYPE ")) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (parts.size() == 4 && parts[3] == "histogram") histograms.insert(parts[2]);
      continue;
    }
    if (line.empty() || line[0] == '#' || !absl::StartsWith(line, "attngrad_")) continue;
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    const std::string series(line.substr(0, space));
    const std::string value(line.substr(space + 1));
    const size_t brace = series.find('{');
    const std::string name = series.substr(0, brace);
    const std::string labels = brace == std::string::npos ? "" : series.substr(brace);
    bool in_histogram = false;
    for (const char* suffix : {"_bucket", "_count", "_sum"}) {
      if (!absl::EndsWith(name, suffix)) continue;
      const std::string base = name.substr(0, name.size() - std::strlen(suffix));
      if (!histograms.count(base)) continue;
      in_histogram = true;
      double number = 0;
      if (std::string(suffix) != "_bucket" && absl::SimpleAtod(value, &number)) {
        auto& entry = histogram_series[base + labels];
        (std::string(suffix) == "_count" ? entry.first : entry.second) = number;
      }
    }
    if (!in_histogram) samples.emplace_back(series, value);
  }
  std::cout << "metrics of http://" << address << "/metrics\n";
  for (const auto& [series, value] : samples) {
    std::cout << absl::StrFormat("  %-78s %s\n", series, value);
  }
  for (const auto& [series, count_sum] : histogram_series) {
    if (count_sum.first == 0) continue;
    std::cout << absl::StrFormat("  %-78s %.0f observed, mean %.4f s\n", series, count_sum.first,
                                 count_sum.second / count_sum.first);
  }
  return 0;
}

}  // namespace attngrad::cli
