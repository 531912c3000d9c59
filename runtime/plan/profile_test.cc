#include "runtime/plan/profile.h"

#include <cmath>

#include "gtest/gtest.h"

namespace cpfill::runtime::plan {
namespace {

TEST(InterpolateRate, ClampsAtTheEndsAndIsLinearInLogSize) {
  const std::vector<RatePoint> pts = {{100, 1.0}, {10000, 3.0}};
  EXPECT_DOUBLE_EQ(InterpolateRate(pts, 1), 1.0);
  EXPECT_DOUBLE_EQ(InterpolateRate(pts, 1e9), 3.0);
  EXPECT_NEAR(InterpolateRate(pts, 1000), 2.0, 1e-12);  // halfway in ln(size)
  EXPECT_EQ(InterpolateRate({}, 5), 0);
}

TEST(DeviceProfile, ParsesSortsAndRefusesBadRates) {
  auto d = ParseDeviceProfile(nlohmann::json::parse(R"({"elem_bytes": 2,
      "attention": [{"pairs_per_head": 1e8, "tflops": 500}, {"pairs_per_head": 1e6, "tflops": 100}],
      "gemm": [{"rows": 4096, "tflops": 700}]})"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->attention.front().size, 1e6);
  EXPECT_DOUBLE_EQ(d->AttentionTflops(1e9), 500);
  auto round = ParseDeviceProfile(nlohmann::json::parse(d->ToJson().dump()));
  ASSERT_TRUE(round.ok());
  EXPECT_DOUBLE_EQ(round->GemmTflops(1), 700);
  auto bad = ParseDeviceProfile(
      nlohmann::json::parse(R"({"attention": [{"pairs_per_head": 1e6, "tflops": -1}]})"));
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("attention"), std::string::npos);
  EXPECT_FALSE(ParseDeviceProfile(nlohmann::json::parse(R"({"gemm": []})")).ok());
}

TEST(LinkProfile, NamesIntraAndInterNodeLinks) {
  auto p = ParseLinkProfile(nlohmann::json::parse(R"({"links": {
      "nvlink": {"gbps": 150, "latency_us": 5}, "roce": {"gbps": 50, "latency_us": 10}},
      "intra_node": "nvlink", "inter_node": "roce"})"));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->InterNode().name, "roce");
  EXPECT_NEAR(p->IntraNode().Seconds(150e9), 1.0 + 5e-6, 1e-12);
  EXPECT_FALSE(
      ParseLinkProfile(nlohmann::json::parse(R"({"links": {"a": {"gbps": 1}}, "inter_node": "b"})"))
          .ok());
  EXPECT_FALSE(ParseLinkProfile(nlohmann::json::parse(R"({"links": {"a": {"gbps": 0}}})")).ok());
}

}  // namespace
}  // namespace cpfill::runtime::plan
