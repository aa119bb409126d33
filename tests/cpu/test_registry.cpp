#include <gtest/gtest.h>

#include <string>

#include "difuse/difuse.hpp"

TEST(Registry, ListsLayernormModulate) {
  const auto ks = difuse::registered_kernels();
  ASSERT_FALSE(ks.empty());
  bool found = false;
  for (const auto& k : ks) {
    EXPECT_FALSE(k.op.empty());
    EXPECT_FALSE(k.description.empty());
    if (k.op == "layernorm_modulate") {
      found = true;
      EXPECT_EQ(k.backend, "cuda");
      EXPECT_EQ(k.contract, "bit_exact");
      EXPECT_NE(k.reference.find("F.layer_norm"), std::string::npos);
      EXPECT_EQ(k.min_sm, 90);
    }
  }
  EXPECT_TRUE(found);
}

TEST(Registry, SelectsByOpAndBackend) {
  EXPECT_EQ(difuse::select_kernel("layernorm_modulate").backend, "cuda");
  EXPECT_EQ(difuse::select_kernel("layernorm_modulate", "cuda").op, "layernorm_modulate");
  try {
    difuse::select_kernel("layernorm_modulate", "rocm");
    FAIL() << "expected not found";
  } catch (const difuse::Error& e) {
    EXPECT_EQ(e.status(), DIFUSE_ERR_NOT_FOUND);
    EXPECT_NE(std::string(e.what()).find("rocm"), std::string::npos);
  }
  EXPECT_THROW(difuse::select_kernel("no_such_op"), difuse::Error);
}

TEST(Registry, IndexOutOfRangeIsAnError) {
  difuse_kernel_info k{};
  EXPECT_EQ(difuse_registry_get(difuse_registry_count(), &k), DIFUSE_ERR_NOT_FOUND);
  EXPECT_EQ(difuse_registry_get(-1, &k), DIFUSE_ERR_NOT_FOUND);
  EXPECT_EQ(difuse_registry_get(0, nullptr), DIFUSE_ERR_INVALID_ARGUMENT);
}
