// corefs_rocksdb.cc - RocksDB's FileSystem over libcorefs (see corefs_rocksdb.h for how it is
// selected).
//
// Invariants:
//   * Every corefs call's result is checked; a negative errno becomes an IOStatus with the
//     errno mapped explicitly (ENOENT -> PathNotFound, ENOSPC -> NoSpace, others -> IOError
//     carrying strerror and corefs_last_error()), never an exception or an abort: RocksDB
//     decides what an error means (a failed WAL sync stops its writes).
//   * A writable file's size is tracked here (`size_bytes_`): RocksDB appends only through one
//     handle at a time, so Append writes at that offset; PositionedAppend and Truncate move it.
//   * Write-behind: a writable file holds small appends back (`WriteBehind`, up to
//     kWriteBehindBytes) instead of making each one a corefs call. RocksDB flushes its WAL
//     after every write batch, and a corefs_pwrite is a round trip to the reactor where a
//     kernel filesystem's write(2) is a copy into its page cache: sync=false puts ran at
//     0.24-0.35x ext4. What is held back goes to corefs when the buffer fills, at Sync/Fsync,
//     Truncate, PositionedAppend and Close, before any read of the same file through another
//     handle (by inode, so a rename does not hide it) and before a size is asked by path.
//     Nothing a crash keeps is lost by it: corefs lives in this process, so a write not yet
//     synced dies with the process whether it waits here or in corefs's dirty blocks.
//     Through a corefs server (serve:SOCKET) corefs lives in another process, and a write
//     it took survives this one's crash, as a kernel's page cache keeps an unsynced write
//     (RocksDB promises that a process crash loses no write, even with sync=false): nothing
//     is held back there, every append is a call.
//   * Sync is corefs's fdatasync and Fsync its fsync: one log record and one flush each
//     (docs/durability.md); a directory's Fsync makes its entries durable. A Sync with bytes
//     held back writes and syncs them in one corefs call (an atomic batch: stage, commit),
//     so a sync=true put is one round trip to the reactor, not two.
//   * Direct reads (use_direct_reads) are served as any read (corefs has no page cache to
//     bypass); they check RocksDB's side of the O_DIRECT contract (offset, length and buffer
//     aligned to kAlignmentBytes) and refuse a misaligned one with InvalidArgument, as
//     O_DIRECT refuses it with EINVAL, so a run that works here works on a kernel filesystem.
//   * One corefs mount per device string per process (`Mount`), shared by reference count and
//     closed (committing everything) with the last FileSystem on it.
//
// Fault model: an I/O failure below corefs makes its shard fail-stop; every later call on
// it returns an errno, which reaches RocksDB as an IOError here. Nothing is retried.
#include "corefs_rocksdb.h"

#include "corefs.h"

#include <rocksdb/env.h>
#include <rocksdb/utilities/object_registry.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <set>
#include <sys/stat.h>
#include <sys/time.h>
#include <thread>
#include <vector>

using rocksdb::FileOptions;
using rocksdb::IODebugContext;
using rocksdb::IOOptions;
using rocksdb::IOStatus;
using rocksdb::Slice;

namespace corefs_rocksdb {
namespace {

// corefs's block size: direct I/O aligns offsets, lengths and buffers to it.
constexpr size_t kAlignmentBytes = 4096;
// The largest transfer one corefs_pread/pwrite call moves (as pread(2)).
constexpr size_t kMaxTransferBytes = 0x7ffff000;
// The most a writable file holds back (see the file's invariants): about 500 WAL records of
// a 100-byte put; larger appends (a table's 1 MiB writes) go straight through.
constexpr size_t kWriteBehindBytes = 64 << 10;
constexpr uint32_t kFileMode = 0644;
constexpr uint32_t kDirMode = 0755;

// Maps a corefs errno to an IOStatus. `what` names the operation and path.
IOStatus Errno(const std::string& what, int64_t rc) {
  // corefs_last_error() is per thread and valid until this thread's next corefs call: read it
  // before anything else could call into corefs.
  std::string detail = corefs_last_error();
  int err = static_cast<int>(-rc);
  std::string msg = what + ": " + std::strerror(err);
  if (!detail.empty()) msg += " (" + detail + ")";
  switch (err) {
    case ENOENT:
      return IOStatus::PathNotFound(msg);
    case ENOSPC:
      return IOStatus::NoSpace(msg);
    case EINVAL:
      return IOStatus::InvalidArgument(msg);
    case EBUSY:
      return IOStatus::Busy(msg);
    case ENOTSUP:
      return IOStatus::NotSupported(msg);
    default:
      return IOStatus::IOError(msg);
  }
}

bool Aligned(uint64_t value) { return value % kAlignmentBytes == 0; }

// Paths: RocksDB's names are absolute; a relative one is taken from the root, as corefs does.
std::string Normalise(const std::string& path) {
  if (!path.empty() && path[0] == '/') return path;
  return "/" + path;
}

// Writes all of `data` at `offset`, as many corefs_pwrite calls as it takes.
IOStatus WriteAll(corefs_fs fs, corefs_fd fd, const std::string& path, uint64_t offset,
                  const Slice& data) {
  size_t done = 0;
  while (done < data.size()) {
    size_t want = std::min(data.size() - done, kMaxTransferBytes);
    int64_t rc = corefs_pwrite(fs, fd, reinterpret_cast<const uint8_t*>(data.data() + done),
                               want, offset + done);
    if (rc < 0) return Errno("write " + path, rc);
    // corefs writes all it is given (up to kMaxTransferBytes): 0 would loop forever.
    if (rc == 0) return IOStatus::IOError("write " + path + ": wrote nothing");
    done += static_cast<size_t>(rc);
  }
  return IOStatus::OK();
}

// fdatasync (data_only) or fsync of an open handle.
IOStatus SyncFd(corefs_fs fs, corefs_fd fd, const std::string& path, bool data_only) {
  int rc = data_only ? corefs_fdatasync(fs, fd) : corefs_fsync(fs, fd);
  if (rc < 0) return Errno((data_only ? "fdatasync " : "fsync ") + path, rc);
  return IOStatus::OK();
}

// The appends a writable file holds back, and the file's size including them. Its own
// thread appends and syncs; a reader of the same file on another thread writes it out
// (`Mount::FlushWriterOf`): the mutex orders the two.
class WriteBehind {
 public:
  // `hold_max_bytes`: what may be held back (0: nothing, every append is written at once).
  WriteBehind(corefs_fs fs, corefs_fd fd, std::string path, uint64_t size_bytes,
              size_t hold_max_bytes)
      : fs_(fs),
        fd_(fd),
        path_(std::move(path)),
        size_bytes_(size_bytes),
        hold_max_bytes_(hold_max_bytes) {}

  // Appends `data` at the end of the file: held back when it fits, else what is held and
  // then `data` are written.
  IOStatus Append(const Slice& data) {
    std::lock_guard<std::mutex> guard(mu_);
    if (held_.size() + data.size() > hold_max_bytes_) {
      IOStatus s = FlushLocked();
      if (!s.ok()) return s;
    }
    if (data.size() >= hold_max_bytes_) {
      IOStatus s = WriteAll(fs_, fd_, path_, size_bytes_, data);
      if (s.ok()) size_bytes_ += data.size();
      return s;
    }
    held_.append(data.data(), data.size());
    size_bytes_ += data.size();
    return IOStatus::OK();
  }

  // Writes what is held back.
  IOStatus Flush() {
    std::lock_guard<std::mutex> guard(mu_);
    return FlushLocked();
  }

  // Runs `f` (a write elsewhere in the file, a truncate) after what is held back is
  // written, with the size it returns as the new size.
  template <typename F>
  IOStatus Then(F f) {
    std::lock_guard<std::mutex> guard(mu_);
    IOStatus s = FlushLocked();
    if (s.ok()) s = f(&size_bytes_);
    return s;
  }

  // Makes the file durable (fdatasync, or fsync with !data_only) with what is held back.
  // Held bytes are staged in an atomic batch and committed: written and synced in one
  // reactor round trip. The commit makes the file durable as fsync does, which covers both.
  IOStatus Sync(bool data_only) {
    std::lock_guard<std::mutex> guard(mu_);
    if (!held_.empty()) {
      int rc = corefs_atomic_begin(fs_, fd_);
      if (rc < 0) return Errno("atomic begin " + path_, rc);
      IOStatus s = WriteAll(fs_, fd_, path_, size_bytes_ - held_.size(), Slice(held_));
      if (!s.ok()) {
        corefs_atomic_abort(fs_, fd_);
        return s;
      }
      rc = corefs_atomic_commit(fs_, fd_);
      if (rc < 0) return Errno("sync (atomic commit) " + path_, rc);
      held_.clear();
      return IOStatus::OK();
    }
    return SyncFd(fs_, fd_, path_, data_only);
  }

  uint64_t SizeBytes() {
    std::lock_guard<std::mutex> guard(mu_);
    return size_bytes_;
  }

 private:
  IOStatus FlushLocked() {
    if (held_.empty()) return IOStatus::OK();
    // Kept on a failure: the next call tries again and reports corefs's error again (a
    // failed corefs is fail-stop, so RocksDB sees it on every call).
    IOStatus s = WriteAll(fs_, fd_, path_, size_bytes_ - held_.size(), Slice(held_));
    if (s.ok()) held_.clear();
    return s;
  }

  const corefs_fs fs_;
  const corefs_fd fd_;
  const std::string path_;
  std::mutex mu_;
  std::string held_;
  // The file's size, with `held_` at its end.
  uint64_t size_bytes_;
  const size_t hold_max_bytes_;
};

// ------------------------------------------------------------------------------------------
// The mount shared by every FileSystem of one device string.

class Mount {
 public:
  // `remote`: the filesystem lives in a corefs server (see "Write-behind" above).
  Mount(corefs_fs fs, bool remote) : fs_(fs), remote_(remote) {}
  Mount(const Mount&) = delete;
  Mount& operator=(const Mount&) = delete;
  ~Mount() {
    // libcorefs keeps per-thread state in thread-local storage, which glibc may already have
    // destroyed when this runs at exit on the main thread: a fresh thread closes instead.
    corefs_fs fs = fs_;
    int rc = 0;
    std::thread closer([fs, &rc] { rc = corefs_close(fs); });
    closer.join();
    if (rc < 0) {
      std::fprintf(stderr, "corefs_rocksdb: corefs_close failed: %s\n", std::strerror(-rc));
    }
  }
  corefs_fs fs() const { return fs_; }
  // What a writable file may hold back: nothing through a server.
  size_t WriteBehindBytes() const { return remote_ ? 0 : kWriteBehindBytes; }

  // The writable files open on this mount, by inode, so that a read through another handle
  // first writes out what they hold back. Lock order: this registry, then a WriteBehind.
  void AddWriter(uint64_t ino, WriteBehind* w) {
    std::lock_guard<std::mutex> guard(writers_mu_);
    writers_.emplace(ino, w);
    writers_count_.fetch_add(1, std::memory_order_release);
  }
  void RemoveWriter(uint64_t ino, WriteBehind* w) {
    std::lock_guard<std::mutex> guard(writers_mu_);
    for (auto [it, end] = writers_.equal_range(ino); it != end; ++it) {
      if (it->second == w) {
        writers_.erase(it);
        writers_count_.fetch_sub(1, std::memory_order_release);
        return;
      }
    }
  }
  bool HasWriters() const { return writers_count_.load(std::memory_order_acquire) > 0; }
  // Writes out what the writers of inode `ino` hold back.
  IOStatus FlushWriterOf(uint64_t ino) {
    std::lock_guard<std::mutex> guard(writers_mu_);
    for (auto [it, end] = writers_.equal_range(ino); it != end; ++it) {
      IOStatus s = it->second->Flush();
      if (!s.ok()) return s;
    }
    return IOStatus::OK();
  }
  // Writes out what every writer holds back (before a size is asked by path).
  IOStatus FlushAllWriters() {
    std::lock_guard<std::mutex> guard(writers_mu_);
    for (auto& [ino, w] : writers_) {
      IOStatus s = w->Flush();
      if (!s.ok()) return s;
    }
    return IOStatus::OK();
  }

 private:
  const corefs_fs fs_;
  const bool remote_;
  std::mutex writers_mu_;
  std::multimap<uint64_t, WriteBehind*> writers_;
  std::atomic<size_t> writers_count_{0};
};

size_t Count(const std::string& text, const std::string& word) {
  size_t n = 0;
  for (size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) n++;
  return n;
}

std::mutex g_mounts_mutex;
std::map<std::string, std::weak_ptr<Mount>>& Mounts() {
  static auto* mounts = new std::map<std::string, std::weak_ptr<Mount>>();
  return *mounts;
}

IOStatus MountDevice(const std::string& device, const CorefsFsOptions& options,
                     std::shared_ptr<Mount>* out) {
  std::lock_guard<std::mutex> guard(g_mounts_mutex);
  auto& mounts = Mounts();
  auto it = mounts.find(device);
  if (it != mounts.end()) {
    if (auto mount = it->second.lock()) {
      *out = mount;
      return IOStatus::OK();
    }
  }
  struct corefs_options opts;
  std::memset(&opts, 0, sizeof opts);
  opts.shards = options.shards;
  opts.busy_poll = options.busy_poll ? 1 : 0;
  opts.format = options.format == Format::kAlways ? 1 : 0;
  opts.data_cache_off = options.data_cache ? 0 : 1;
  corefs_fs fs = corefs_mount(device.c_str(), &opts);
  if (fs < 0 && options.format == Format::kIfNew) {
    // Only a device that holds no corefs filesystem is formatted: the mount of one fails with
    // -EUCLEAN, both superblock copies lacking the magic. One bad copy, or any other error
    // (-EBUSY, -EIO), is reported as it is: formatting would destroy a damaged filesystem.
    std::string detail = corefs_last_error();
    if (fs == -EUCLEAN && Count(detail, "not a corefs filesystem") == 2) {
      opts.format = 1;
      fs = corefs_mount(device.c_str(), &opts);
    }
  }
  if (fs < 0) return Errno("corefs_mount " + device, fs);
  auto mount = std::make_shared<Mount>(fs, device.rfind("serve:", 0) == 0);
  mounts[device] = mount;
  *out = mount;
  return IOStatus::OK();
}

// ------------------------------------------------------------------------------------------
// Files.

// A handle released when the file object goes.
class Handle {
 public:
  Handle(std::shared_ptr<Mount> mount, corefs_fd fd, std::string path)
      : mount_(std::move(mount)), fd_(fd), path_(std::move(path)) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { Release(); }

  IOStatus Release() {
    if (fd_ <= 0) return IOStatus::OK();
    int rc = corefs_release(fs(), fd_);
    fd_ = 0;
    if (rc < 0) return Errno("close " + path_, rc);
    return IOStatus::OK();
  }

  // Reads up to `n` bytes at `offset`, stopping early only at end of file.
  IOStatus ReadAt(uint64_t offset, size_t n, char* scratch, size_t* got) const {
    IOStatus seen = SeeWriters();
    if (!seen.ok()) return seen;
    size_t done = 0;
    while (done < n) {
      size_t want = std::min(n - done, kMaxTransferBytes);
      int64_t rc = corefs_pread(fs(), fd_, reinterpret_cast<uint8_t*>(scratch + done), want,
                                offset + done);
      if (rc < 0) return Errno("read " + path_, rc);
      if (rc == 0) break;
      done += static_cast<size_t>(rc);
    }
    *got = done;
    return IOStatus::OK();
  }

  IOStatus WriteAt(uint64_t offset, const Slice& data) const {
    return WriteAll(fs(), fd_, path_, offset, data);
  }

  // Before a read through this handle: what a writable file of the same inode holds back
  // is written first (see the file's invariants).
  IOStatus SeeWriters() const {
    if (!mount_->HasWriters()) return IOStatus::OK();
    uint64_t ino = 0;
    IOStatus s = Ino(&ino);
    if (!s.ok()) return s;
    return mount_->FlushWriterOf(ino);
  }

  // The file's inode number (asked once).
  IOStatus Ino(uint64_t* ino) const {
    if (ino_ == 0) {
      struct corefs_stat st;
      int rc = corefs_fstat(fs(), fd_, &st);
      if (rc < 0) return Errno("fstat " + path_, rc);
      ino_ = st.ino;
    }
    *ino = ino_;
    return IOStatus::OK();
  }

  IOStatus Sync(bool data_only) const { return SyncFd(fs(), fd_, path_, data_only); }

  IOStatus Truncate(uint64_t size) const {
    int rc = corefs_ftruncate(fs(), fd_, size);
    if (rc < 0) return Errno("truncate " + path_, rc);
    return IOStatus::OK();
  }

  IOStatus Size(uint64_t* size) const {
    struct corefs_stat st;
    int rc = corefs_fstat(fs(), fd_, &st);
    if (rc < 0) return Errno("fstat " + path_, rc);
    *size = st.size;
    return IOStatus::OK();
  }

  // The inode number and the mount identify a file for as long as it lives.
  size_t UniqueId(char* id, size_t max_size) const {
    struct corefs_stat st;
    if (max_size < 2 * sizeof(uint64_t) || corefs_fstat(fs(), fd_, &st) < 0) return 0;
    uint64_t words[2] = {static_cast<uint64_t>(fs()), st.ino};
    std::memcpy(id, words, sizeof words);
    return sizeof words;
  }

  corefs_fs fs() const { return mount_->fs(); }
  corefs_fd fd() const { return fd_; }
  Mount& mount() const { return *mount_; }
  const std::string& path() const { return path_; }

 private:
  std::shared_ptr<Mount> mount_;
  corefs_fd fd_;
  std::string path_;
  mutable uint64_t ino_ = 0;
};

// The O_DIRECT contract for a direct read (see the file's invariants).
IOStatus CheckDirect(const Handle& h, uint64_t offset, size_t n, const char* scratch) {
  if (Aligned(offset) && Aligned(n) && Aligned(reinterpret_cast<uintptr_t>(scratch))) {
    return IOStatus::OK();
  }
  return IOStatus::InvalidArgument("direct read of " + h.path() + " not aligned to 4096: offset " +
                                   std::to_string(offset) + ", length " + std::to_string(n));
}

class SequentialFile : public rocksdb::FSSequentialFile {
 public:
  SequentialFile(std::unique_ptr<Handle> h, bool direct) : h_(std::move(h)), direct_(direct) {}

  IOStatus Read(size_t n, const IOOptions&, Slice* result, char* scratch,
                IODebugContext*) override {
    if (direct_) {
      IOStatus s = CheckDirect(*h_, offset_, n, scratch);
      if (!s.ok()) return s;
    }
    size_t got = 0;
    IOStatus s = h_->ReadAt(offset_, n, scratch, &got);
    if (!s.ok()) return s;
    offset_ += got;
    *result = Slice(scratch, got);
    return IOStatus::OK();
  }

  IOStatus PositionedRead(uint64_t offset, size_t n, const IOOptions&, Slice* result,
                          char* scratch, IODebugContext*) override {
    if (direct_) {
      IOStatus s = CheckDirect(*h_, offset, n, scratch);
      if (!s.ok()) return s;
    }
    size_t got = 0;
    IOStatus s = h_->ReadAt(offset, n, scratch, &got);
    if (!s.ok()) return s;
    *result = Slice(scratch, got);
    return IOStatus::OK();
  }

  IOStatus Skip(uint64_t n) override {
    offset_ += n;
    return IOStatus::OK();
  }

  bool use_direct_io() const override { return direct_; }
  size_t GetRequiredBufferAlignment() const override { return kAlignmentBytes; }

 private:
  std::unique_ptr<Handle> h_;
  const bool direct_;
  uint64_t offset_ = 0;
};

class RandomAccessFile : public rocksdb::FSRandomAccessFile {
 public:
  RandomAccessFile(std::unique_ptr<Handle> h, bool direct) : h_(std::move(h)), direct_(direct) {}

  IOStatus Read(uint64_t offset, size_t n, const IOOptions&, Slice* result, char* scratch,
                IODebugContext*) const override {
    if (direct_) {
      IOStatus s = CheckDirect(*h_, offset, n, scratch);
      if (!s.ok()) return s;
    }
    size_t got = 0;
    IOStatus s = h_->ReadAt(offset, n, scratch, &got);
    if (!s.ok()) return s;
    *result = Slice(scratch, got);
    return IOStatus::OK();
  }

  size_t GetUniqueId(char* id, size_t max_size) const override {
    return h_->UniqueId(id, max_size);
  }
  bool use_direct_io() const override { return direct_; }
  size_t GetRequiredBufferAlignment() const override { return kAlignmentBytes; }

 private:
  std::unique_ptr<Handle> h_;
  const bool direct_;
};

class WritableFile : public rocksdb::FSWritableFile {
 public:
  WritableFile(std::unique_ptr<Handle> h, uint64_t size_bytes, const FileOptions& options)
      : rocksdb::FSWritableFile(options),
        h_(std::move(h)),
        behind_(h_->fs(), h_->fd(), h_->path(), size_bytes, h_->mount().WriteBehindBytes()),
        direct_(options.use_direct_writes) {
    // Registered only with a known inode; without one (fstat failed) nothing is held back.
    registered_ = h_->Ino(&ino_).ok();
    if (registered_) h_->mount().AddWriter(ino_, &behind_);
  }
  ~WritableFile() override { Unregister(); }

  IOStatus Append(const Slice& data, const IOOptions&, IODebugContext*) override {
    if (!registered_) {
      uint64_t at = behind_.SizeBytes();
      return behind_.Then([&](uint64_t* size) {
        IOStatus s = h_->WriteAt(at, data);
        if (s.ok()) *size = at + data.size();
        return s;
      });
    }
    return behind_.Append(data);
  }
  IOStatus Append(const Slice& data, const IOOptions& options,
                  const rocksdb::DataVerificationInfo&, IODebugContext* dbg) override {
    return Append(data, options, dbg);
  }

  // Direct writes come here, aligned; corefs needs no alignment, so a write is a write.
  IOStatus PositionedAppend(const Slice& data, uint64_t offset, const IOOptions&,
                            IODebugContext*) override {
    return behind_.Then([&](uint64_t* size) {
      IOStatus s = h_->WriteAt(offset, data);
      if (s.ok()) *size = std::max<uint64_t>(*size, offset + data.size());
      return s;
    });
  }
  IOStatus PositionedAppend(const Slice& data, uint64_t offset, const IOOptions& options,
                            const rocksdb::DataVerificationInfo&, IODebugContext* dbg) override {
    return PositionedAppend(data, offset, options, dbg);
  }

  IOStatus Truncate(uint64_t size, const IOOptions&, IODebugContext*) override {
    return behind_.Then([&](uint64_t* size_bytes) {
      IOStatus s = h_->Truncate(size);
      if (s.ok()) *size_bytes = size;
      return s;
    });
  }

  IOStatus Close(const IOOptions&, IODebugContext*) override {
    IOStatus s = behind_.Flush();
    Unregister();
    IOStatus released = h_->Release();
    return s.ok() ? released : s;
  }
  // Held back on purpose (the file's invariants): RocksDB calls this after every WAL write.
  IOStatus Flush(const IOOptions&, IODebugContext*) override { return IOStatus::OK(); }
  IOStatus Sync(const IOOptions&, IODebugContext*) override { return behind_.Sync(true); }
  IOStatus Fsync(const IOOptions&, IODebugContext*) override { return behind_.Sync(false); }
  // corefs calls may come from any thread, and a sync covers what was written before it.
  bool IsSyncThreadSafe() const override { return true; }
  bool use_direct_io() const override { return direct_; }
  size_t GetRequiredBufferAlignment() const override { return kAlignmentBytes; }
  uint64_t GetFileSize(const IOOptions&, IODebugContext*) override { return behind_.SizeBytes(); }
  size_t GetUniqueId(char* id, size_t max_size) const override {
    return h_->UniqueId(id, max_size);
  }
  // corefs allocates at write time from the inode's shard; preallocation would only take
  // space a crash then leaks to the next mount's cleanup, so it is declined (as tmpfs does).
  IOStatus Allocate(uint64_t, uint64_t, const IOOptions&, IODebugContext*) override {
    return IOStatus::OK();
  }

 private:
  // Out of the registry, after writing what is held back (a file dropped without Close
  // still has its appends written, as a kernel file's writes reach its page cache).
  void Unregister() {
    if (!registered_) return;
    behind_.Flush().PermitUncheckedError();
    h_->mount().RemoveWriter(ino_, &behind_);
    registered_ = false;
  }

  std::unique_ptr<Handle> h_;
  WriteBehind behind_;
  const bool direct_;
  uint64_t ino_ = 0;
  bool registered_ = false;
};

class RandomRWFile : public rocksdb::FSRandomRWFile {
 public:
  RandomRWFile(std::unique_ptr<Handle> h, bool direct) : h_(std::move(h)), direct_(direct) {}
  IOStatus Write(uint64_t offset, const Slice& data, const IOOptions&, IODebugContext*) override {
    return h_->WriteAt(offset, data);
  }
  IOStatus Read(uint64_t offset, size_t n, const IOOptions&, Slice* result, char* scratch,
                IODebugContext*) const override {
    size_t got = 0;
    IOStatus s = h_->ReadAt(offset, n, scratch, &got);
    if (s.ok()) *result = Slice(scratch, got);
    return s;
  }
  IOStatus Flush(const IOOptions&, IODebugContext*) override { return IOStatus::OK(); }
  IOStatus Sync(const IOOptions&, IODebugContext*) override { return h_->Sync(true); }
  IOStatus Fsync(const IOOptions&, IODebugContext*) override { return h_->Sync(false); }
  IOStatus Close(const IOOptions&, IODebugContext*) override { return h_->Release(); }
  bool use_direct_io() const override { return direct_; }
  size_t GetRequiredBufferAlignment() const override { return kAlignmentBytes; }

 private:
  std::unique_ptr<Handle> h_;
  const bool direct_;
};

class Directory : public rocksdb::FSDirectory {
 public:
  explicit Directory(std::unique_ptr<Handle> h) : h_(std::move(h)) {}
  IOStatus Fsync(const IOOptions&, IODebugContext*) override { return h_->Sync(false); }
  IOStatus Close(const IOOptions&, IODebugContext*) override { return h_->Release(); }
  size_t GetUniqueId(char* id, size_t max_size) const override {
    return h_->UniqueId(id, max_size);
  }

 private:
  std::unique_ptr<Handle> h_;
};

// RocksDB's info LOG, kept in the corefs filesystem with the database (a default logger
// would write "/db/LOG" into the kernel filesystem's root). Lines are appended whole.
class Logger : public rocksdb::Logger {
 public:
  explicit Logger(std::unique_ptr<Handle> h) : h_(std::move(h)) {}
  ~Logger() override { h_->Release(); }
  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    char line[1024];
    struct timeval now;
    gettimeofday(&now, nullptr);
    struct tm t;
    localtime_r(&now.tv_sec, &t);
    int head = std::snprintf(line, sizeof line, "%04d/%02d/%02d-%02d:%02d:%02d.%06ld ",
                             t.tm_year + 1900, t.tm_mon + 1, t.tm_mday, t.tm_hour, t.tm_min,
                             t.tm_sec, static_cast<long>(now.tv_usec));
    if (head < 0) return;
    va_list copy;
    va_copy(copy, ap);
    int body = std::vsnprintf(line + head, sizeof line - head, format, copy);
    va_end(copy);
    if (body < 0) return;
    // A longer message is cut at the buffer: the log is for people, not for recovery.
    size_t len = std::min(sizeof line - 2, static_cast<size_t>(head) + static_cast<size_t>(body));
    if (line[len - 1] != '\n') line[len++] = '\n';
    std::lock_guard<std::mutex> guard(mutex_);
    // Best effort, as RocksDB's own loggers: a failed log line is not the database's failure.
    if (h_->WriteAt(offset_, Slice(line, len)).ok()) offset_ += len;
  }

 protected:
  rocksdb::Status CloseImpl() override { return h_->Release(); }

 private:
  std::unique_ptr<Handle> h_;
  std::mutex mutex_;
  uint64_t offset_ = 0;
};

// A held LOCK file: its handle stays open while the lock is held (the lock is a corefs
// byte-range lock on it, which goes at UnlockFile, or with the process).
class Lock : public rocksdb::FileLock {
 public:
  Lock(std::string path, std::unique_ptr<Handle> handle)
      : path(std::move(path)), handle(std::move(handle)) {}
  const std::string path;
  std::unique_ptr<Handle> handle;
};

// ------------------------------------------------------------------------------------------
// The FileSystem.

class CorefsFileSystem : public rocksdb::FileSystem {
 public:
  CorefsFileSystem(std::shared_ptr<Mount> mount, std::string device)
      : mount_(std::move(mount)), device_(std::move(device)) {}

  static const char* kClassName() { return "CorefsFileSystem"; }
  const char* Name() const override { return kClassName(); }
  const char* NickName() const override { return "corefs"; }

  IOStatus NewSequentialFile(const std::string& fname, const FileOptions& options,
                             std::unique_ptr<rocksdb::FSSequentialFile>* result,
                             IODebugContext*) override {
    return OpenAs(fname, COREFS_O_RDONLY, result,
                  [&](std::unique_ptr<Handle> h) {
                    return new SequentialFile(std::move(h), options.use_direct_reads);
                  });
  }

  IOStatus NewRandomAccessFile(const std::string& fname, const FileOptions& options,
                               std::unique_ptr<rocksdb::FSRandomAccessFile>* result,
                               IODebugContext*) override {
    return OpenAs(fname, COREFS_O_RDONLY, result,
                  [&](std::unique_ptr<Handle> h) {
                    return new RandomAccessFile(std::move(h), options.use_direct_reads);
                  });
  }

  IOStatus NewWritableFile(const std::string& fname, const FileOptions& options,
                           std::unique_ptr<rocksdb::FSWritableFile>* result,
                           IODebugContext*) override {
    return OpenAs(fname, COREFS_O_WRONLY | COREFS_O_CREAT | COREFS_O_TRUNC, result,
                  [&](std::unique_ptr<Handle> h) {
                    return new WritableFile(std::move(h), 0, options);
                  });
  }

  IOStatus ReopenWritableFile(const std::string& fname, const FileOptions& options,
                              std::unique_ptr<rocksdb::FSWritableFile>* result,
                              IODebugContext*) override {
    std::unique_ptr<Handle> h;
    IOStatus s = Open(fname, COREFS_O_WRONLY | COREFS_O_CREAT, &h);
    uint64_t size = 0;
    if (s.ok()) s = h->Size(&size);
    if (s.ok()) result->reset(new WritableFile(std::move(h), size, options));
    return s;
  }

  IOStatus NewRandomRWFile(const std::string& fname, const FileOptions& options,
                           std::unique_ptr<rocksdb::FSRandomRWFile>* result,
                           IODebugContext*) override {
    return OpenAs(fname, COREFS_O_RDWR | COREFS_O_CREAT, result,
                  [&](std::unique_ptr<Handle> h) {
                    return new RandomRWFile(std::move(h), options.use_direct_reads);
                  });
  }

  IOStatus NewDirectory(const std::string& name, const IOOptions&,
                        std::unique_ptr<rocksdb::FSDirectory>* result,
                        IODebugContext*) override {
    return OpenAs(name, COREFS_O_RDONLY | COREFS_O_DIRECTORY, result,
                  [&](std::unique_ptr<Handle> h) {
                    return new Directory(std::move(h));
                  });
  }

  IOStatus FileExists(const std::string& fname, const IOOptions&, IODebugContext*) override {
    struct corefs_stat st;
    int rc = corefs_stat(fs(), Normalise(fname).c_str(), &st);
    if (rc == -ENOENT || rc == -ENOTDIR) return IOStatus::NotFound(fname);
    if (rc < 0) return Errno("stat " + fname, rc);
    return IOStatus::OK();
  }

  IOStatus GetChildren(const std::string& dir, const IOOptions&, std::vector<std::string>* result,
                       IODebugContext*) override {
    result->clear();
    std::string path = Normalise(dir);
    std::vector<corefs_dirent> batch(64);
    uint64_t cookie = 0;
    for (;;) {
      int64_t n = corefs_readdir(fs(), path.c_str(), cookie, batch.data(), batch.size());
      if (n < 0) return Errno("readdir " + dir, n);
      if (n == 0) break;
      for (int64_t i = 0; i < n; i++) {
        result->emplace_back(reinterpret_cast<const char*>(batch[i].name), batch[i].name_len);
      }
      cookie = batch[n - 1].cookie;
    }
    return IOStatus::OK();
  }

  IOStatus DeleteFile(const std::string& fname, const IOOptions&, IODebugContext*) override {
    int rc = corefs_unlink(fs(), Normalise(fname).c_str());
    if (rc < 0) return Errno("unlink " + fname, rc);
    return IOStatus::OK();
  }

  IOStatus Truncate(const std::string& fname, size_t size, const IOOptions&,
                    IODebugContext*) override {
    // A writer's held-back appends land before the cut, not after it.
    IOStatus s = mount_->FlushAllWriters();
    if (!s.ok()) return s;
    std::unique_ptr<Handle> h;
    s = Open(fname, COREFS_O_WRONLY, &h);
    if (s.ok()) s = h->Truncate(size);
    if (s.ok()) s = h->Release();
    return s;
  }

  IOStatus CreateDir(const std::string& dirname, const IOOptions&, IODebugContext*) override {
    int rc = corefs_mkdir(fs(), Normalise(dirname).c_str(), kDirMode);
    if (rc < 0) return Errno("mkdir " + dirname, rc);
    return IOStatus::OK();
  }

  IOStatus CreateDirIfMissing(const std::string& dirname, const IOOptions& options,
                              IODebugContext* dbg) override {
    int rc = corefs_mkdir(fs(), Normalise(dirname).c_str(), kDirMode);
    if (rc == -EEXIST) {
      bool is_dir = false;
      IOStatus s = IsDirectory(dirname, options, &is_dir, dbg);
      if (!s.ok()) return s;
      if (!is_dir) return IOStatus::IOError("mkdir " + dirname + ": exists and is not a directory");
      return IOStatus::OK();
    }
    if (rc < 0) return Errno("mkdir " + dirname, rc);
    return IOStatus::OK();
  }

  IOStatus DeleteDir(const std::string& dirname, const IOOptions&, IODebugContext*) override {
    int rc = corefs_rmdir(fs(), Normalise(dirname).c_str());
    if (rc < 0) return Errno("rmdir " + dirname, rc);
    return IOStatus::OK();
  }

  IOStatus GetFileSize(const std::string& fname, const IOOptions&, uint64_t* size,
                       IODebugContext*) override {
    // A writable file's held-back appends count (the file's invariants).
    IOStatus s = mount_->FlushAllWriters();
    if (!s.ok()) return s;
    struct corefs_stat st;
    s = Stat(fname, &st);
    if (s.ok()) *size = st.size;
    return s;
  }

  IOStatus GetFileModificationTime(const std::string& fname, const IOOptions&, uint64_t* mtime,
                                   IODebugContext*) override {
    struct corefs_stat st;
    IOStatus s = Stat(fname, &st);
    if (s.ok()) *mtime = static_cast<uint64_t>(st.mtime_sec);
    return s;
  }

  IOStatus RenameFile(const std::string& src, const std::string& target, const IOOptions&,
                      IODebugContext*) override {
    int rc = corefs_rename(fs(), Normalise(src).c_str(), Normalise(target).c_str(), 0);
    if (rc < 0) return Errno("rename " + src + " to " + target, rc);
    return IOStatus::OK();
  }

  IOStatus LinkFile(const std::string& src, const std::string& target, const IOOptions&,
                    IODebugContext*) override {
    int rc = corefs_link(fs(), Normalise(src).c_str(), Normalise(target).c_str());
    if (rc < 0) return Errno("link " + src + " to " + target, rc);
    return IOStatus::OK();
  }

  IOStatus NumFileLinks(const std::string& fname, const IOOptions&, uint64_t* count,
                        IODebugContext*) override {
    struct corefs_stat st;
    IOStatus s = Stat(fname, &st);
    if (s.ok()) *count = st.nlink;
    return s;
  }

  IOStatus AreFilesSame(const std::string& first, const std::string& second, const IOOptions&,
                        bool* res, IODebugContext*) override {
    struct corefs_stat a, b;
    IOStatus s = Stat(first, &a);
    if (s.ok()) s = Stat(second, &b);
    if (s.ok()) *res = a.ino == b.ino;
    return s;
  }

  // As PosixFileSystem does with fcntl: a write lock on the whole LOCK file, so no other
  // process opens the database while this one has it (through a corefs server several
  // processes reach one filesystem; in process the lock is this mount's, which no other
  // process can reach anyway). The lock goes at UnlockFile, or with the process: a killed
  // client's locks go with its connection to the server. Two DB::Open of one directory in
  // this process are kept apart here (corefs locks, like fcntl's, are per process).
  IOStatus LockFile(const std::string& fname, const IOOptions&, rocksdb::FileLock** lock,
                    IODebugContext*) override {
    std::string path = Normalise(fname);
    {
      std::lock_guard<std::mutex> guard(locks_mutex_);
      if (!locks_.insert(path).second) {
        return IOStatus::IOError("lock " + fname + ": already held by this process");
      }
    }
    std::unique_ptr<Handle> h;
    IOStatus s = Open(fname, COREFS_O_RDWR | COREFS_O_CREAT, &h);
    if (s.ok()) {
      int rc = corefs_setlk(fs(), h->fd(), COREFS_LOCK_WRITE, 0, 0);
      if (rc == -EAGAIN) {
        s = IOStatus::IOError("lock " + fname +
                              ": held by another process (Resource temporarily unavailable)");
      } else if (rc < 0) {
        s = Errno("lock " + fname, rc);
      }
    }
    if (!s.ok()) {
      std::lock_guard<std::mutex> guard(locks_mutex_);
      locks_.erase(path);
      return s;
    }
    *lock = new Lock(path, std::move(h));
    return IOStatus::OK();
  }

  IOStatus UnlockFile(rocksdb::FileLock* lock, const IOOptions&, IODebugContext*) override {
    auto* ours = static_cast<Lock*>(lock);
    size_t erased;
    {
      std::lock_guard<std::mutex> guard(locks_mutex_);
      erased = locks_.erase(ours->path);
    }
    std::string path = ours->path;
    IOStatus s = IOStatus::OK();
    int rc = corefs_setlk(fs(), ours->handle->fd(), COREFS_LOCK_UNLOCK, 0, 0);
    if (rc < 0) s = Errno("unlock " + path, rc);
    IOStatus released = ours->handle->Release();
    if (s.ok()) s = released;
    delete ours;
    if (erased != 1) return IOStatus::IOError("unlock " + path + ": not locked");
    return s;
  }

  IOStatus GetTestDirectory(const IOOptions&, std::string* path, IODebugContext*) override {
    *path = "/rocksdbtest";
    int rc = corefs_mkdir(fs(), path->c_str(), kDirMode);
    if (rc < 0 && rc != -EEXIST) return Errno("mkdir " + *path, rc);
    return IOStatus::OK();
  }

  IOStatus NewLogger(const std::string& fname, const IOOptions&,
                     std::shared_ptr<rocksdb::Logger>* result, IODebugContext*) override {
    return OpenAs(fname, COREFS_O_WRONLY | COREFS_O_CREAT | COREFS_O_TRUNC, result,
                  [&](std::unique_ptr<Handle> h) {
                    return new Logger(std::move(h));
                  });
  }

  IOStatus GetAbsolutePath(const std::string& db_path, const IOOptions&, std::string* output,
                           IODebugContext*) override {
    *output = Normalise(db_path);
    return IOStatus::OK();
  }

  IOStatus GetFreeSpace(const std::string&, const IOOptions&, uint64_t* diskfree,
                        IODebugContext*) override {
    struct corefs_statfs st;
    int rc = corefs_statfs(fs(), &st);
    if (rc < 0) return Errno("statfs", rc);
    *diskfree = st.free_blocks * st.block_bytes;
    return IOStatus::OK();
  }

  IOStatus IsDirectory(const std::string& path, const IOOptions&, bool* is_dir,
                       IODebugContext*) override {
    struct corefs_stat st;
    IOStatus s = Stat(path, &st);
    if (s.ok()) *is_dir = S_ISDIR(st.mode);
    return s;
  }

 private:
  corefs_fs fs() const { return mount_->fs(); }

  // Opens `fname` with `flags` and, when that succeeds, gives RocksDB the object `make`
  // builds around the handle (each New*File differs only in its flags and its class).
  // `Ptr` is the unique_ptr or shared_ptr RocksDB passes.
  template <typename Ptr, typename Make>
  IOStatus OpenAs(const std::string& fname, int flags, Ptr* result, Make make) {
    std::unique_ptr<Handle> h;
    IOStatus s = Open(fname, flags, &h);
    if (s.ok()) result->reset(make(std::move(h)));
    return s;
  }

  IOStatus Open(const std::string& fname, int flags, std::unique_ptr<Handle>* out) {
    std::string path = Normalise(fname);
    corefs_fd fd = corefs_open(fs(), path.c_str(), flags, kFileMode);
    if (fd < 0) return Errno("open " + fname, fd);
    out->reset(new Handle(mount_, fd, path));
    return IOStatus::OK();
  }

  IOStatus Stat(const std::string& fname, struct corefs_stat* st) {
    int rc = corefs_stat(fs(), Normalise(fname).c_str(), st);
    if (rc < 0) return Errno("stat " + fname, rc);
    return IOStatus::OK();
  }

  std::shared_ptr<Mount> mount_;
  const std::string device_;
  std::mutex locks_mutex_;
  std::set<std::string> locks_;
};

constexpr const char* kScheme = "corefs://";

// Registered at load time, so that a program linking this file can name corefs:// at once.
const int g_registered =
    RegisterCorefsFileSystem(*rocksdb::ObjectLibrary::Default(), "");

}  // namespace

rocksdb::Status ParseCorefsUri(const std::string& uri, std::string* device,
                               CorefsFsOptions* options) {
  const std::string scheme = kScheme;
  if (uri.compare(0, scheme.size(), scheme) != 0) {
    return rocksdb::Status::InvalidArgument("not a corefs:// URI: " + uri);
  }
  std::string rest = uri.substr(scheme.size());
  std::string query;
  size_t q = rest.find('?');
  if (q != std::string::npos) {
    query = rest.substr(q + 1);
    rest.resize(q);
  }
  if (rest.empty()) return rocksdb::Status::InvalidArgument("no device in " + uri);
  CorefsFsOptions parsed;
  size_t start = 0;
  while (start < query.size()) {
    size_t end = query.find('&', start);
    if (end == std::string::npos) end = query.size();
    std::string item = query.substr(start, end - start);
    start = end + 1;
    if (item.empty()) continue;
    size_t eq = item.find('=');
    std::string key = item.substr(0, eq);
    std::string value = eq == std::string::npos ? "" : item.substr(eq + 1);
    if (key == "format" && value == "new") {
      parsed.format = Format::kIfNew;
    } else if (key == "format" && value == "always") {
      parsed.format = Format::kAlways;
    } else if (key == "format" && value == "never") {
      parsed.format = Format::kNever;
    } else if (key == "shards") {
      char* endp = nullptr;
      errno = 0;
      unsigned long n = std::strtoul(value.c_str(), &endp, 10);
      if (value.empty() || *endp != 0 || errno != 0 || n < 1 || n > 65536) {
        return rocksdb::Status::InvalidArgument("shards must be 1 to 65536 in " + uri);
      }
      parsed.shards = static_cast<uint32_t>(n);
    } else if (key == "busy_poll" && (value == "0" || value == "1")) {
      parsed.busy_poll = value == "1";
    } else if (key == "data_cache" && (value == "0" || value == "1")) {
      parsed.data_cache = value == "1";
    } else {
      return rocksdb::Status::InvalidArgument(
          "unknown option '" + item + "' in " + uri +
          " (format=new|always|never, shards=N, busy_poll=0|1, data_cache=0|1)");
    }
  }
  *device = rest;
  *options = parsed;
  return rocksdb::Status::OK();
}

std::string CorefsUri(const std::string& device, const std::string& query) {
  return "id={" + std::string(kScheme) + device + (query.empty() ? "" : "?" + query) + "}";
}

rocksdb::IOStatus NewCorefsFileSystem(const std::string& device, const CorefsFsOptions& options,
                                      std::shared_ptr<rocksdb::FileSystem>* result) {
  std::shared_ptr<Mount> mount;
  IOStatus s = MountDevice(device, options, &mount);
  if (!s.ok()) return s;
  result->reset(new CorefsFileSystem(std::move(mount), device));
  return IOStatus::OK();
}

int RegisterCorefsFileSystem(rocksdb::ObjectLibrary& library, const std::string&) {
  library.AddFactory<rocksdb::FileSystem>(
      rocksdb::ObjectLibrary::PatternEntry("corefs", false).AddSeparator("://", false),
      [](const std::string& uri, std::unique_ptr<rocksdb::FileSystem>* guard,
         std::string* errmsg) -> rocksdb::FileSystem* {
        std::string device;
        CorefsFsOptions options;
        rocksdb::Status parsed = ParseCorefsUri(uri, &device, &options);
        if (!parsed.ok()) {
          *errmsg = parsed.ToString();
          return nullptr;
        }
        std::shared_ptr<Mount> mount;
        IOStatus s = MountDevice(device, options, &mount);
        if (!s.ok()) {
          *errmsg = s.ToString();
          return nullptr;
        }
        guard->reset(new CorefsFileSystem(std::move(mount), device));
        return guard->get();
      });
  return 1;
}

}  // namespace corefs_rocksdb
