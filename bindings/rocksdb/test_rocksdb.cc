// test_rocksdb.cc - tests of RocksDB on corefs through corefs_rocksdb's FileSystem.
//
//   test_rocksdb functional DEVICE   open through the corefs:// URI, put/get/delete, iterate,
//                                    flush and compaction (RocksDB creates, renames and deletes
//                                    files), direct reads, reopen after a full unmount
//   test_rocksdb crash DEVICE SEED   a power cut: a child process (this program, "writer")
//                                    puts keys with sync=true on DEVICE opened with
//                                    cache=volatile and reports each acknowledged key on a
//                                    pipe; this process kills it with SIGKILL after a number of
//                                    acknowledgements drawn from SEED, reopens the database and
//                                    checks that every acknowledged key is there with its value
//
//   test_rocksdb served SOCKET       two processes and one database through a corefs server
//                                    (device serve:SOCKET): while this process has it open,
//                                    another's DB::Open fails on the LOCK file; once it is
//                                    closed the other opens it and reads it; a holder killed
//                                    with SIGKILL leaves the lock to the next opener, with its
//                                    keys (unsynced ones too: they were in the server)
//
// Each prints "PASS ..." lines and exits 0, or prints "FAIL ..." and exits 1. The seed is
// printed first so that a failing crash run can be repeated.
#include "corefs_rocksdb.h"

#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/options.h>
#include <rocksdb/table.h>
#include <rocksdb/convenience.h>

#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

namespace {

int g_failures = 0;

void Check(bool ok, const std::string& what) {
  if (ok) {
    std::printf("PASS %s\n", what.c_str());
  } else {
    std::printf("FAIL %s\n", what.c_str());
    g_failures++;
  }
  std::fflush(stdout);
}

// Stops the test at a failure the rest depends on.
void Require(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return;
  std::printf("FAIL %s: %s\n", what.c_str(), s.ToString().c_str());
  std::fflush(stdout);
  std::exit(1);
}

std::string Key(uint64_t i) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "key%012llu", static_cast<unsigned long long>(i));
  return buf;
}

// A 100-byte value that depends on the seed and the key, so a stale or misplaced value shows.
std::string Value(uint64_t seed, uint64_t i) {
  std::string v = "v" + std::to_string(seed) + "-" + std::to_string(i) + "-";
  uint64_t x = seed * 0x9e3779b97f4a7c15ULL + i;
  while (v.size() < 100) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v.push_back(static_cast<char>('a' + x % 26));
  }
  return v;
}

// Options that make RocksDB flush, compact and so create, rename and delete files often.
rocksdb::Options SmallOptions(rocksdb::Env* env) {
  rocksdb::Options options;
  options.env = env;
  options.create_if_missing = true;
  options.write_buffer_size = 64 << 10;
  options.target_file_size_base = 256 << 10;
  options.max_bytes_for_level_base = 1 << 20;
  options.level0_file_num_compaction_trigger = 2;
  options.use_direct_reads = true;
  options.max_manifest_file_size = 64 << 10;  // the MANIFEST rolls over too
  return options;
}

struct Opened {
  std::unique_ptr<rocksdb::Env> env_guard;
  std::shared_ptr<rocksdb::Env> env;
  std::unique_ptr<rocksdb::DB> db;
};

// Opens the database "/db" on `uri` through RocksDB's registry (Env::CreateFromUri).
void OpenThroughUri(const std::string& uri, Opened* out) {
  rocksdb::ConfigOptions config;
  rocksdb::Env* env = nullptr;
  Require(rocksdb::Env::CreateFromUri(config, "", uri, &env, &out->env), "Env::CreateFromUri " + uri);
  rocksdb::DB* db = nullptr;
  Require(rocksdb::DB::Open(SmallOptions(env), "/db", &db), "DB::Open on " + uri);
  out->db.reset(db);
}

int Functional(const std::string& device) {
  const uint64_t kKeys = 20000;
  const uint64_t seed = 7;
  {
    Opened o;
    // The image is new (the script makes a fresh one): format=new must format it.
    OpenThroughUri(corefs_rocksdb::CorefsUri(device, "format=new&shards=4"), &o);
    Check(o.env->GetFileSystem() != nullptr &&
              std::string(o.env->GetFileSystem()->Name()) == "CorefsFileSystem",
          "the corefs:// URI selects the corefs FileSystem");
    rocksdb::WriteOptions sync;
    sync.sync = true;
    for (uint64_t i = 0; i < kKeys; i++) {
      Require(o.db->Put(i % 100 == 0 ? sync : rocksdb::WriteOptions(), Key(i), Value(seed, i)),
              "Put");
    }
    for (uint64_t i = 0; i < kKeys; i += 3) Require(o.db->Delete(rocksdb::WriteOptions(), Key(i)), "Delete");
    uint64_t good = 0;
    for (uint64_t i = 0; i < kKeys; i++) {
      std::string v;
      rocksdb::Status s = o.db->Get(rocksdb::ReadOptions(), Key(i), &v);
      if (i % 3 == 0 ? s.IsNotFound() : (s.ok() && v == Value(seed, i))) good++;
    }
    Check(good == kKeys, "get after put/delete: " + std::to_string(good) + " of " +
                             std::to_string(kKeys) + " keys as written");
    Require(o.db->Flush(rocksdb::FlushOptions()), "Flush");
    rocksdb::CompactRangeOptions compact;
    compact.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
    Require(o.db->CompactRange(compact, nullptr, nullptr), "CompactRange");
    std::string l0;
    o.db->GetProperty("rocksdb.num-files-at-level0", &l0);
    Check(l0 == "0", "compaction emptied level 0 (" + l0 + " files left)");
    std::vector<std::string> children;
    Require(o.env->GetChildren("/db", &children), "GetChildren /db");
    int ssts = 0, tmps = 0, currents = 0, logs = 0;
    for (const auto& c : children) {
      if (c.size() > 4 && c.compare(c.size() - 4, 4, ".sst") == 0) ssts++;
      if (c.find(".dbtmp") != std::string::npos) tmps++;
      if (c == "CURRENT") currents++;
      if (c == "LOG") logs++;
    }
    Check(ssts > 0 && tmps == 0 && currents == 1 && logs == 1,
          "/db holds " + std::to_string(ssts) + " .sst files, CURRENT (renamed from a .dbtmp, " +
              std::to_string(tmps) + " left) and LOG, all in corefs");
    // Direct reads check RocksDB's side of the O_DIRECT contract.
    {
      auto fs = o.env->GetFileSystem();
      std::string sst;
      for (const auto& c : children) {
        if (c.size() > 4 && c.compare(c.size() - 4, 4, ".sst") == 0) sst = "/db/" + c;
      }
      rocksdb::FileOptions fo;
      fo.use_direct_reads = true;
      std::unique_ptr<rocksdb::FSRandomAccessFile> f;
      Require(fs->NewRandomAccessFile(sst, fo, &f, nullptr), "NewRandomAccessFile " + sst);
      alignas(4096) static char buf[8192];
      rocksdb::Slice got;
      rocksdb::IOStatus aligned = f->Read(0, 4096, rocksdb::IOOptions(), &got, buf, nullptr);
      rocksdb::IOStatus misaligned = f->Read(1, 4096, rocksdb::IOOptions(), &got, buf, nullptr);
      Check(f->use_direct_io() && aligned.ok() && misaligned.IsInvalidArgument(),
            "a direct read: aligned succeeds, misaligned is InvalidArgument (" +
                misaligned.ToString() + ")");
      uint64_t size = 0;
      bool exists_after = true;
      Require(fs->GetFileSize(sst, rocksdb::IOOptions(), &size, nullptr), "GetFileSize");
      Require(fs->LinkFile(sst, "/db/linked", rocksdb::IOOptions(), nullptr), "LinkFile");
      Require(fs->RenameFile("/db/linked", "/db/renamed", rocksdb::IOOptions(), nullptr), "RenameFile");
      uint64_t renamed_size = 0;
      Require(fs->GetFileSize("/db/renamed", rocksdb::IOOptions(), &renamed_size, nullptr),
              "GetFileSize renamed");
      exists_after = fs->FileExists("/db/linked", rocksdb::IOOptions(), nullptr).ok();
      Require(fs->DeleteFile("/db/renamed", rocksdb::IOOptions(), nullptr), "DeleteFile");
      Check(size > 0 && renamed_size == size && !exists_after &&
                fs->FileExists("/db/renamed", rocksdb::IOOptions(), nullptr).IsNotFound(),
            "link, rename, size and delete through the FileSystem");
    }
    // Write-behind: small appends held back by a writable file are seen by a reader of the
    // same file (opened before or after them, under another name too) and by its size.
    {
      auto fs = o.env->GetFileSystem();
      rocksdb::IOOptions io;
      std::unique_ptr<rocksdb::FSWritableFile> w;
      Require(fs->NewWritableFile("/db/behind", rocksdb::FileOptions(), &w, nullptr),
              "NewWritableFile /db/behind");
      std::unique_ptr<rocksdb::FSRandomAccessFile> early;
      Require(fs->NewRandomAccessFile("/db/behind", rocksdb::FileOptions(), &early, nullptr),
              "NewRandomAccessFile /db/behind");
      Require(w->Append("first,", io, nullptr), "Append");
      Require(w->Flush(io, nullptr), "Flush");
      char buf[64];
      rocksdb::Slice got;
      Require(early->Read(0, sizeof buf, io, &got, buf, nullptr), "Read (opened before)");
      bool early_sees = got.ToString() == "first,";
      uint64_t size = 0;
      Require(fs->GetFileSize("/db/behind", io, &size, nullptr), "GetFileSize /db/behind");
      Require(fs->RenameFile("/db/behind", "/db/behind2", io, nullptr), "RenameFile /db/behind");
      Require(w->Append("second", io, nullptr), "Append after rename");
      std::unique_ptr<rocksdb::FSSequentialFile> late;
      Require(fs->NewSequentialFile("/db/behind2", rocksdb::FileOptions(), &late, nullptr),
              "NewSequentialFile /db/behind2");
      rocksdb::Slice got2;
      Require(late->Read(sizeof buf, io, &got2, buf, nullptr), "Read (opened after a rename)");
      bool late_sees = got2.ToString() == "first,second";
      Check(early_sees && size == 6 && late_sees && w->GetFileSize(io, nullptr) == 12,
            "held-back appends are read through other handles and counted by GetFileSize");
      Require(w->Sync(io, nullptr), "Sync");
      Require(w->Close(io, nullptr), "Close /db/behind2");
      Require(fs->DeleteFile("/db/behind2", io, nullptr), "DeleteFile /db/behind2");
    }
    Require(o.db->Close(), "Close");
  }
  // Every FileSystem on the device is gone: the mount was closed. Reopen through the factory.
  {
    corefs_rocksdb::CorefsFsOptions fo;
    std::shared_ptr<rocksdb::FileSystem> fs;
    Require(corefs_rocksdb::NewCorefsFileSystem(device, fo, &fs), "NewCorefsFileSystem");
    std::unique_ptr<rocksdb::Env> env = rocksdb::NewCompositeEnv(fs);
    rocksdb::Options options = SmallOptions(env.get());
    options.create_if_missing = false;
    rocksdb::DB* raw = nullptr;
    Require(rocksdb::DB::Open(options, "/db", &raw), "DB::Open after remount");
    std::unique_ptr<rocksdb::DB> db(raw);
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
    uint64_t seen = 0, in_order = 0, expect = 1;
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      // Keys 1, 2, 4, 5, 7, ... (multiples of 3 deleted), in order.
      if (expect % 3 == 0) expect++;
      if (it->key().ToString() == Key(expect) && it->value().ToString() == Value(seed, expect)) {
        in_order++;
      }
      seen++;
      expect++;
    }
    Require(it->status(), "iterator");
    it.reset();  // an iterator must go before its database closes
    uint64_t want = kKeys - (kKeys + 2) / 3;
    Check(seen == want && in_order == want,
          "after a remount the iterator yields " + std::to_string(in_order) + " of " +
              std::to_string(want) + " live keys in order with their values");
    std::string v;
    Check(db->Get(rocksdb::ReadOptions(), Key(3), &v).IsNotFound(),
          "a deleted key stays deleted after the remount");
    rocksdb::FileLock* second = nullptr;
    rocksdb::IOStatus locked = fs->LockFile("/db/LOCK", rocksdb::IOOptions(), &second, nullptr);
    Check(!locked.ok(), "the open database's LOCK is held (" + locked.ToString() + ")");
    Require(db->Close(), "Close after remount");
  }
  // format=new on a device that holds a filesystem must keep it. Without the data cache
  // (data_cache=0), every get reads its blocks from the device.
  {
    Opened o;
    OpenThroughUri(corefs_rocksdb::CorefsUri(device, "format=new&data_cache=0"), &o);
    std::string v;
    rocksdb::Status s = o.db->Get(rocksdb::ReadOptions(), Key(1), &v);
    Check(s.ok() && v == Value(seed, 1), "format=new mounts an existing filesystem as it is");
    uint64_t good = 0;
    for (uint64_t i = 0; i < kKeys; i++) {
      rocksdb::Status g = o.db->Get(rocksdb::ReadOptions(), Key(i), &v);
      if (i % 3 == 0 ? g.IsNotFound() : (g.ok() && v == Value(seed, i))) good++;
    }
    Check(good == kKeys, "gets without the data cache: " + std::to_string(good) + " of " +
                             std::to_string(kKeys) + " right");
    Require(o.db->Close(), "Close after format=new");
  }
  {
    rocksdb::ConfigOptions config;
    rocksdb::Env* env = nullptr;
    std::shared_ptr<rocksdb::Env> guard;
    rocksdb::Status bad = rocksdb::Env::CreateFromUri(
        config, "", corefs_rocksdb::CorefsUri(device, "format=sometimes"), &env, &guard);
    Check(!bad.ok() && bad.ToString().find("format=sometimes") != std::string::npos,
          "an unknown URI option is refused (" + bad.ToString() + ")");
    bad = rocksdb::Env::CreateFromUri(
        config, "", corefs_rocksdb::CorefsUri(device, "data_cache=off"), &env, &guard);
    Check(!bad.ok() && bad.ToString().find("data_cache=off") != std::string::npos,
          "data_cache takes 0 or 1 (" + bad.ToString() + ")");
  }
  return g_failures ? 1 : 0;
}

// The child of a crash run: puts keys 0, 1, 2, ... with sync=true and writes each
// acknowledged index to stdout (the pipe), until killed.
int Writer(const std::string& device, uint64_t seed) {
  std::shared_ptr<rocksdb::FileSystem> fs;
  corefs_rocksdb::CorefsFsOptions fo;
  fo.format = corefs_rocksdb::Format::kAlways;
  fo.shards = 4;
  Require(corefs_rocksdb::NewCorefsFileSystem(device, fo, &fs), "writer: mount " + device);
  std::unique_ptr<rocksdb::Env> env = rocksdb::NewCompositeEnv(fs);
  rocksdb::DB* raw = nullptr;
  Require(rocksdb::DB::Open(SmallOptions(env.get()), "/db", &raw), "writer: DB::Open");
  rocksdb::WriteOptions sync;
  sync.sync = true;
  for (uint64_t i = 0;; i++) {
    Require(raw->Put(sync, Key(i), Value(seed, i)), "writer: Put");
    // One line per acknowledged key; the parent counts only complete lines.
    std::printf("%llu\n", static_cast<unsigned long long>(i));
    std::fflush(stdout);
  }
}

int Crash(const char* self, const std::string& device, uint64_t seed) {
  std::printf("crash: seed %llu (rerun: test_rocksdb crash DEVICE %llu)\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  // Enough acknowledgements that flushes, compactions and MANIFEST rolls have happened (a
  // memtable of 64 KiB holds about 450 keys), few enough to stay within seconds.
  const uint64_t kill_after = 500 + rng() % 4500;
  const unsigned extra_delay_us = static_cast<unsigned>(rng() % 2000);
  int fds[2];
  if (pipe(fds) != 0) {
    std::perror("pipe");
    return 1;
  }
  pid_t child = fork();
  if (child < 0) {
    std::perror("fork");
    return 1;
  }
  if (child == 0) {
    dup2(fds[1], 1);
    close(fds[0]);
    close(fds[1]);
    std::string volatile_device = device + ",cache=volatile";
    std::string seed_text = std::to_string(seed);
    execl(self, self, "writer", volatile_device.c_str(), seed_text.c_str(), (char*)nullptr);
    _exit(127);
  }
  close(fds[1]);
  FILE* in = fdopen(fds[0], "r");
  uint64_t acked = 0;  // keys 0 .. acked-1 acknowledged
  char line[64];
  while (acked < kill_after && std::fgets(line, sizeof line, in) != nullptr) {
    if (!std::isdigit(static_cast<unsigned char>(line[0]))) {
      // Not an acknowledgement: the writer's own FAIL line (a mount refused, say
      // cache=volatile by a library built without the `sim` feature). Show all of it.
      std::string said = line;
      char more[256];
      while (std::fgets(more, sizeof more, in) != nullptr) said += more;
      std::printf("FAIL crash: the writer failed: %s", said.c_str());
      kill(child, SIGKILL);
      waitpid(child, nullptr, 0);
      std::fclose(in);
      return 1;
    }
    size_t len = std::strlen(line);
    if (len == 0 || line[len - 1] != '\n') break;
    uint64_t i = std::strtoull(line, nullptr, 10);
    if (i != acked) {
      std::printf("FAIL crash: writer acknowledged %llu after %llu\n",
                  static_cast<unsigned long long>(i), static_cast<unsigned long long>(acked));
      kill(child, SIGKILL);
      return 1;
    }
    acked = i + 1;
  }
  // The kill lands inside a later Put: its WAL append, sync or a background flush.
  usleep(extra_delay_us);
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  // Lines the writer flushed before the kill are acknowledged too.
  while (std::fgets(line, sizeof line, in) != nullptr) {
    size_t len = std::strlen(line);
    if (len > 0 && line[len - 1] == '\n') acked = std::strtoull(line, nullptr, 10) + 1;
  }
  std::fclose(in);
  if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL) {
    std::printf("FAIL crash: the writer ended before the kill (status %d) after %llu keys\n",
                status, static_cast<unsigned long long>(acked));
    return 1;
  }
  // Reopen without the volatile cache: what the power cut left on the image.
  std::shared_ptr<rocksdb::FileSystem> fs;
  Require(corefs_rocksdb::NewCorefsFileSystem(device, corefs_rocksdb::CorefsFsOptions(), &fs),
          "crash: remount " + device);
  std::unique_ptr<rocksdb::Env> env = rocksdb::NewCompositeEnv(fs);
  rocksdb::Options options = SmallOptions(env.get());
  options.create_if_missing = false;
  options.paranoid_checks = true;
  rocksdb::DB* raw = nullptr;
  Require(rocksdb::DB::Open(options, "/db", &raw), "crash: DB::Open after the kill");
  std::unique_ptr<rocksdb::DB> db(raw);
  uint64_t missing = 0, wrong = 0, first_bad = UINT64_MAX;
  for (uint64_t i = 0; i < acked; i++) {
    std::string v;
    rocksdb::Status s = db->Get(rocksdb::ReadOptions(), Key(i), &v);
    if (s.IsNotFound()) missing++;
    else if (!s.ok() || v != Value(seed, i)) wrong++;
    else continue;
    if (first_bad == UINT64_MAX) first_bad = i;
  }
  // Keys past the last acknowledgement may or may not be there, but never with a wrong value.
  uint64_t beyond = 0;
  for (uint64_t i = acked;; i++) {
    std::string v;
    rocksdb::Status s = db->Get(rocksdb::ReadOptions(), Key(i), &v);
    if (s.IsNotFound()) break;
    if (!s.ok() || v != Value(seed, i)) wrong++;
    beyond++;
  }
  Check(missing == 0 && wrong == 0,
        "crash (seed " + std::to_string(seed) + "): killed after " + std::to_string(acked) +
            " acknowledged sync puts; after reopening " + std::to_string(acked - missing) +
            " are there, " + std::to_string(missing) + " missing, " + std::to_string(wrong) +
            " wrong" + (first_bad != UINT64_MAX ? " (first bad key " + std::to_string(first_bad) + ")" : "") +
            ", " + std::to_string(beyond) + " unacknowledged puts survived");
  Require(db->Close(), "crash: Close");
  return g_failures ? 1 : 0;
}

int Usage() {
  std::fprintf(stderr,
               "usage: test_rocksdb functional DEVICE\n"
               "       test_rocksdb served SOCKET\n"
               "       test_rocksdb crash DEVICE SEED\n");
  return 2;
}

// The other process of "served": opens "/db" on `device` and exits 0 if that opened it and
// the keys [0, `keys`) read back with their values, 3 if it failed on the LOCK file, 1 else.
int Opener(const std::string& device, uint64_t keys) {
  rocksdb::ConfigOptions config;
  rocksdb::Env* env = nullptr;
  std::shared_ptr<rocksdb::Env> guard;
  std::string uri = corefs_rocksdb::CorefsUri(device, "");
  Require(rocksdb::Env::CreateFromUri(config, "", uri, &env, &guard), "Env::CreateFromUri " + uri);
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(SmallOptions(env), "/db", &raw);
  if (!s.ok()) {
    std::printf("open: %s\n", s.ToString().c_str());
    return s.ToString().find("held by another process") != std::string::npos ? 3 : 1;
  }
  std::unique_ptr<rocksdb::DB> db(raw);
  uint64_t good = 0;
  for (uint64_t i = 0; i < keys; i++) {
    std::string v;
    if (db->Get(rocksdb::ReadOptions(), Key(i), &v).ok() && v == Value(11, i)) good++;
  }
  std::printf("read %llu of %llu keys\n", static_cast<unsigned long long>(good),
              static_cast<unsigned long long>(keys));
  Require(db->Close(), "Close");
  return good == keys ? 0 : 1;
}

// The killed process of "served": opens "/db", puts keys [`from`, `from` + 100) with
// sync=true and [`from` + 100, `from` + 200) with sync=false, says HELD on stdout and waits to
// be killed. (RocksDB promises that a process crash loses no write, even unsynced: through a
// server the writes are in the server, as on a kernel filesystem in its page cache.)
int Holder(const std::string& device, uint64_t from) {
  Opened o;
  OpenThroughUri(corefs_rocksdb::CorefsUri(device, ""), &o);
  rocksdb::WriteOptions sync;
  sync.sync = true;
  for (uint64_t i = from; i < from + 100; i++) Require(o.db->Put(sync, Key(i), Value(11, i)), "Put");
  for (uint64_t i = from + 100; i < from + 200; i++) {
    Require(o.db->Put(rocksdb::WriteOptions(), Key(i), Value(11, i)), "Put");
  }
  std::printf("HELD\n");
  std::fflush(stdout);
  for (;;) pause();
}

// Runs this program as `args` and returns its exit status (-1 if it did not exit).
int RunSelf(const char* self, const std::vector<std::string>& args) {
  pid_t child = fork();
  if (child == 0) {
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(self));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(self, argv.data());
    _exit(127);
  }
  int status = 0;
  if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

int Served(const char* self, const std::string& socket) {
  std::string device = "serve:" + socket;
  const uint64_t kKeys = 1000;
  {
    Opened o;
    OpenThroughUri(corefs_rocksdb::CorefsUri(device, ""), &o);
    rocksdb::WriteOptions sync;
    sync.sync = true;
    for (uint64_t i = 0; i < kKeys; i++) Require(o.db->Put(sync, Key(i), Value(11, i)), "Put");
    int rc = RunSelf(self, {"opener", device, std::to_string(kKeys)});
    Check(rc == 3, "another process cannot open the database this one has open (exit " +
                       std::to_string(rc) + ")");
    Require(o.db->Close(), "Close");
  }
  int rc = RunSelf(self, {"opener", device, std::to_string(kKeys)});
  Check(rc == 0, "once it is closed another process opens it and reads every key (exit " +
                     std::to_string(rc) + ")");
  // A holder killed while it has the database open: the next opener gets the lock (the
  // server drops a killed client's locks with its connection) and the holder's synced keys.
  int fds[2];
  if (pipe(fds) != 0) {
    std::printf("FAIL pipe: %s\n", std::strerror(errno));
    return 1;
  }
  pid_t holder = fork();
  if (holder == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    execl(self, self, "holder", device.c_str(), std::to_string(kKeys).c_str(), (char*)nullptr);
    _exit(127);
  }
  close(fds[1]);
  char buf[16] = {0};
  ssize_t got = read(fds[0], buf, sizeof buf - 1);
  close(fds[0]);
  Check(got > 0 && std::strncmp(buf, "HELD", 4) == 0, "the holder opened the database");
  int during = RunSelf(self, {"opener", device, std::to_string(kKeys)});
  Check(during == 3, "while the holder lives its lock keeps others out (exit " +
                         std::to_string(during) + ")");
  kill(holder, SIGKILL);
  waitpid(holder, nullptr, 0);
  int after = -1;
  for (int tries = 0; tries < 100 && after != 0; tries++) {
    after = RunSelf(self, {"opener", device, std::to_string(kKeys + 200)});
    if (after == 3) usleep(50 * 1000);
    else break;
  }
  Check(after == 0, "after the holder's SIGKILL the next process opens the database with all " +
                        std::to_string(kKeys + 200) +
                        " keys, the holder's unsynced ones too (exit " + std::to_string(after) + ")");
  return g_failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return Usage();
  std::string mode = argv[1];
  std::string device = argv[2];
  if (mode == "functional" && argc == 3) return Functional(device);
  if (mode == "served" && argc == 3) return Served("/proc/self/exe", device);
  if ((mode == "opener" || mode == "holder") && argc == 4) {
    char* end = nullptr;
    uint64_t n = std::strtoull(argv[3], &end, 10);
    if (*end != 0) return Usage();
    return mode == "opener" ? Opener(device, n) : Holder(device, n);
  }
  if ((mode == "crash" || mode == "writer") && argc == 4) {
    char* end = nullptr;
    uint64_t seed = std::strtoull(argv[3], &end, 10);
    if (*end != 0) return Usage();
    if (mode == "writer") return Writer(device, seed);
    return Crash("/proc/self/exe", device, seed);
  }
  return Usage();
}
