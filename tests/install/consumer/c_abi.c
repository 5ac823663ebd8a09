/* The C ABI of an installed libattngrad from C: one backward of a tiny layer on the CPU backend
 * (attngrad_backward_host_ex), checked for ATTNGRAD_OK and finite, non-zero gradients, and one bad
 * call checked for ATTNGRAD_INVALID_ARGUMENT. Exit status 0 when all holds. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <attngrad/attngrad.h>

enum { kBatch = 1, kSeq = 3, kHidden = 8, kHeads = 2, kKvHeads = 1, kHeadDim = 4 };
enum {
  kActivations = kBatch * kSeq * kHidden,
  kRotary = kBatch * kSeq * kHeadDim,
  kQOut = kHeads * kHeadDim,
  kKvOut = kKvHeads * kHeadDim
};

/* Small deterministic values in (-0.5, 0.5). */
static void fill(float* values, int count, int seed) {
  for (int i = 0; i < count; ++i) values[i] = (float)(((i * 37 + seed * 11) % 17) - 8) / 17.0f;
}

static int check_finite(const char* name, const float* values, int count, int* nonzero) {
  for (int i = 0; i < count; ++i) {
    if (!isfinite(values[i])) {
      fprintf(stderr, "%s[%d] is not finite\n", name, i);
      return 0;
    }
    if (values[i] != 0.0f) *nonzero = 1;
  }
  return 1;
}

int main(void) {
  static float grad_output[kActivations], hidden_states[kActivations];
  static float cos_table[kRotary], sin_table[kRotary];
  static float q_weight[kQOut * kHidden], k_weight[kKvOut * kHidden], v_weight[kKvOut * kHidden];
  static float o_weight[kHidden * kQOut], q_norm_weight[kHeadDim], k_norm_weight[kHeadDim];
  static float grad_hidden_states[kActivations];
  static float grad_q_weight[kQOut * kHidden], grad_k_weight[kKvOut * kHidden];
  static float grad_v_weight[kKvOut * kHidden], grad_o_weight[kHidden * kQOut];
  static float grad_q_norm_weight[kHeadDim], grad_k_norm_weight[kHeadDim];

  fill(grad_output, kActivations, 1);
  fill(hidden_states, kActivations, 2);
  for (int i = 0; i < kRotary; ++i) {
    const float angle = 0.1f * (float)(i / kHeadDim) * (float)(1 + i % (kHeadDim / 2));
    cos_table[i] = cosf(angle);
    sin_table[i] = sinf(angle);
  }
  fill(q_weight, kQOut * kHidden, 3);
  fill(k_weight, kKvOut * kHidden, 4);
  fill(v_weight, kKvOut * kHidden, 5);
  fill(o_weight, kHidden * kQOut, 6);
  for (int i = 0; i < kHeadDim; ++i) q_norm_weight[i] = k_norm_weight[i] = 0.1f * (float)i;

  const attngrad_layer layer = {.hidden_size = kHidden,
                                .num_heads = kHeads,
                                .num_kv_heads = kKvHeads,
                                .head_dim = kHeadDim,
                                .scaling = 0.5f,
                                .softcap = 50.0f,
                                .eps = 1e-6f,
                                .sliding_window = 0};
  const attngrad_inputs inputs = {.grad_output = grad_output,
                                  .hidden_states = hidden_states,
                                  .cos = cos_table,
                                  .sin = sin_table,
                                  .q_weight = q_weight,
                                  .k_weight = k_weight,
                                  .v_weight = v_weight,
                                  .o_weight = o_weight,
                                  .q_norm_weight = q_norm_weight,
                                  .k_norm_weight = k_norm_weight};
  const attngrad_outputs outputs = {.grad_hidden_states = grad_hidden_states,
                                    .grad_q_weight = grad_q_weight,
                                    .grad_k_weight = grad_k_weight,
                                    .grad_v_weight = grad_v_weight,
                                    .grad_o_weight = grad_o_weight,
                                    .grad_q_norm_weight = grad_q_norm_weight,
                                    .grad_k_norm_weight = grad_k_norm_weight};

  const int status = attngrad_backward_host_ex(&layer, kBatch, kSeq, 0, &inputs, &outputs);
  if (status != ATTNGRAD_OK) {
    fprintf(stderr, "attngrad_backward_host_ex: %s\n", attngrad_status_string(status));
    return 1;
  }
  int nonzero = 0;
  if (!check_finite("grad_hidden_states", grad_hidden_states, kActivations, &nonzero) ||
      !check_finite("grad_q_weight", grad_q_weight, kQOut * kHidden, &nonzero) ||
      !check_finite("grad_k_weight", grad_k_weight, kKvOut * kHidden, &nonzero) ||
      !check_finite("grad_v_weight", grad_v_weight, kKvOut * kHidden, &nonzero) ||
      !check_finite("grad_o_weight", grad_o_weight, kHidden * kQOut, &nonzero) ||
      !check_finite("grad_q_norm_weight", grad_q_norm_weight, kHeadDim, &nonzero) ||
      !check_finite("grad_k_norm_weight", grad_k_norm_weight, kHeadDim, &nonzero)) {
    return 1;
  }
  if (!nonzero) {
    fprintf(stderr, "every gradient is zero\n");
    return 1;
  }

  /* A null layer is refused, not dereferenced. */
  const int bad = attngrad_backward_host_ex(NULL, kBatch, kSeq, 0, &inputs, &outputs);
  if (bad != ATTNGRAD_INVALID_ARGUMENT) {
    fprintf(stderr, "a null layer gave %s, not ATTNGRAD_INVALID_ARGUMENT\n",
            attngrad_status_string(bad));
    return 1;
  }
  if (strcmp(attngrad_status_string(ATTNGRAD_OK), "ATTNGRAD_OK") != 0) {
    fprintf(stderr, "attngrad_status_string(ATTNGRAD_OK) is \"%s\"\n",
            attngrad_status_string(ATTNGRAD_OK));
    return 1;
  }
  printf("C ABI: attngrad_backward_host_ex OK (grad_hidden_states[0] = %g, devices: %d)\n",
         (double)grad_hidden_states[0], attngrad_device_count());
  return 0;
}
