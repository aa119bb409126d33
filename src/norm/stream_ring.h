// The streamed row schedule's ring bookkeeping (norm/stream_rows.cuh), as __host__ __device__ functions so that the
// CPU test of the protocol (tests/cpu/test_stream_ring.cpp: a model of the mbarriers with copies landing out of
// order) runs the kernels' own arithmetic.
//
// Fill k of a block's ring goes to slot k % slots as that slot's use k / slots, and is consumed by consumer group
// k % groups. A slot's uses alternate between `fulls` mbarriers (stream_full_barriers: 2 by default, 1 under its knob
// where each group owns its slots): with two, use u waits on full[2 * slot + (u & 1)] for that barrier's phase
// u / 2; with one, on full[slot] for its phase u. Each slot has one `empty` mbarrier: the producer's fill of use
// u >= 1 waits for its phase u - 1 (the release of use u - 1).
#pragma once

#include <cstdint>

#include "difuse/numerics/fp32.h"  // DIFUSE_HD

namespace difuse::norm {

// How many `full` mbarriers a slot's uses alternate between. 2 (twenty-first session, 02a2be4): where the slots are
// not a multiple of the groups, a slot's consumer is another group each time round the ring, which may reach its
// wait for use u while use u - 1's bytes are still landing, and on one barrier a parity wait cannot tell use u - 1
// in flight from use u - 2 complete (norm/stream_rows.cuh). Where slots % groups == 0 each group owns its slots
// (fill k's slot k % slots and group k % groups stay paired), so a group reaches its wait for use u only after its own
// wait for use u - 1 passed, and one barrier's parity is unambiguous (twenty-fourth session). H200 at c254364
// (rev-bench/9e826cd/, experiment patches): layernorm_modulate 1x32760x1536 on 48 slots for 24 groups 67.7 / 67.5 us
// on one barrier against 72.3 / 72.4 on two; the streamed rms_norm (48 slots, 24 warps) 55.9 / 55.9 against 56.4 /
// 56.5. knob 1 (DIFUSE_STREAM_FULL_BARRIERS=1): one barrier where the groups own their slots, two elsewhere; any other
// value: two everywhere (the default until the rule has run in the whole GPU suite and the sanitizer on the H200:
// written after the session's last device call). tests/cpu/test_stream_ring.cpp runs both on the model.
DIFUSE_HD int stream_full_barriers(int slots, int groups, int knob) {
  return knob == 1 && groups >= 1 && slots % groups == 0 ? 1 : 2;
}

// Index into `full` (2 x slots barriers, the first `slots` of them used when fulls == 1) of slot s's use `use`:
// 2s + (u & 1) with two, s with one. Written with the shift fulls - 1 (0 or 1) instead of a select, so the two-barrier
// default costs the hot loops the same shift, mask and add as the fixed form of 02a2be4..9e826cd did.
DIFUSE_HD int stream_full_index(int s, uint32_t use, int fulls) {
  const int shift = fulls - 1;
  return (s << shift) + static_cast<int>(use & static_cast<uint32_t>(shift));
}

// The parity a consumer waits for on that barrier: use u is its phase u (one barrier) or u / 2 (two).
DIFUSE_HD uint32_t stream_full_parity(uint32_t use, int fulls) { return (use >> (fulls - 1)) & 1u; }

// The parity the producer waits for on slot s's `empty` barrier before the slot's use `use` >= 1.
DIFUSE_HD uint32_t stream_empty_parity(uint32_t use) { return (use - 1) & 1u; }

// Steps (s, use) from fill k to fill k + step (step > 0; e.g. groups for a consumer, lanes for a producer lane).
DIFUSE_HD void stream_advance(int& s, uint32_t& use, int step, int slots) {
  s += step;
  while (s >= slots) s -= slots, ++use;
}

// The producer lanes a ring of `slots` slots and `groups` consumer groups may run in step (stream_produce), at most
// `wanted`. With lanes in step, fill k waits only on fills of earlier steps when lanes <= slots (the producer's
// `empty` wait for use u then finds use u - 2 released), and a consumer that reached fill k has every fill of the
// step before k - groups issued, which covers k - slots when lanes <= slots - groups (its `full` wait then finds use
// u - 2 landed); where slots is a multiple of groups each group owns its slots and that second bound is not needed.
// tests/cpu/test_stream_ring.cpp runs the protocol at these lane counts (and shows more racing in the model).
DIFUSE_HD int stream_producer_lanes(int wanted, int slots, int groups) {
  int k = wanted < 1 ? 1 : wanted;
  if (k > slots) k = slots;
  if (slots % groups != 0 && k > slots - groups) k = slots - groups;
  return k < 1 ? 1 : k;
}

}  // namespace difuse::norm
