// A load generator for bench/workers.py whose own CPU per Step is small next to the bridge's, so that on a
// 2-core machine the generator does not eat the core a second bridge worker needs (a Python grpc.aio client
// spends ~500 us of CPU per Step, about as much as the bridge; this one tens of microseconds).
//
// gRPC C++ generic stub (no generated code): requests are byte strings. `inflight` episodes run at once, each
// StartEpisode, `turns` unary Steps, EndEpisode, then a fresh one, on `channels` channels (one TCP connection
// each, so SO_REUSEPORT spreads them over the workers; an episode stays on the connection that started it).
// The Python side hands over the serialized requests without their episode id (field 1 of StepRequest and
// EndEpisodeRequest, prepended here; protobuf fields may come in any order) and reads one JSON line: Steps
// completed inside [begin, begin + seconds] (Unix time) and this process's CPU seconds over that window.
//
// Usage: stepgen PORT BEGIN SECONDS INFLIGHT CHANNELS TURNS START_HEX STEP_HEX END_HEX
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <cstdio>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

namespace {

std::string unhex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) out.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
  return out;
}

void put_varint(std::string& s, uint64_t v) {
  while (v >= 0x80) {
    s.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  s.push_back(static_cast<char>(v));
}

bool get_varint(const std::string& s, size_t& i, uint64_t& v) {
  v = 0;
  for (int shift = 0; i < s.size() && shift < 64; shift += 7) {
    uint8_t b = static_cast<uint8_t>(s[i++]);
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

// The first value of field 1 (a string) in a serialized message: StartEpisodeResponse.episode_ids[0].
std::string first_string_field1(const std::string& msg) {
  size_t i = 0;
  uint64_t key, len;
  while (i < msg.size() && get_varint(msg, i, key)) {
    uint32_t wire = key & 7;
    if (wire == 2) {
      if (!get_varint(msg, i, len) || i + len > msg.size()) break;
      if ((key >> 3) == 1) return msg.substr(i, len);
      i += len;
    } else if (wire == 0) {
      if (!get_varint(msg, i, len)) break;
    } else if (wire == 1) {
      i += 8;
    } else if (wire == 5) {
      i += 4;
    } else {
      break;
    }
  }
  return "";
}

grpc::ByteBuffer to_buffer(const std::string& s) {
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

std::string from_buffer(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!b.Dump(&slices).ok()) return out;
  for (const auto& sl : slices) out.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  return out;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double cpu_s() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

enum class Phase { kStart, kStep, kEnd };

struct Slot {
  grpc::GenericStub* stub = nullptr;
  Phase phase = Phase::kStart;
  int turn = 0;
  std::string episode;
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> call;
  grpc::ByteBuffer response;
  grpc::Status status;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 10) {
    std::fprintf(stderr, "usage: stepgen PORT BEGIN SECONDS INFLIGHT CHANNELS TURNS START_HEX STEP_HEX END_HEX\n");
    return 2;
  }
  const std::string target = std::string("127.0.0.1:") + argv[1];
  const double begin = std::stod(argv[2]), end = begin + std::stod(argv[3]);
  const int inflight = std::stoi(argv[4]), channels = std::stoi(argv[5]), turns = std::stoi(argv[6]);
  const std::string start_req = unhex(argv[7]), step_rest = unhex(argv[8]), end_rest = unhex(argv[9]);

  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  for (int c = 0; c < channels; ++c) {
    grpc::ChannelArguments args;
    args.SetInt("primerl.stepgen.channel", c);  // distinct arguments: a connection of its own
    stubs.push_back(std::make_unique<grpc::GenericStub>(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args)));
  }
  grpc::CompletionQueue cq;
  std::vector<Slot> slots(inflight);
  long steps = 0, errors = 0;
  double cpu_begin = -1, cpu_end = -1;
  std::atomic<bool> stopping{false};
  int live = 0;

  auto issue = [&](Slot& s) {
    std::string method, body;
    if (s.phase == Phase::kStart) {
      method = "/primerl.v1.PrimeRL/StartEpisode";
      body = start_req;
    } else {
      std::string head;
      head.push_back(0x0a);  // field 1, length-delimited: episode_id
      put_varint(head, s.episode.size());
      head += s.episode;
      method = s.phase == Phase::kStep ? "/primerl.v1.PrimeRL/Step" : "/primerl.v1.PrimeRL/EndEpisode";
      body = head + (s.phase == Phase::kStep ? step_rest : end_rest);
    }
    s.ctx = std::make_unique<grpc::ClientContext>();
    s.call = s.stub->PrepareUnaryCall(s.ctx.get(), method, to_buffer(body), &cq);
    s.call->StartCall();
    s.call->Finish(&s.response, &s.status, &s);
  };

  for (int i = 0; i < inflight; ++i) {
    slots[i].stub = stubs[i % channels].get();
    issue(slots[i]);
    ++live;
  }
  // The window's CPU is read by a thread that sleeps until its edges (process-wide CPU time, every thread).
  std::thread clock([&] {
    std::this_thread::sleep_for(std::chrono::duration<double>(std::max(0.0, begin - now_s())));
    cpu_begin = cpu_s();
    std::this_thread::sleep_for(std::chrono::duration<double>(std::max(0.0, end - now_s())));
    cpu_end = cpu_s();
    stopping = true;
  });
  void* tag;
  bool ok;
  while (live > 0 && cq.Next(&tag, &ok)) {
    double t = now_s();
    Slot& s = *static_cast<Slot*>(tag);
    if (!ok || !s.status.ok()) {
      if (++errors <= 3) std::fprintf(stderr, "stepgen: %s\n", s.status.error_message().c_str());
      s.phase = Phase::kStart;  // give the episode up; a fresh one takes its place
    } else if (s.phase == Phase::kStart) {
      s.episode = first_string_field1(from_buffer(s.response));
      s.phase = Phase::kStep;
      s.turn = 0;
    } else if (s.phase == Phase::kStep) {
      if (t >= begin && t <= end) ++steps;
      if (++s.turn >= turns) s.phase = Phase::kEnd;
    } else {
      s.phase = Phase::kStart;
    }
    if (stopping && s.phase != Phase::kEnd) {
      --live;  // episodes are left open at the end: the bridge is stopped after the run
      continue;
    }
    issue(s);
  }
  clock.join();
  std::printf("{\"steps\": %ld, \"cpu_s\": %.6f, \"errors\": %ld}\n", steps, cpu_end - cpu_begin, errors);
  return 0;
}
