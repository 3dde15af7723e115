// kvgate-epp-front: the endpoint picker's ext_proc front end, in C++ on gRPC's callback API.
//
// It speaks Envoy's external-processing protocol (the Gateway API Inference Extension's
// Endpoint Picker protocol, both body modes) and gRPC health; it decides nothing. Each
// request's headers, subset hint and body go to the kvgate routing service (`kvgate epp
// --frontend native`, Python) over one Unix socket; the answer comes back as header
// mutations and a destination, or as an immediate response, and this process turns it
// into ext_proc messages. On the response side it answers every message itself and sends the
// routing service only what its accounting needs: the status and served endpoint, the first
// bytes, the end (with the usage tail and the count of streamed events), or the stream's
// close. The frames are documented in gateway/epp/bridge.py, which is their other end.
//
// Usage: kvgate-epp-front --listen HOST:PORT --socket PATH [--max-body BYTES]
//                         [--cert FILE --key FILE] [--grace SECONDS]

#include <absl/synchronization/mutex.h>
#include <grpcpp/grpcpp.h>
#include <malloc.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "envoy/service/ext_proc/v3/external_processor.grpc.pb.h"

namespace {

namespace pb = envoy::service::ext_proc::v3;
using Mode = envoy::extensions::filters::http::ext_proc::v3::ProcessingMode;
using HeaderOption = envoy::config::core::v3::HeaderValueOption;

constexpr char kDestination[] = "x-gateway-destination-endpoint";
constexpr char kServed[] = "x-gateway-destination-endpoint-served";
constexpr char kSubset[] = "x-gateway-destination-endpoint-subset";
constexpr char kSubsetNamespace[] = "envoy.lb.subset_hint";
constexpr char kLbNamespace[] = "envoy.lb";
constexpr size_t kHeadBytes = 8192;
constexpr size_t kTailBytes = 4096;
constexpr size_t kStreamChunkBytes = 1 << 20;
const char* kReadyServices[] = {"", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"};

// -- frames: u32 length of what follows, u8 type, u64 stream id, payload ---------------------
void PutU16(std::string& s, uint32_t v) { s.push_back(char(v >> 8)); s.push_back(char(v)); }
void PutU32(std::string& s, uint32_t v) {
  for (int i = 3; i >= 0; --i) s.push_back(char(v >> (8 * i)));
}
void PutU64(std::string& s, uint64_t v) {
  for (int i = 7; i >= 0; --i) s.push_back(char(v >> (8 * i)));
}

struct Reader {  // a frame's payload, read front to back (a short payload reads as zeros)
  std::string_view rest;
  uint64_t Int(int n) {
    uint64_t v = 0;
    for (int i = 0; i < n && !rest.empty(); ++i) {
      v = (v << 8) | uint8_t(rest[0]);
      rest.remove_prefix(1);
    }
    return v;
  }
  std::string_view Bytes(size_t n) {
    n = std::min(n, rest.size());
    std::string_view out = rest.substr(0, n);
    rest.remove_prefix(n);
    return out;
  }
};

void JsonString(std::string& out, std::string_view s) {  // bytes as latin-1 code points
  out.push_back('"');
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(char(c));
    } else if (c < 0x20 || c >= 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out.push_back(char(c));
    }
  }
  out.push_back('"');
}

class Stream;

// The Unix socket to the routing service: frames out from any thread, frames in on one.
class Bridge {
 public:
  explicit Bridge(int fd) : fd_(fd) {}

  void Send(char type, uint64_t sid, std::string_view payload) {
    std::string frame;
    frame.reserve(13 + payload.size());
    PutU32(frame, uint32_t(9 + payload.size()));
    frame.push_back(type);
    PutU64(frame, sid);
    frame.append(payload);
    std::lock_guard<std::mutex> guard(send_mu_);
    size_t done = 0;
    while (done < frame.size()) {
      ssize_t n = ::write(fd_, frame.data() + done, frame.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        std::fprintf(stderr, "kvgate-epp-front: the routing service's socket closed\n");
        std::_Exit(3);
      }
      done += size_t(n);
    }
  }

  void Register(uint64_t sid, Stream* s) {
    std::lock_guard<std::mutex> guard(mu_);
    streams_[sid] = s;
  }
  void Unregister(uint64_t sid) {
    std::lock_guard<std::mutex> guard(mu_);
    streams_.erase(sid);
  }

  // Reads frames until the routing service goes away, then exits: without it nothing routes.
  void ReadLoop(grpc::HealthCheckServiceInterface* health);

 private:
  int fd_;
  std::mutex send_mu_;
  std::mutex mu_;
  std::unordered_map<uint64_t, Stream*> streams_;
};

std::atomic<uint64_t> next_sid{1};

// One ext_proc stream (one HTTP request through Envoy). Reactions and the bridge's answer
// may come on different threads: all state is under mu_.
class Stream : public grpc::ServerBidiReactor<pb::ProcessingRequest, pb::ProcessingResponse> {
 public:
  Stream(Bridge* bridge, size_t limit) : bridge_(bridge), sid_(next_sid++), limit_(limit) {
    bridge_->Register(sid_, this);
    StartRead(&req_);
  }

  void OnReadDone(bool ok) override {
    std::lock_guard<std::recursive_mutex> guard(mu_);
    if (!ok) {
      reads_done_ = true;
      MaybeFinish();
      return;
    }
    Handle();
    if (!finishing_) StartRead(&req_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::recursive_mutex> guard(mu_);
    writing_ = false;
    if (!ok) {
      queue_.clear();
      broken_ = true;
    } else if (!queue_.empty()) {
      Write();
    }
    MaybeFinish();
  }

  void OnDone() override {
    bridge_->Unregister(sid_);
    if (asked_ && !ended_) SendProgress('C', 0);  // released (or its pick cancelled)
    delete this;
  }

  // The routing service's answer: 'R' (routed) or 'I' (an immediate response).
  void Answer(char type, std::string_view payload) {
    std::lock_guard<std::recursive_mutex> guard(mu_);
    if (finished_ || answered_) return;
    answered_ = true;
    Reader r{payload};
    pb::ProcessingResponse out;
    if (type == 'I') {
      auto* ir = out.mutable_immediate_response();
      uint32_t status = uint32_t(r.Int(2));
      ir->mutable_status()->set_code(envoy::type::v3::StatusCode(status));
      ReadHeaders(r, ir->mutable_headers());
      ir->set_body(std::string(r.rest));
      ir->set_details("kvgate_epp_" + std::to_string(status));
      Push(std::move(out));
      if (too_large_) finishing_ = true;
    } else {
      pb::CommonResponse* common = phase_headers_
                                       ? out.mutable_request_headers()->mutable_response()
                                       : out.mutable_request_body()->mutable_response();
      common->set_clear_route_cache(true);
      auto* mutation = common->mutable_header_mutation();
      ReadHeaders(r, mutation);
      uint32_t n = uint32_t(r.Int(2));
      for (uint32_t i = 0; i < n; ++i) mutation->add_remove_headers(std::string(r.Bytes(r.Int(2))));
      std::string dest(r.Bytes(r.Int(4)));
      auto& lb = (*out.mutable_dynamic_metadata()->mutable_fields())[kLbNamespace];
      (*lb.mutable_struct_value()->mutable_fields())[kDestination].set_string_value(dest);
      Push(std::move(out));
      if (!echo_.empty()) Echo();
    }
    chunks_.clear();
    if (trailers_pending_) Push(Continue(pb::ProcessingRequest::kRequestTrailers));
    MaybeFinish();
  }

 private:
  template <class M>
  static void ReadHeaders(Reader& r, M* mutation) {
    uint32_t n = uint32_t(r.Int(2));
    for (uint32_t i = 0; i < n; ++i) {
      HeaderOption* o = mutation->add_set_headers();
      o->mutable_header()->set_key(std::string(r.Bytes(r.Int(2))));
      o->mutable_header()->set_raw_value(std::string(r.Bytes(r.Int(4))));
      o->set_append_action(HeaderOption::OVERWRITE_IF_EXISTS_OR_ADD);
    }
  }

  static pb::ProcessingResponse Continue(pb::ProcessingRequest::RequestCase kind) {
    pb::ProcessingResponse r;
    switch (kind) {
      case pb::ProcessingRequest::kRequestHeaders: r.mutable_request_headers(); break;
      case pb::ProcessingRequest::kRequestBody: r.mutable_request_body(); break;
      case pb::ProcessingRequest::kRequestTrailers: r.mutable_request_trailers(); break;
      case pb::ProcessingRequest::kResponseHeaders: r.mutable_response_headers(); break;
      case pb::ProcessingRequest::kResponseBody: r.mutable_response_body(); break;
      default: r.mutable_response_trailers(); break;
    }
    return r;
  }

  static pb::ProcessingResponse Streamed(std::string body, bool end, bool response) {
    pb::ProcessingResponse r;
    pb::BodyResponse* b = response ? r.mutable_response_body() : r.mutable_request_body();
    auto* s = b->mutable_response()->mutable_body_mutation()->mutable_streamed_response();
    s->set_body(std::move(body));
    s->set_end_of_stream(end);
    return r;
  }

  void Handle() {
    if (first_) {
      first_ = false;
      if (req_.has_protocol_config()) {
        duplex_ = req_.protocol_config().request_body_mode() == Mode::FULL_DUPLEX_STREAMED;
        duplex_response_ =
            req_.protocol_config().response_body_mode() == Mode::FULL_DUPLEX_STREAMED;
      }
    }
    switch (req_.request_case()) {
      case pb::ProcessingRequest::kRequestHeaders: {
        headers_json_ = HeadersJson(req_.request_headers());
        subset_json_ = SubsetJson();
        if (req_.request_headers().end_of_stream()) {
          Ask(true, "");
        } else if (!duplex_) {
          Push(Continue(pb::ProcessingRequest::kRequestHeaders));
        }
        break;
      }
      case pb::ProcessingRequest::kRequestBody: {
        const auto& body = req_.request_body();
        if (!body.body().empty() && !too_large_) {
          size_ += body.body().size();
          if (size_ > limit_) {
            too_large_ = true;  // the routing service answers with its 413
            chunks_.clear();
            Ask(!duplex_ ? false : true, "");
            break;
          }
          chunks_.push_back(body.body());
        }
        if (body.end_of_stream() && !asked_) {
          Ask(duplex_, duplex_ ? "end" : "");
        } else if (!duplex_ && !too_large_) {
          Push(Continue(pb::ProcessingRequest::kRequestBody));
        }
        break;
      }
      case pb::ProcessingRequest::kRequestTrailers: {
        if (!asked_) {
          trailers_pending_ = true;
          Ask(duplex_, duplex_ ? "open" : "");
        } else if (!answered_) {
          trailers_pending_ = true;
        } else {
          Push(Continue(pb::ProcessingRequest::kRequestTrailers));
        }
        break;
      }
      case pb::ProcessingRequest::kResponseHeaders: {
        const auto& h = req_.response_headers();
        for (const auto& v : h.headers().headers()) {
          if (v.key() == ":status") {
            const std::string& s = v.raw_value().empty() ? v.value() : v.raw_value();
            status_ = uint32_t(std::atoi(s.c_str()));
          }
        }
        served_ = Served();
        have_headers_ = true;
        if (h.end_of_stream()) SendProgress('P', kEnd);  // settled before answering
        Push(Continue(pb::ProcessingRequest::kResponseHeaders));
        break;
      }
      case pb::ProcessingRequest::kResponseBody: {
        const auto& body = req_.response_body();
        const std::string& data = body.body();
        Count(data);
        if (!first_bytes_sent_) {
          first_bytes_sent_ = true;
          head_ = data.substr(0, kHeadBytes);
          Tail(data);
          SendProgress('P', kFirst | (body.end_of_stream() ? kEnd : 0));
        } else {
          Tail(data);
          if (body.end_of_stream()) SendProgress('P', kEnd);
        }
        if (duplex_response_) {
          Push(Streamed(data, body.end_of_stream(), true));
        } else {
          Push(Continue(pb::ProcessingRequest::kResponseBody));
        }
        break;
      }
      case pb::ProcessingRequest::kResponseTrailers: {
        SendProgress('P', kEnd);
        Push(Continue(pb::ProcessingRequest::kResponseTrailers));
        break;
      }
      default:
        break;
    }
  }

  // -- to the routing service ------------------------------------------------------------
  static constexpr uint8_t kHeaders = 1, kFirst = 2, kEnd = 4;

  void Ask(bool phase_headers, std::string echo) {
    asked_ = true;
    phase_headers_ = phase_headers;
    echo_ = std::move(echo);
    std::string json = "{\"h\":" + headers_json_ + ",\"s\":" + subset_json_ + "}";
    std::string payload;
    size_t body = 0;
    for (const auto& c : chunks_) body += c.size();
    payload.reserve(5 + json.size() + body);
    payload.push_back(too_large_ ? 1 : 0);
    PutU32(payload, uint32_t(json.size()));
    payload += json;
    if (!too_large_) {
      for (const auto& c : chunks_) payload += c;
    }
    bridge_->Send('Q', sid_, payload);
  }

  // 'P' (progress) or 'C' (closed): flags, status, served endpoint, events, head, tail.
  void SendProgress(char type, uint8_t flags) {
    if (!asked_ || ended_) return;
    if (type == 'P' && have_headers_ && !headers_sent_) {
      flags |= kHeaders;
      headers_sent_ = true;
    }
    if (flags & kEnd || type == 'C') ended_ = true;
    std::string p;
    p.push_back(char(flags));
    PutU16(p, status_);
    PutU32(p, events_);
    PutU16(p, uint32_t(served_.size()));
    p += served_;
    const std::string& head = (flags & kFirst) ? head_ : std::string();
    PutU32(p, uint32_t(head.size()));
    p += head;
    if (flags & kEnd || type == 'C') p += tail_;
    bridge_->Send(type, sid_, p);
  }

  std::string HeadersJson(const pb::HttpHeaders& h) {
    std::string out = "{";
    bool any = false;
    for (const auto& v : h.headers().headers()) {
      if (any) out.push_back(',');
      any = true;
      std::string key = v.key();
      for (auto& c : key) c = char(std::tolower(static_cast<unsigned char>(c)));
      JsonString(out, key);
      out.push_back(':');
      JsonString(out, v.raw_value().empty() ? v.value() : v.raw_value());
    }
    out.push_back('}');
    return out;
  }

  std::string SubsetJson() {
    const auto& filters = req_.metadata_context().filter_metadata();
    auto ns = filters.find(kSubsetNamespace);
    if (ns == filters.end()) return "null";
    auto f = ns->second.fields().find(kSubset);
    if (f == ns->second.fields().end()) return "null";
    std::string out = "[";
    bool any = false;
    auto add = [&](std::string_view s) {
      while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
      while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
      if (s.empty()) return;
      if (any) out.push_back(',');
      any = true;
      JsonString(out, s);
    };
    if (f->second.has_list_value()) {
      for (const auto& v : f->second.list_value().values()) add(v.string_value());
    } else if (f->second.kind_case() == google::protobuf::Value::kStringValue) {
      std::string_view s = f->second.string_value();
      size_t start = 0;
      while (start <= s.size()) {
        size_t comma = s.find(',', start);
        if (comma == std::string_view::npos) comma = s.size();
        add(s.substr(start, comma - start));
        start = comma + 1;
      }
    }
    out.push_back(']');
    return out;
  }

  std::string Served() {
    const auto& filters = req_.metadata_context().filter_metadata();
    auto ns = filters.find(kLbNamespace);
    if (ns == filters.end()) return served_;
    auto f = ns->second.fields().find(kServed);
    if (f == ns->second.fields().end()) return served_;
    std::string s = f->second.string_value();
    s = s.substr(0, s.find(','));
    size_t a = s.find_first_not_of(' '), b = s.find_last_not_of(' ');
    return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
  }

  void Count(const std::string& data) {  // server-sent events: lines that start "data: "
    size_t pos = 0;
    while ((pos = data.find("data: ", pos)) != std::string::npos) {
      if (pos == 0 || data[pos - 1] == '\n') ++events_;
      pos += 6;
    }
  }

  void Tail(const std::string& data) {
    if (data.size() >= kTailBytes) {
      tail_.assign(data, data.size() - kTailBytes, kTailBytes);
    } else {
      tail_ += data;
      if (tail_.size() > kTailBytes) tail_.erase(0, tail_.size() - kTailBytes);
    }
  }

  void Echo() {  // a held duplex body goes back as streamed mutations of up to 1 MiB
    std::string batch;
    if (chunks_.empty()) chunks_.emplace_back();
    for (size_t i = 0; i < chunks_.size(); ++i) {
      if (!batch.empty() && batch.size() + chunks_[i].size() > kStreamChunkBytes) {
        Push(Streamed(std::move(batch), false, false));
        batch.clear();
      }
      batch += chunks_[i];
    }
    Push(Streamed(std::move(batch), echo_ == "end", false));
  }

  // -- to Envoy ----------------------------------------------------------------------------
  void Push(pb::ProcessingResponse r) {
    if (broken_ || finished_) return;
    queue_.push_back(std::move(r));
    if (!writing_) Write();
  }

  void Write() {
    current_ = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    StartWrite(&current_);
  }

  void MaybeFinish() {
    if (finished_ || writing_) return;
    if (reads_done_ || broken_ || (finishing_ && queue_.empty())) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }

  Bridge* bridge_;
  const uint64_t sid_;
  const size_t limit_;
  std::recursive_mutex mu_;
  pb::ProcessingRequest req_;
  pb::ProcessingResponse current_;
  std::deque<pb::ProcessingResponse> queue_;
  std::vector<std::string> chunks_;
  std::string headers_json_ = "{}", subset_json_ = "null", echo_, served_, head_, tail_;
  size_t size_ = 0;
  uint32_t status_ = 0, events_ = 0;
  bool first_ = true, duplex_ = false, duplex_response_ = false, too_large_ = false;
  bool asked_ = false, answered_ = false, phase_headers_ = false, trailers_pending_ = false;
  bool have_headers_ = false, headers_sent_ = false, first_bytes_sent_ = false, ended_ = false;
  bool writing_ = false, reads_done_ = false, finishing_ = false, finished_ = false;
  bool broken_ = false;
};

void Bridge::ReadLoop(grpc::HealthCheckServiceInterface* health) {
  std::string buf;
  char block[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd_, block, sizeof block);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      std::fprintf(stderr, "kvgate-epp-front: the routing service went away\n");
      std::_Exit(3);
    }
    buf.append(block, size_t(n));
    size_t at = 0;
    while (buf.size() - at >= 4) {
      Reader len{std::string_view(buf).substr(at, 4)};
      size_t size = size_t(len.Int(4));
      if (buf.size() - at - 4 < size) break;
      Reader r{std::string_view(buf).substr(at + 4, size)};
      char type = char(r.Int(1));
      uint64_t sid = r.Int(8);
      if (type == 'Y' || type == 'N') {
        for (const char* name : kReadyServices) health->SetServingStatus(name, type == 'Y');
        Send('A', 0, "");  // acknowledged: the health service says so from now on
      } else {
        std::lock_guard<std::mutex> guard(mu_);
        auto found = streams_.find(sid);
        if (found != streams_.end()) found->second->Answer(type, r.rest);
      }
      at += 4 + size;
    }
    buf.erase(0, at);
  }
}

class Processor : public pb::ExternalProcessor::CallbackService {
 public:
  Processor(Bridge* bridge, size_t limit) : bridge_(bridge), limit_(limit) {}
  grpc::ServerBidiReactor<pb::ProcessingRequest, pb::ProcessingResponse>* Process(
      grpc::CallbackServerContext*) override {
    return new Stream(bridge_, limit_);
  }

 private:
  Bridge* bridge_;
  size_t limit_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "kvgate-epp-front: cannot read %s\n", path.c_str());
    std::exit(2);
  }
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

int main(int argc, char** argv) {
  std::string listen = "127.0.0.1:9002", socket_path, cert, key;
  size_t max_body = 16 << 20;
  double grace = 5.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--listen") listen = value;
    else if (flag == "--socket") socket_path = value;
    else if (flag == "--max-body") max_body = size_t(std::stoull(value));
    else if (flag == "--cert") cert = value;
    else if (flag == "--key") key = value;
    else if (flag == "--grace") grace = std::stod(value);
    else {
      std::fprintf(stderr, "kvgate-epp-front: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (socket_path.empty() || socket_path.size() >= sizeof(sockaddr_un::sun_path)) {
    std::fprintf(stderr, "kvgate-epp-front: --socket PATH is needed (a short path)\n");
    return 2;
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket_path.c_str(), sizeof addr.sun_path - 1);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    std::fprintf(stderr, "kvgate-epp-front: cannot connect to %s\n", socket_path.c_str());
    return 2;
  }
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // before any thread: main waits for them

  // gRPC locks absl mutexes on every message; Debian's absl checks each lock for deadlock
  // cycles unless told not to (1-3 % of this process's CPU under load).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Request bodies up to --max-body are copied through here: keep buffers of a few MB on the
  // heap instead of a fresh mmap (and its page faults) for each one.
  mallopt(M_MMAP_THRESHOLD, 8 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  Bridge bridge(fd);
  Processor processor(&bridge, max_body);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!cert.empty() || !key.empty()) {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({ReadFile(key), ReadFile(cert)});
    creds = grpc::SslServerCredentials(ssl);
  }
  int port = 0;
  builder.AddListeningPort(listen, creds, &port);
  builder.RegisterService(&processor);
  int limit = int(std::min<size_t>(max_body + (1 << 20), INT32_MAX));
  builder.SetMaxReceiveMessageSize(limit);
  builder.SetMaxSendMessageSize(limit);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "kvgate-epp-front: cannot listen on %s\n", listen.c_str());
    return 2;
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus("liveness", true);
  for (const char* name : kReadyServices) health->SetServingStatus(name, false);
  std::string listening;
  PutU32(listening, uint32_t(port));
  bridge.Send('L', 0, listening);
  std::thread reader([&] { bridge.ReadLoop(health); });
  reader.detach();

  int sig = 0;
  sigwait(&signals, &sig);  // SIGTERM: not ready, let open streams finish, stop
  for (const char* name : kReadyServices) health->SetServingStatus(name, false);
  auto deadline = std::chrono::system_clock::now() +
                  std::chrono::milliseconds(int64_t(grace * 1000));
  server->Shutdown(deadline);
  std::_Exit(0);
}
