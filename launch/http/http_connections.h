// cpfill/launch/http/http_connections.h — the connections under `cpfill serve`'s HTTP front
// (http_server.h). cpp-httplib parses requests and calls the routes; this layer decides which
// connections and which bytes reach it, and when. Debian's cpp-httplib 0.11.4 alone gives each
// connection a thread for its whole life (a client that sends its headers a byte at a time holds
// one), reads a chunked body of any size and a header line of any length, and drops pipelined
// requests it has already buffered. Here a connection goes:
//
//   1. accept (cpp-httplib's listening thread, into GuardedServer::process_and_close_socket):
//      past max_connections it is answered 503 at once and closed.
//   2. waiting (one epoll thread; no thread per connection): until its request head (request
//      line and headers) is whole in the socket, peeked, not read; 408 past head_timeout, 431
//      past kMaxHeadBytes. A slow or silent client costs a socket, never a worker.
//   3. answering (a worker: `threads` of them, and two more for GET /health and /metrics alone):
//      cpp-httplib's process_request over a ConnectionStream, with Admit between the headers and
//      the body: the API key, the body's framing and size (413 before a byte of it is read), the
//      body's bytes taken from the pending budget (503 past it) until the answer is written. A
//      chunked body is counted against max_body_bytes as it comes. Requests pipelined behind it
//      are answered in turn on the same worker.
//   4. keep-alive: back to waiting (step 2) until keep_alive_timeout; after keep_alive_requests,
//      a refusal that left its body unread, or an error: closed, lingering (unread input drained
//      for at most a second) so that the client reads the answer rather than a reset.
// Once no request is being answered for a second, freed memory goes back to the system
// (malloc_trim), so that a burst of large bodies does not leave the process at its peak.
//
// A route reaches its connection through ThisConnection() (PeerGone: the client has closed it)
// and what this layer decided through ThisRequest().
//
//   GuardedServer server(options);               // then routes, as on any httplib::Server
//   server.bind_to_any_port("127.0.0.1");  server.listen_after_bind();   // until stop()
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "httplib.h"
#include "launch/http/http_api.h"
#include "launch/http/http_server.h"

namespace cpfill::launch {

// The most bytes of one request's head (request line and headers).
inline constexpr size_t kMaxHeadBytes = 64u << 10;

// Bytes of request bodies being read or answered, against --max-pending-bytes.
class ByteBudget {
 public:
  explicit ByteBudget(int64_t limit) : limit_(limit) {}
  bool TryTake(int64_t bytes);  // false, taking nothing, when they would pass the limit
  void Give(int64_t bytes) { held_ -= bytes; }
  int64_t held() const { return held_; }
  int64_t limit() const { return limit_; }

 private:
  const int64_t limit_;
  std::atomic<int64_t> held_{0};
};

// What the connection layer decided about the request being answered on this thread.
struct RequestScope {
  std::optional<Refusal> refusal;  // refused before routing, or its head or body failed to come
  std::string message;             // the refusal's, for the error body
  std::optional<Refusal> route_refusal;  // what a route's own error answer stands for (/metrics)
  int64_t taken_bytes = 0;               // from the budget, given back once the answer is written
  bool body_unread = false;              // refused before its body was read: the connection closes
};

// One connection's reads and writes for cpp-httplib, on a non-blocking use of a socket that the
// stream does not own. Bytes read ahead stay buffered from one request to the next (pipelining).
// Every wait also watches `stop_fd` (an eventfd the server signals when it stops).
class ConnectionStream final : public httplib::Stream {
 public:
  enum class Body { kNone, kLength, kChunked, kRefused };

  ConnectionStream(int fd, int stop_fd, const HttpOptions& options, ByteBudget& budget);

  // A request's head starts: it must come whole within head_timeout and kMaxHeadBytes.
  void BeginHead(RequestScope* scope);
  // Its body follows (Admit): none (reads give end of input), `length` bytes, chunked (at most
  // max_body_bytes on the wire, each byte taken from the budget as it comes), or refused.
  void BeginBody(Body body, uint64_t length);
  size_t buffered() const { return end_ - begin_; }
  std::string_view Buffered() const { return {buffer_.get() + begin_, end_ - begin_}; }
  void Shrink();  // frees the read buffer when it holds nothing (a connection held idle)
  bool failed() const { return failed_; }
  // The client has closed the connection (or reset it). Pipelined bytes it sent do not count.
  bool PeerGone() const;

  bool is_readable() const override;
  bool is_writable() const override;
  ssize_t read(char* ptr, size_t size) override;
  ssize_t write(const char* ptr, size_t size) override;
  void get_remote_ip_and_port(std::string& ip, int& port) const override;
  void get_local_ip_and_port(std::string& ip, int& port) const override;
  int socket() const override { return fd_; }

 private:
  enum class Phase { kHead, kBody };
  // Waits for input until `deadline` and reads it into the buffer: > 0 bytes, 0 at end of input,
  // < 0 on a timeout (recorded), an error or the server's stop.
  ssize_t Fill(std::chrono::steady_clock::time_point deadline);
  ssize_t Fail(Refusal why, std::string message);

  const int fd_, stop_fd_;
  const HttpOptions& options_;
  ByteBudget& budget_;
  std::unique_ptr<char[]> buffer_;
  size_t begin_ = 0, end_ = 0;
  RequestScope* scope_ = nullptr;
  Phase phase_ = Phase::kHead;
  std::chrono::steady_clock::time_point head_deadline_;
  size_t head_bytes_ = 0;
  Body body_ = Body::kNone;
  uint64_t body_limit_ = 0, body_read_ = 0;
  bool failed_ = false;
};

// The request being answered on this thread, and its connection (null elsewhere).
RequestScope* ThisRequest();
const ConnectionStream* ThisConnection();
// If this layer refused this thread's request (before routing, or because its head or body did
// not come whole), answers `res` with the refusal (its status, JSON body, Retry-After on a 503,
// Connection: close when the body was left unread) and returns true.
bool AnswerRefusal(httplib::Response& res);

class ConnectionHub;
class InlineQueue;
struct Connection;

// cpp-httplib's server with the connection layer above in place of its own. The routes, error,
// exception and post-routing handlers are set on it as on any httplib::Server; its pre-routing
// and Expect: 100-continue handlers and new_task_queue are its own.
class GuardedServer : public httplib::Server {
 public:
  explicit GuardedServer(HttpOptions options);
  ~GuardedServer() override;

  // Counted by the routes' post-routing handler, and here for what never reaches cpp-httplib.
  void Count(Refusal why) { refused_[static_cast<size_t>(why)]++; }
  // The counters of /metrics that this layer keeps.
  void Fill(ServerCounters* counters) const;

 private:
  friend class ConnectionHub;
  // cpp-httplib's listening thread, for each accepted socket: step 1 above.
  bool process_and_close_socket(int sock) override;
  // A worker (`probe`: one of GET /health's and /metrics'): steps 3 and 4 for a connection
  // whose head has come.
  void Answer(std::unique_ptr<Connection> connection, bool probe);
  // Between a request's headers and its body (process_request's setup_request).
  void Admit(httplib::Request& req, ConnectionStream& stream, RequestScope& scope);
  friend class InlineQueue;
  void Start();  // the hub's threads, when cpp-httplib starts listening
  void Stop();   // when it stops: no more answers; held connections closed

  const HttpOptions options_;
  ByteBudget budget_;
  std::unique_ptr<ConnectionHub> hub_;
  std::array<std::atomic<int64_t>, kRefusalKinds> refused_{};
};

}  // namespace cpfill::launch
