// The input format of the received-message fuzzers: the first byte chooses how the rest (the
// message) is cut into pieces of 1 to 256 bytes, as gRPC's receive slices would cut it.
#ifndef ATTNGRAD_TESTS_FUZZ_RECEIVED_PIECES_H_
#define ATTNGRAD_TESTS_FUZZ_RECEIVED_PIECES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace attngrad::fuzz {

// The message of a fuzz input (size >= 1) and its pieces, which view `message`.
struct ReceivedPieces {
  std::string message;
  std::vector<absl::string_view> pieces;
};

inline void CutIntoPieces(const std::uint8_t* data, std::size_t size, ReceivedPieces* out) {
  const std::size_t piece_size = static_cast<std::size_t>(data[0]) + 1;
  out->message.assign(reinterpret_cast<const char*>(data + 1), size - 1);
  out->pieces.clear();
  for (std::size_t offset = 0; offset < out->message.size(); offset += piece_size) {
    out->pieces.push_back(absl::string_view(out->message).substr(offset, piece_size));
  }
}

}  // namespace attngrad::fuzz

#endif  // ATTNGRAD_TESTS_FUZZ_RECEIVED_PIECES_H_
