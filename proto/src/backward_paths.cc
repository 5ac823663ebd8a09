// The request's and the answer's big Tensor fields, by field number.
#include "attngrad/wire/backward_paths.h"

#include "attngrad/v1/attngrad.pb.h"
#include "attngrad/wire/layer.h"

namespace attngrad::wire {

const std::vector<FieldPath>& BackwardRequestActivationPaths() {
  static const auto* const kPaths =
      new std::vector<FieldPath>{{v1::BackwardRequest::kHiddenStatesFieldNumber},
                                 {v1::BackwardRequest::kGradOutputFieldNumber}};
  return *kPaths;
}

const std::vector<FieldPath>& BackwardResponseTensorPaths() {
  static const auto* const kPaths = [] {
    auto* paths = new std::vector<FieldPath>{{v1::BackwardResponse::kGradHiddenStatesFieldNumber}};
    for (Weight weight : kAllWeights) {
      paths->push_back({v1::BackwardResponse::kWeightGradientsFieldNumber,
                        static_cast<int>(WireWeightName(weight))});
    }
    return paths;
  }();
  return *kPaths;
}

}  // namespace attngrad::wire
