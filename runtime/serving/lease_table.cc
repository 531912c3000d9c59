#include "runtime/serving/lease_table.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "base/secure.h"
#include "base/status.h"

namespace cpfill::runtime {

void LeaseTable::Reset(int max_leases, std::chrono::milliseconds length) {
  max_leases_ = max_leases;
  length_ = length;
  free_slots_.clear();
  for (int slot = max_leases - 1; slot >= 0; --slot) free_slots_.push_back(slot);
}

std::optional<LeaseTable::Slot> LeaseTable::TakeSlot() {
  if (free_slots_.empty()) return std::nullopt;
  Slot s{.slot = free_slots_.back(), .nonce = KvNonce::Random()};
  free_slots_.pop_back();
  return s;
}

void LeaseTable::ReturnSlot(int slot) { free_slots_.push_back(slot); }

void LeaseTable::Hold(const std::string& id, Lease lease, Clock::time_point now) {
  lease.expires = now + length_;
  leases_[id] = std::move(lease);
}

absl::StatusOr<std::map<std::string, LeaseTable::Lease>::iterator> LeaseTable::Find(
    const std::string& id, const std::string& nonce) {
  auto it = leases_.find(id);
  const std::string held = it == leases_.end() ? KvNonce{}.ToString() : it->second.nonce.ToString();
  if (!ConstantTimeEqual(absl::AsciiStrToLower(nonce), held) || it == leases_.end()) {
    return absl::NotFoundError(
        "no KV lease holds under this id and nonce (released, expired, never given, or a stale "
        "or forged handle)");
  }
  return it;
}

std::string LeaseTable::End(std::map<std::string, Lease>::iterator it) {
  std::string kv_name = std::move(it->second.kv_name);
  free_slots_.push_back(it->second.slot);
  leases_.erase(it);
  return kv_name;
}

absl::StatusOr<std::string> LeaseTable::Release(const std::string& id, const std::string& nonce) {
  CPFILL_ASSIGN_OR_RETURN(auto it, Find(id, nonce));
  return End(it);
}

absl::StatusOr<double> LeaseTable::Renew(const std::string& id, const std::string& nonce,
                                         Clock::time_point now) {
  CPFILL_ASSIGN_OR_RETURN(auto it, Find(id, nonce));
  it->second.expires = now + length_;
  return length_s();
}

std::vector<std::string> LeaseTable::Expire(Clock::time_point now) {
  std::vector<std::string> dropped;
  for (auto it = leases_.begin(); it != leases_.end();) {
    auto next = std::next(it);
    if (it->second.expires <= now) dropped.push_back(End(it));
    it = next;
  }
  return dropped;
}

int64_t LeaseTable::held_tokens() const {
  int64_t n = 0;
  for (const auto& [id, lease] : leases_) n += lease.tokens;
  return n;
}

}  // namespace cpfill::runtime
