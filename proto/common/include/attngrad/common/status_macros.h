// ATTNGRAD_RETURN_IF_ERROR and ATTNGRAD_ASSIGN_OR_RETURN: early returns on an absl::Status error,
// for functions that return absl::Status or absl::StatusOr<T>.
//
//   ATTNGRAD_RETURN_IF_ERROR(CheckShape(shape, "x", expected));  // a Status or a StatusOr
//   ATTNGRAD_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
//   ATTNGRAD_ASSIGN_OR_RETURN(values, file.ReadFloats(name));  // an existing variable
//
// The left-hand side of ATTNGRAD_ASSIGN_OR_RETURN cannot contain an unparenthesised comma.
#ifndef ATTNGRAD_COMMON_STATUS_MACROS_H_
#define ATTNGRAD_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace attngrad::status_macros_internal {

inline const absl::Status& AsStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& AsStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

}  // namespace attngrad::status_macros_internal

#define ATTNGRAD_RETURN_IF_ERROR(expr)                                                     \
  do {                                                                                     \
    if (const auto& attngrad_return_if_error_value = (expr);                               \
        !attngrad_return_if_error_value.ok()) {                                            \
      return ::attngrad::status_macros_internal::AsStatus(attngrad_return_if_error_value); \
    }                                                                                      \
  } while (false)

#define ATTNGRAD_ASSIGN_OR_RETURN(lhs, expr)                                                     \
  ATTNGRAD_ASSIGN_OR_RETURN_IMPL_(ATTNGRAD_STATUS_MACROS_CONCAT_(attngrad_status_or_, __LINE__), \
                                  lhs, expr)

#define ATTNGRAD_ASSIGN_OR_RETURN_IMPL_(status_or, lhs, expr) \
  auto status_or = (expr);                                    \
  if (!status_or.ok()) return std::move(status_or).status();  \
  lhs = *std::move(status_or)

#define ATTNGRAD_STATUS_MACROS_CONCAT_(a, b) ATTNGRAD_STATUS_MACROS_CONCAT_INNER_(a, b)
#define ATTNGRAD_STATUS_MACROS_CONCAT_INNER_(a, b) a##b

#endif  // ATTNGRAD_COMMON_STATUS_MACROS_H_
