// corefs_rocksdb.h - a RocksDB FileSystem (rocksdb 7.8's include/rocksdb/file_system.h) that
// keeps a database's files in a corefs filesystem through libcorefs's C ABI (corefs.h).
//
// Selecting it:
//   * by URI, through RocksDB's ObjectRegistry (the factory is registered with
//     ObjectLibrary::Default() when this file's object is linked in):
//       corefs://DEVICE[?OPTION&OPTION...]
//     DEVICE is corefs's device string (file:/var/tmp/x.img,size=4GiB, nvme:/dev/ng0n1,
//     mem:1GiB; docs/usage.md "Devices"). OPTIONs: format=new (format when the device holds no
//     corefs filesystem yet), format=always (format at every mount: destroys the content),
//     shards=N (shards when formatting), busy_poll=1. Because RocksDB's option parser splits
//     a plain "a,b=c" string into options, a device string holding '=' is passed to
//     FileSystem::CreateFromString / Env::CreateFromUri wrapped as "id={corefs://...}"
//     (CorefsUri() below does it); ObjectRegistry::NewSharedObject takes it bare.
//   * by constructing it: NewCorefsFileSystem(device, options, &fs), then
//     options.env = NewCompositeEnv(fs) (the Env keeps the default threads and clock).
//
// Paths are corefs paths from the root of the filesystem ("/db/000001.log"). One mount per
// device is shared by every FileSystem object of the process that names the same device
// string (corefs holds a device exclusively, so a second mount would fail with -EBUSY); it is
// closed (everything committed) when the last of them goes.
#ifndef COREFS_ROCKSDB_H
#define COREFS_ROCKSDB_H

#include <rocksdb/file_system.h>
#include <rocksdb/utilities/object_registry.h>

#include <cstdint>
#include <memory>
#include <string>

namespace corefs_rocksdb {

enum class Format {
  kNever,   // mount what is there; fail if the device holds no corefs filesystem
  kIfNew,   // format when the mount finds no corefs filesystem
  kAlways,  // format at mount (destroys the device's content)
};

struct CorefsFsOptions {
  Format format = Format::kNever;
  // Shards when formatting (0: corefs's default, 64). A file's blocks all come from its
  // inode's shard, 1/shards of the device: RocksDB's 64 MiB files need few shards on small
  // images.
  uint32_t shards = 0;
  bool busy_poll = false;
  // False: corefs keeps no data-block cache (corefs_options.data_cache_off), so reads of
  // data go to the device as O_DIRECT reads do on a kernel filesystem: for a database
  // whose own block cache makes a second one waste, and for fair read benchmarks.
  bool data_cache = true;
};

// Mounts `device` (or shares this process's mount of it) and returns a FileSystem on it.
rocksdb::IOStatus NewCorefsFileSystem(const std::string& device, const CorefsFsOptions& options,
                                      std::shared_ptr<rocksdb::FileSystem>* result);

// Parses "corefs://DEVICE[?OPTIONS]" into the device string and options.
rocksdb::Status ParseCorefsUri(const std::string& uri, std::string* device,
                               CorefsFsOptions* options);

// "corefs://DEVICE[?QUERY]" wrapped so that FileSystem::CreateFromString and
// Env::CreateFromUri pass it whole to the factory: "id={corefs://...}".
std::string CorefsUri(const std::string& device, const std::string& query = "");

// Adds the corefs:// factory to `library` (ObjectLibrary::Default() gets it at load time).
// Has the signature of a RocksDB RegistrarFunc; returns the number of factories added.
int RegisterCorefsFileSystem(rocksdb::ObjectLibrary& library, const std::string& arg);

}  // namespace corefs_rocksdb

#endif  // COREFS_ROCKSDB_H
