// cpfill/runtime/serving/lease_table.h — the KV hand-off's leases on world rank 0: which request
// ids hold KV for a decode worker, under which nonce and lease record (slot), until when.
//
// A publish takes a slot and a nonce when first batched (TakeSlot); once its prefill answers,
// the lease holds (Hold) until the worker releases it (Release, with the handle's nonce), it
// expires (Expire), or the engine ends. Every ending gives back the KV name the ranks must drop
// and frees the slot.
//
//   LeaseTable leases;  leases.Reset(/*max_leases=*/64, std::chrono::seconds(30));
//   std::optional<LeaseTable::Slot> s = leases.TakeSlot();          // nullopt: all are held
//   leases.Hold(id, {.kv_name = name, .slot = s->slot, .nonce = s->nonce, ...}, now);
//   absl::StatusOr<std::string> drop = leases.Release(id, s->nonce.ToString());  // the KV to free
//
// Nonces are 128 bits from the operating system's CSPRNG (KvNonce::Random), compared in constant
// time, and a caller without the right nonce learns nothing: an unknown id and a wrong nonce get
// the same answer.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/handoff/kv_handle.h"

namespace cpfill::runtime {

class LeaseTable {
 public:
  using Clock = std::chrono::steady_clock;
  struct Lease {
    std::string kv_name;
    int slot = 0;
    KvNonce nonce;
    Clock::time_point expires;
    int64_t tokens = 0;
  };
  struct Slot {
    int slot = 0;
    KvNonce nonce;
  };

  // `max_leases` slots, each lease lasting `length` from its hold or renewal.
  void Reset(int max_leases, std::chrono::milliseconds length);
  int max_leases() const { return max_leases_; }
  std::chrono::milliseconds length() const { return length_; }
  double length_s() const { return std::chrono::duration<double>(length_).count(); }

  // A free slot and a fresh random nonce; nullopt when every slot is taken.
  std::optional<Slot> TakeSlot();
  void ReturnSlot(int slot);  // a publish that never held
  // The lease of `id` holds from `now` (its slot was taken by TakeSlot).
  void Hold(const std::string& id, Lease lease, Clock::time_point now);

  // Ends the lease of `id` if it holds with `nonce` (KvNonce::ToString's form): returns the KV
  // name to drop. NotFound, the same for every cause, when no such lease holds (ended, expired,
  // never given, or another nonce: a stale or forged handle).
  absl::StatusOr<std::string> Release(const std::string& id, const std::string& nonce);
  // The lease lasts `length()` from `now`; returns that length in seconds. NotFound as Release.
  absl::StatusOr<double> Renew(const std::string& id, const std::string& nonce,
                               Clock::time_point now);
  // Ends every lease expired at `now`: the KV names to drop.
  std::vector<std::string> Expire(Clock::time_point now);

  int64_t held() const { return static_cast<int64_t>(leases_.size()); }
  int64_t held_tokens() const;

 private:
  absl::StatusOr<std::map<std::string, Lease>::iterator> Find(const std::string& id,
                                                              const std::string& nonce);
  std::string End(std::map<std::string, Lease>::iterator it);

  int max_leases_ = 0;
  std::chrono::milliseconds length_{30000};
  std::map<std::string, Lease> leases_;  // by request id
  std::vector<int> free_slots_;
};

}  // namespace cpfill::runtime
