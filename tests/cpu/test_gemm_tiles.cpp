// The GEMM tile rule and the tiles a build compiles (kernels/gemm/gemm.cuh): gemm_choose_tile only ever
// picks a tile that gemm_tile_can_be_chosen allows for the layout and epilogue kind (the build compiles
// kernels for those alone, CMakeLists.txt), and each allowed tile is picked for some shape, so the set
// is not wider than the rule. Host code only: the rule runs without a GPU.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "kernels/gemm/gemm.cuh"

namespace {

using coda::GemmEpilogue;
using coda::GemmLayout;
using coda::GemmTile;

constexpr GemmLayout kLayouts[] = {GemmLayout::Forward, GemmLayout::Dgrad, GemmLayout::Wgrad, GemmLayout::ForwardE4m3,
                                   GemmLayout::ForwardE5m2};
constexpr GemmEpilogue kEpilogues[] = {GemmEpilogue::Bare, GemmEpilogue::Program, GemmEpilogue::TwoTileInputs};

// The tiles the rule picks over shapes from tiny to the largest the trainer runs.
std::set<GemmTile> tiles_picked(GemmLayout layout, GemmEpilogue epilogue) {
  const std::vector<int> sizes = {64, 256, 768, 1024, 2048, 2304, 3072, 4096, 8192, 16384, 50304, 128256};
  std::set<GemmTile> picked;
  for (int M : {256, 16384, 32768})
    for (int N : sizes)
      for (int K : sizes) picked.insert(coda::gemm_choose_tile(layout, M, N, K, epilogue));
  return picked;
}

TEST(GemmTiles, TheRulePicksExactlyTheTilesItAllows) {
  for (GemmLayout layout : kLayouts)
    for (GemmEpilogue epilogue : kEpilogues) {
      SCOPED_TRACE(testing::Message() << "layout " << static_cast<int>(layout) << ", epilogue "
                                      << static_cast<int>(epilogue));
      std::set<GemmTile> allowed;
      for (GemmTile tile : coda::kGemmTiles)
        if (coda::gemm_tile_can_be_chosen(layout, epilogue, tile)) allowed.insert(tile);
      EXPECT_EQ(tiles_picked(layout, epilogue), allowed);
    }
}

TEST(GemmTiles, CompiledTilesAreTheAllowedOnesOrAll) {
  for (GemmLayout layout : kLayouts)
    for (GemmEpilogue epilogue : kEpilogues) {
      std::vector<GemmTile> want;
      for (GemmTile tile : coda::kGemmTiles)
        if (coda::kGemmAllTiles || coda::gemm_tile_can_be_chosen(layout, epilogue, tile)) want.push_back(tile);
      EXPECT_EQ(coda::gemm_tiles_compiled(layout, epilogue), want);
      EXPECT_FALSE(coda::gemm_tile_compiled(layout, epilogue, GemmTile::Auto));
    }
}

}  // namespace
