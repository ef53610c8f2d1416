// corefs_db_bench.cc - a db_bench-like comparison of RocksDB on corefs (its FileSystem,
// corefs_rocksdb.h) and RocksDB on a kernel filesystem directory, side by side.
//
//   corefs_db_bench [--dir /var/tmp] [--keys 100000] [--seconds 3] [--seed 1]
//                   [--only NAME,...] [--targets corefs,kernel] [--image-bytes 1073741824]
//                   [--shards 2] [--busy-poll] [--json FILE]
//
// Workloads (db_bench's, 16-byte keys and 100-byte values; "-sync" is WriteOptions.sync=true,
// none is sync=false):
//   rocksdb-fillseq[-sync]     keys 0..N in order into an empty database
//   rocksdb-fillrand[-sync]    N random keys (repeats allowed) into an empty database
//   rocksdb-overwrite[-sync]   random keys over a database of N keys
//   rocksdb-readrandom         random gets of N keys, flushed and compacted, reopened cold,
//                              direct reads (use_direct_reads) and no block cache, so that
//                              every get reads a block from the filesystem; on corefs with
//                              its data cache off (data_cache=0), so the block comes from
//                              the device there too
//   rocksdb-readwhilewrite     as readrandom while a second thread overwrites without sync;
//                              the reader's gets are measured
// Each run stops after N operations or --seconds, whichever comes first, on a fresh database
// (corefs: a freshly formatted image; kernel: a new directory, the filesystem synced first).
// Targets run interleaved per workload, as `corefs bench suite` does.
//
// Output: the table of `corefs bench suite` (workload, target, ops/s, MiB/s, p50, p90, p99,
// p99.9, max, cpu/op, mount) on stdout, progress on stderr, and with --json one JSON object
// per run and line (workload, target, seconds, ops, bytes, cpu_ns, latency buckets) that
// `corefs bench suite --only rocksdb` reads into its results.
#include "corefs_rocksdb.h"

#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/options.h>
#include <rocksdb/table.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <sys/resource.h>
#include <sys/vfs.h>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kKeyBytes = 16;
constexpr size_t kValueBytes = 100;

// A log-linear latency histogram: exact below 1024 ns, then 1024 sub-buckets per power of two
// (0.1% resolution), as HDR histograms with 3 significant digits.
class Histogram {
 public:
  Histogram() : counts_(kBuckets, 0) {}
  void Record(uint64_t ns) {
    counts_[Index(ns)]++;
    total_++;
    max_ = std::max(max_, ns);
  }
  uint64_t count() const { return total_; }
  uint64_t max() const { return max_; }
  uint64_t Percentile(double p) const {
    if (total_ == 0) return 0;
    uint64_t want = static_cast<uint64_t>(p / 100.0 * static_cast<double>(total_) + 0.5);
    want = std::max<uint64_t>(1, std::min(want, total_));
    uint64_t seen = 0;
    for (size_t i = 0; i < kBuckets; i++) {
      seen += counts_[i];
      if (seen >= want) return std::min(Value(i), max_);
    }
    return max_;
  }
  // Non-empty (value, count) pairs.
  std::vector<std::pair<uint64_t, uint64_t>> Buckets() const {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (size_t i = 0; i < kBuckets; i++) {
      if (counts_[i]) out.emplace_back(Value(i), counts_[i]);
    }
    return out;
  }

 private:
  static constexpr size_t kBuckets = 55 * 1024;
  static size_t Index(uint64_t v) {
    if (v < 1024) return static_cast<size_t>(v);
    int e = 63 - __builtin_clzll(v);
    uint64_t sub = v >> (e - 10);  // 1024 .. 2047
    return static_cast<size_t>(e - 9) * 1024 + static_cast<size_t>(sub - 1024);
  }
  static uint64_t Value(size_t i) {
    if (i < 1024) return i;
    int e = static_cast<int>(i / 1024) + 9;
    return (static_cast<uint64_t>(i % 1024) + 1024) << (e - 10);
  }
  std::vector<uint64_t> counts_;
  uint64_t total_ = 0;
  uint64_t max_ = 0;
};

struct Config {
  std::string dir = "/var/tmp";
  uint64_t keys = 100000;
  double seconds = 3.0;
  uint64_t seed = 1;
  std::vector<std::string> only;
  std::vector<std::string> targets = {"corefs", "kernel"};
  uint64_t image_bytes = 1ull << 30;
  uint32_t shards = 2;
  bool busy_poll = false;
  std::string json;
};

struct Workload {
  std::string name;
  enum Kind { kFillSeq, kFillRandom, kOverwrite, kReadRandom, kReadWhileWriting } kind;
  bool sync;
};

std::vector<Workload> Workloads() {
  return {
      {"rocksdb-fillseq-sync", Workload::kFillSeq, true},
      {"rocksdb-fillseq", Workload::kFillSeq, false},
      {"rocksdb-fillrand-sync", Workload::kFillRandom, true},
      {"rocksdb-fillrand", Workload::kFillRandom, false},
      {"rocksdb-overwrite-sync", Workload::kOverwrite, true},
      {"rocksdb-overwrite", Workload::kOverwrite, false},
      {"rocksdb-readrandom", Workload::kReadRandom, false},
      {"rocksdb-readwhilewrite", Workload::kReadWhileWriting, false},
  };
}

struct Run {
  std::string workload;
  std::string target;
  double seconds = 0;
  uint64_t ops = 0;
  uint64_t bytes = 0;
  uint64_t cpu_ns = 0;
  Histogram latency;
};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "corefs_db_bench: %s\n", what.c_str());
  std::exit(1);
}

void Must(const rocksdb::Status& s, const std::string& what) {
  if (!s.ok()) Die(what + ": " + s.ToString());
}

uint64_t ProcessCpuNs() {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  auto ns = [](const struct timeval& t) {
    return static_cast<uint64_t>(t.tv_sec) * 1000000000ull + static_cast<uint64_t>(t.tv_usec) * 1000ull;
  };
  return ns(u.ru_utime) + ns(u.ru_stime);
}

std::string Key(uint64_t i) {
  // --keys is at most 10^8, so 16 digits always suffice.
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016" PRIu64, i);
  return std::string(buf, kKeyBytes);
}

// db_bench-like values: pseudo-random bytes (half compressible in db_bench; compression is
// off here, so their content only has to differ).
std::string Value(std::mt19937_64& rng) {
  std::string v(kValueBytes, 0);
  for (size_t i = 0; i < kValueBytes; i += 8) {
    uint64_t x = rng();
    std::memcpy(&v[i], &x, std::min<size_t>(8, kValueBytes - i));
  }
  return v;
}

// The kernel filesystem's name, as `corefs bench suite` labels the directory target.
std::string FsTypeOf(const std::string& dir) {
  struct statfs st;
  if (statfs(dir.c_str(), &st) != 0) return "kernel";
  switch (static_cast<unsigned long>(st.f_type)) {
    case 0xEF53: return "ext4";
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x01021994: return "tmpfs";
    default: return "kernel";
  }
}

// A target: where a fresh database is opened for each run.
class Target {
 public:
  virtual ~Target() = default;
  virtual std::string name() const = 0;
  // A fresh, empty place for a database; returns the Env and the database path. With
  // `direct_reads`, reads bypass the filesystem's caches (O_DIRECT on a kernel filesystem,
  // which RocksDB's use_direct_reads asks for; corefs's data cache off).
  virtual void Fresh(std::shared_ptr<rocksdb::Env>* env, std::string* path, bool direct_reads) = 0;
  virtual void Finish() = 0;
};

class CorefsTarget : public Target {
 public:
  CorefsTarget(const Config& c) : config_(c) {
    image_ = c.dir + "/corefs-rocksdb-bench-" + std::to_string(getpid()) + ".img";
    // Written once, so that corefs's writes land on allocated blocks as a kernel
    // filesystem's overwrites do (as `corefs bench suite` prefills its image).
    std::fprintf(stderr, "writing a %" PRIu64 " MiB image at %s\n", c.image_bytes >> 20, image_.c_str());
    int fd = open(image_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) Die("creating " + image_ + ": " + std::strerror(errno));
    std::vector<char> chunk(1 << 20, 0x5c);
    for (uint64_t left = c.image_bytes; left > 0;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(left, chunk.size()));
      ssize_t w = write(fd, chunk.data(), n);
      if (w <= 0) Die("prefilling " + image_ + ": " + std::strerror(errno));
      left -= static_cast<uint64_t>(w);
    }
    if (fsync(fd) != 0) Die("prefilling " + image_ + ": " + std::strerror(errno));
    close(fd);
  }
  ~CorefsTarget() override { unlink(image_.c_str()); }
  std::string name() const override { return "corefs-file"; }
  void Fresh(std::shared_ptr<rocksdb::Env>* env, std::string* path, bool direct_reads) override {
    corefs_rocksdb::CorefsFsOptions o;
    o.format = corefs_rocksdb::Format::kAlways;
    o.shards = config_.shards;
    o.busy_poll = config_.busy_poll;
    o.data_cache = !direct_reads;
    std::shared_ptr<rocksdb::FileSystem> fs;
    Must(corefs_rocksdb::NewCorefsFileSystem(
             "file:" + image_ + ",size=" + std::to_string(config_.image_bytes), o, &fs),
         "mounting " + image_);
    env->reset(rocksdb::NewCompositeEnv(fs).release());
    *path = "/db";
  }
  void Finish() override {}

 private:
  Config config_;
  std::string image_;
};

class KernelTarget : public Target {
 public:
  KernelTarget(const Config& c) : fs_type_(FsTypeOf(c.dir)) {
    base_ = c.dir + "/corefs-rocksdb-bench-" + std::to_string(getpid());
    std::filesystem::create_directories(base_);
  }
  ~KernelTarget() override {
    std::error_code ignored;
    std::filesystem::remove_all(base_, ignored);
  }
  std::string name() const override { return fs_type_; }
  void Fresh(std::shared_ptr<rocksdb::Env>* env, std::string* path, bool) override {
    Finish();
    // The last run's deletions and writeback go to disk now, not into this run's time.
    int fd = open(base_.c_str(), O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
      syncfs(fd);
      close(fd);
    }
    // The default Env, not owned: an aliasing shared_ptr with no deleter.
    *env = std::shared_ptr<rocksdb::Env>(std::shared_ptr<rocksdb::Env>(), rocksdb::Env::Default());
    *path = base_ + "/db";
  }
  void Finish() override {
    std::error_code ignored;
    std::filesystem::remove_all(base_ + "/db", ignored);
  }

 private:
  std::string fs_type_;
  std::string base_;
};

rocksdb::Options DbOptions(rocksdb::Env* env, bool direct_reads_no_cache) {
  rocksdb::Options o;
  o.env = env;
  o.create_if_missing = true;
  o.compression = rocksdb::kNoCompression;
  if (direct_reads_no_cache) {
    o.use_direct_reads = true;
    rocksdb::BlockBasedTableOptions t;
    t.no_block_cache = true;
    o.table_factory.reset(rocksdb::NewBlockBasedTableFactory(t));
  }
  return o;
}

std::unique_ptr<rocksdb::DB> Open(rocksdb::Env* env, const std::string& path, bool direct) {
  rocksdb::DB* db = nullptr;
  Must(rocksdb::DB::Open(DbOptions(env, direct), path, &db), "opening " + path);
  return std::unique_ptr<rocksdb::DB>(db);
}

Run RunOne(Target& target, const Workload& w, const Config& c, uint64_t seed) {
  std::shared_ptr<rocksdb::Env> env;
  std::string path;
  const bool reads = w.kind == Workload::kReadRandom || w.kind == Workload::kReadWhileWriting;
  target.Fresh(&env, &path, reads);
  std::mt19937_64 rng(seed);
  std::unique_ptr<rocksdb::DB> db = Open(env.get(), path, reads);
  // Setup (not timed): N keys for the overwrite and read workloads.
  if (w.kind == Workload::kOverwrite || reads) {
    rocksdb::WriteOptions no_sync;
    for (uint64_t i = 0; i < c.keys; i++) Must(db->Put(no_sync, Key(i), Value(rng)), "setup put");
    Must(db->Flush(rocksdb::FlushOptions()), "setup flush");
    if (reads) {
      Must(db->CompactRange(rocksdb::CompactRangeOptions(), nullptr, nullptr), "setup compaction");
      // Reopened: the gets start cold, with nothing in memory but the tables' indexes.
      Must(db->Close(), "setup close");
      db.reset();
      db = Open(env.get(), path, true);
    }
  }
  Run run;
  run.workload = w.name;
  run.target = target.name();
  rocksdb::WriteOptions wo;
  wo.sync = w.sync;
  std::atomic<bool> stop{false};
  std::thread writer;
  if (w.kind == Workload::kReadWhileWriting) {
    writer = std::thread([&] {
      std::mt19937_64 wrng(seed ^ 0x5bd1e995);
      rocksdb::WriteOptions no_sync;
      while (!stop.load(std::memory_order_relaxed)) {
        Must(db->Put(no_sync, Key(wrng() % c.keys), Value(wrng)), "writer put");
      }
    });
  }
  const uint64_t cpu_before = ProcessCpuNs();
  const Clock::time_point started = Clock::now();
  const Clock::time_point until = started + std::chrono::duration_cast<Clock::duration>(
                                                std::chrono::duration<double>(c.seconds));
  std::string got;
  for (uint64_t i = 0; i < c.keys; i++) {
    Clock::time_point t0 = Clock::now();
    if (t0 >= until) break;
    if (reads) {
      rocksdb::Status s = db->Get(rocksdb::ReadOptions(), Key(rng() % c.keys), &got);
      if (!s.ok()) Die(w.name + " get: " + s.ToString());
      run.bytes += got.size();
    } else {
      uint64_t k = w.kind == Workload::kFillSeq ? i : rng() % c.keys;
      std::string v = Value(rng);
      Must(db->Put(wo, Key(k), v), w.name + " put");
      run.bytes += kKeyBytes + kValueBytes;
    }
    Clock::time_point t1 = Clock::now();
    run.latency.Record(static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count()));
    run.ops++;
  }
  run.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  run.cpu_ns = ProcessCpuNs() - cpu_before;
  stop = true;
  if (writer.joinable()) writer.join();
  Must(db->Close(), "close");
  db.reset();
  env.reset();
  target.Finish();
  return run;
}

std::string FmtNs(double ns) {
  char buf[32];
  if (ns < 1e3) std::snprintf(buf, sizeof buf, "%.0fns", ns);
  else if (ns < 1e6) std::snprintf(buf, sizeof buf, "%.1fus", ns / 1e3);
  else if (ns < 1e9) std::snprintf(buf, sizeof buf, "%.2fms", ns / 1e6);
  else std::snprintf(buf, sizeof buf, "%.2fs", ns / 1e9);
  return buf;
}

double OpsPerSec(const Run& r) { return r.seconds > 0 ? r.ops / r.seconds : 0; }
double MibPerSec(const Run& r) { return r.seconds > 0 ? r.bytes / r.seconds / (1 << 20) : 0; }
double CpuPerOp(const Run& r) { return r.ops ? static_cast<double>(r.cpu_ns) / r.ops : 0; }

// The table of `corefs bench suite` (bench/src/suite/mod.rs side_by_side), one repeat.
void PrintTable(const std::vector<Run>& runs, const std::vector<std::string>& targets) {
  std::printf("%-22s %-14s %10s %9s %9s %9s %9s %9s %9s %9s %9s\n", "workload", "target", "ops/s",
              "MiB/s", "p50", "p90", "p99", "p99.9", "max", "cpu/op", "mount");
  std::vector<std::string> workloads;
  for (const auto& r : runs) {
    if (std::find(workloads.begin(), workloads.end(), r.workload) == workloads.end()) {
      workloads.push_back(r.workload);
    }
  }
  auto find = [&](const std::string& w, const std::string& t) -> const Run* {
    for (const auto& r : runs) {
      if (r.workload == w && r.target == t) return &r;
    }
    return nullptr;
  };
  for (const auto& w : workloads) {
    for (const auto& t : targets) {
      const Run* r = find(w, t);
      if (!r) continue;
      std::printf("%-22s %-14s %10.0f %9.1f %9s %9s %9s %9s %9s %9s %9s\n", w.c_str(), t.c_str(),
                  OpsPerSec(*r), MibPerSec(*r), FmtNs(r->latency.Percentile(50)).c_str(),
                  FmtNs(r->latency.Percentile(90)).c_str(), FmtNs(r->latency.Percentile(99)).c_str(),
                  FmtNs(r->latency.Percentile(99.9)).c_str(), FmtNs(r->latency.max()).c_str(),
                  FmtNs(CpuPerOp(*r)).c_str(), "-");
    }
    const Run* ref = find(w, targets[0]);
    for (size_t i = 1; ref && i < targets.size(); i++) {
      const Run* o = find(w, targets[i]);
      if (!o) continue;
      auto ratio = [](double a, double b) {
        char buf[32];
        if (b > 0) std::snprintf(buf, sizeof buf, "%.2fx", a / b);
        else std::snprintf(buf, sizeof buf, "-");
        return std::string(buf);
      };
      std::string label = (targets[0] + "/" + targets[i]).substr(0, 14);
      std::printf("%-22s %-14s %10s %9s %9s %9s %9s %9s %9s %9s\n", "", label.c_str(),
                  ratio(OpsPerSec(*ref), OpsPerSec(*o)).c_str(),
                  ratio(MibPerSec(*ref), MibPerSec(*o)).c_str(),
                  ratio(ref->latency.Percentile(50), o->latency.Percentile(50)).c_str(),
                  ratio(ref->latency.Percentile(90), o->latency.Percentile(90)).c_str(),
                  ratio(ref->latency.Percentile(99), o->latency.Percentile(99)).c_str(),
                  ratio(ref->latency.Percentile(99.9), o->latency.Percentile(99.9)).c_str(),
                  ratio(ref->latency.max(), o->latency.max()).c_str(),
                  ratio(CpuPerOp(*ref), CpuPerOp(*o)).c_str());
    }
  }
}

void WriteJson(FILE* f, const Run& r) {
  std::fprintf(f,
               "{\"workload\":\"%s\",\"target\":\"%s\",\"seconds\":%.6f,\"ops\":%" PRIu64
               ",\"bytes\":%" PRIu64 ",\"cpu_ns\":%" PRIu64 ",\"buckets\":[",
               r.workload.c_str(), r.target.c_str(), r.seconds, r.ops, r.bytes, r.cpu_ns);
  bool first = true;
  for (const auto& b : r.latency.Buckets()) {
    std::fprintf(f, "%s[%" PRIu64 ",%" PRIu64 "]", first ? "" : ",", b.first, b.second);
    first = false;
  }
  std::fprintf(f, "]}\n");
}

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

uint64_t ParseU64(const std::string& flag, const char* text, uint64_t lo, uint64_t hi) {
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(text, &end, 10);
  if (*text == 0 || *end != 0 || errno != 0 || v < lo || v > hi) {
    Die(flag + " takes a number from " + std::to_string(lo) + " to " + std::to_string(hi));
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) Die(a + " needs a value");
      return argv[++i];
    };
    if (a == "--dir") c.dir = value();
    else if (a == "--keys") c.keys = ParseU64(a, value(), 1, 100000000);
    else if (a == "--seconds") {
      c.seconds = std::atof(value());
      if (!(c.seconds > 0 && c.seconds <= 3600)) Die("--seconds takes 0 to 3600");
    } else if (a == "--seed") c.seed = ParseU64(a, value(), 0, UINT64_MAX);
    else if (a == "--only") c.only = Split(value());
    else if (a == "--targets") c.targets = Split(value());
    else if (a == "--image-bytes") c.image_bytes = ParseU64(a, value(), 64ull << 20, 1ull << 50);
    else if (a == "--shards") c.shards = static_cast<uint32_t>(ParseU64(a, value(), 1, 65536));
    else if (a == "--busy-poll") c.busy_poll = true;
    else if (a == "--json") c.json = value();
    else if (a == "--help" || a == "-h") {
      std::printf(
          "usage: corefs_db_bench [--dir /var/tmp] [--keys 100000] [--seconds 3] [--seed 1]\n"
          "                       [--only NAME,...] [--targets corefs,kernel]\n"
          "                       [--image-bytes 1073741824] [--shards 2] [--busy-poll] [--json FILE]\n"
          "workloads:");
      for (const auto& w : Workloads()) std::printf(" %s", w.name.c_str());
      std::printf("\n");
      return 0;
    } else Die("unknown argument " + a + " (see the head of bindings/rocksdb/corefs_db_bench.cc)");
  }
  std::vector<Workload> workloads;
  for (const auto& w : Workloads()) {
    bool wanted = c.only.empty();
    for (const auto& o : c.only) wanted = wanted || w.name.find(o) != std::string::npos;
    if (wanted) workloads.push_back(w);
  }
  if (workloads.empty()) Die("no workload matches --only");
  std::vector<std::unique_ptr<Target>> targets;
  for (const auto& t : c.targets) {
    if (t == "corefs") targets.emplace_back(new CorefsTarget(c));
    else if (t == "kernel") targets.emplace_back(new KernelTarget(c));
    else Die("unknown target " + t + " (corefs, kernel)");
  }
  std::vector<std::string> names;
  for (const auto& t : targets) names.push_back(t->name());
  FILE* json = nullptr;
  if (!c.json.empty()) {
    json = std::fopen(c.json.c_str(), "w");
    if (!json) Die("opening " + c.json + ": " + std::strerror(errno));
  }
  double load = 0;
  if (getloadavg(&load, 1) == 1) {
    std::fprintf(stderr, "load average %.2f before the run%s\n", load,
                 load >= 1.0 ? ": other work competes with the benchmark" : "");
  }
  std::vector<Run> runs;
  size_t step = 0, total = workloads.size() * targets.size();
  for (const auto& w : workloads) {
    for (auto& t : targets) {
      step++;
      std::fprintf(stderr, "[%2zu/%zu] %s on %s ...\n", step, total, w.name.c_str(), t->name().c_str());
      Run r = RunOne(*t, w, c, c.seed);
      std::fprintf(stderr, "        %.0f ops/s, %.1f MiB/s, p50 %s, p99 %s, max %s\n", OpsPerSec(r),
                   MibPerSec(r), FmtNs(r.latency.Percentile(50)).c_str(),
                   FmtNs(r.latency.Percentile(99)).c_str(), FmtNs(r.latency.max()).c_str());
      if (json) {
        WriteJson(json, r);
        std::fflush(json);
      }
      runs.push_back(std::move(r));
    }
  }
  if (json && std::fclose(json) != 0) Die("writing " + c.json);
  PrintTable(runs, names);
  return 0;
}
