/* Exercises the whole corefs C ABI, including every error case the header promises: run by
 * bindings/tests/c_api.rs (argv[1]: a directory for the file image). Prints what it checks;
 * exits non-zero at the first failure. */
#include "corefs.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int checks = 0;

#define CHECK(cond, ...)                                                                      \
  do {                                                                                        \
    checks++;                                                                                 \
    if (!(cond)) {                                                                            \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                         \
      fprintf(stderr, __VA_ARGS__);                                                           \
      fprintf(stderr, " (last error: %s)\n", corefs_last_error());                            \
      exit(1);                                                                                \
    }                                                                                         \
  } while (0)

#define OK(expr) CHECK((expr) >= 0, "%s returned %lld", #expr, (long long)(expr))
#define ERR(expr, e)                                                                          \
  do {                                                                                        \
    long long r_ = (long long)(expr);                                                         \
    CHECK(r_ == -(e), "%s returned %lld, expected -%s", #expr, r_, #e);                       \
    CHECK(strlen(corefs_last_error()) > 0, "no message for %s", #expr);                       \
  } while (0)

static void fill(uint8_t *buf, size_t len, unsigned seed) {
  for (size_t i = 0; i < len; i++) buf[i] = (uint8_t)(i * 31 + seed);
}

/* The whole API on a fresh image served by `reactors` reactors; the remounts use one. */
static void api(const char *device, int reactors) {
  struct corefs_options bad = {0};
  bad.format = 1;
  bad.shards = 1000;
  ERR(corefs_mount(device, &bad), EINVAL);

  struct corefs_options opts = {0};
  opts.format = 1;
  opts.shards = 4;
  opts.label = "capi";
  opts.reactors = (uint8_t)reactors;
  corefs_fs fs = corefs_mount(device, &opts);
  OK(fs);

  /* Handles are checked. */
  ERR(corefs_open(fs + 1000, "a", COREFS_O_CREAT | COREFS_O_RDWR, 0644), EBADF);
  ERR(corefs_open(fs, NULL, 0, 0), EFAULT);
  ERR(corefs_open(fs, "missing", COREFS_O_RDONLY, 0), ENOENT);
  ERR(corefs_open(fs, "a", 0x40000000, 0), EINVAL);

  /* Files: create, write, read back, stat. */
  corefs_fd fd = corefs_open(fs, "/a", COREFS_O_CREAT | COREFS_O_RDWR, 0644);
  OK(fd);
  ERR(corefs_open(fs, "a", COREFS_O_CREAT | COREFS_O_EXCL | COREFS_O_RDWR, 0644), EEXIST);
  uint8_t data[10000], back[10000];
  fill(data, sizeof data, 7);
  CHECK(corefs_pwrite(fs, fd, data, sizeof data, 0) == (int64_t)sizeof data, "pwrite");
  CHECK(corefs_pwrite(fs, fd, data, 100, 20000) == 100, "pwrite past the end");
  memset(back, 0, sizeof back);
  CHECK(corefs_pread(fs, fd, back, sizeof back, 0) == (int64_t)sizeof back, "pread");
  CHECK(memcmp(back, data, sizeof data) == 0, "read back differs");
  CHECK(corefs_pread(fs, fd, back, 100, 20050) == 50, "short read at the end");
  CHECK(corefs_pread(fs, fd, back, 100, 30000) == 0, "read past the end");
  /* Positions past INT64_MAX (offset + len) are -EINVAL, as for pread(2) and pwrite(2). */
  ERR(corefs_pread(fs, fd, back, 16, INT64_MAX), EINVAL);
  ERR(corefs_pread(fs, fd, back, 16, UINT64_MAX), EINVAL);
  ERR(corefs_pwrite(fs, fd, data, 2, INT64_MAX - 1), EINVAL);
  ERR(corefs_submit_pread(fs, fd, back, SIZE_MAX, 1, 1), EINVAL);
  ERR(corefs_submit_pwrite(fs, fd, data, 16, UINT64_MAX - 8, 1), EINVAL);
  ERR(corefs_pread(fs, fd, NULL, 10, 0), EFAULT);
  ERR(corefs_pwrite(fs, fd, NULL, 10, 0), EFAULT);
  CHECK(corefs_pwrite(fs, fd, NULL, 0, 0) == 0, "empty write with NULL");
  ERR(corefs_pread(fs, fd + 999, back, 10, 0), EBADF);
  struct corefs_stat st;
  OK(corefs_fstat(fs, fd, &st));
  CHECK(st.size == 20100, "size %llu", (unsigned long long)st.size);
  CHECK((st.mode & 0170000) == 0100000 && (st.mode & 0777) == 0644, "mode %o", st.mode);
  ERR(corefs_fstat(fs, fd, NULL), EFAULT);
  OK(corefs_fsync(fs, fd));
  OK(corefs_fdatasync(fs, fd));
  OK(corefs_ftruncate(fs, fd, 5000));
  OK(corefs_fstat(fs, fd, &st));
  CHECK(st.size == 5000, "truncated size %llu", (unsigned long long)st.size);
  OK(corefs_fallocate(fs, fd, COREFS_FALLOC_KEEP_SIZE, 0, 65536));
  OK(corefs_fallocate(fs, fd, COREFS_FALLOC_PUNCH_HOLE | COREFS_FALLOC_KEEP_SIZE, 0, 4096));
  CHECK(corefs_pread(fs, fd, back, 4096, 0) == 4096, "read punched");
  for (int i = 0; i < 4096; i++) CHECK(back[i] == 0, "punched byte %d is %d", i, back[i]);
  ERR(corefs_fallocate(fs, fd, 0x100, 0, 10), EOPNOTSUPP); /* an unknown mode, as fallocate(2) */
  OK(corefs_chmod(fs, "a", 0600));
  OK(corefs_stat(fs, "a", &st));
  CHECK((st.mode & 0777) == 0600, "chmod %o", st.mode);

  /* A read-only handle refuses writes; a directory handle refuses file I/O. */
  corefs_fd ro = corefs_open(fs, "a", COREFS_O_RDONLY, 0);
  OK(ro);
  ERR(corefs_pwrite(fs, ro, data, 10, 0), EBADF);
  ERR(corefs_ftruncate(fs, ro, 0), EBADF);
  OK(corefs_release(fs, ro));
  ERR(corefs_release(fs, ro), EBADF);
  ERR(corefs_pread(fs, ro, back, 10, 0), EBADF);

  /* Directories, names, links, symlinks. */
  OK(corefs_mkdir(fs, "d", 0755));
  ERR(corefs_mkdir(fs, "d", 0755), EEXIST);
  ERR(corefs_mkdir(fs, "nosuch/d", 0755), ENOENT);
  corefs_fd dfd = corefs_open(fs, "d", COREFS_O_RDONLY | COREFS_O_DIRECTORY, 0);
  OK(dfd);
  ERR(corefs_pread(fs, dfd, back, 10, 0), EISDIR);
  ERR(corefs_open(fs, "d", COREFS_O_RDWR, 0), EISDIR);
  ERR(corefs_open(fs, "a", COREFS_O_RDONLY | COREFS_O_DIRECTORY, 0), ENOTDIR);
  OK(corefs_rename(fs, "a", "d/b", 0));
  ERR(corefs_stat(fs, "a", &st), ENOENT);
  OK(corefs_link(fs, "d/b", "c"));
  OK(corefs_stat(fs, "c", &st));
  CHECK(st.nlink == 2, "nlink %u", st.nlink);
  ERR(corefs_rename(fs, "c", "d/b", COREFS_RENAME_NOREPLACE), EEXIST);
  ERR(corefs_rename(fs, "c", "d/b", 0x80), EINVAL);
  OK(corefs_symlink(fs, "d/b", "s"));
  char target[64];
  CHECK(corefs_readlink(fs, "s", (uint8_t *)target, sizeof target) == 3, "readlink length");
  CHECK(memcmp(target, "d/b", 3) == 0, "readlink target");
  ERR(corefs_rmdir(fs, "d"), ENOTEMPTY);
  OK(corefs_fsync(fs, dfd));
  struct corefs_dirent entries[8];
  int64_t n = corefs_readdir(fs, "/", 0, entries, 8);
  CHECK(n == 3, "root has %lld entries", (long long)n);
  int seen = 0;
  for (int i = 0; i < n; i++) {
    if (strcmp((char *)entries[i].name, "d") == 0 || strcmp((char *)entries[i].name, "c") == 0 ||
        strcmp((char *)entries[i].name, "s") == 0)
      seen++;
  }
  CHECK(seen == 3, "root entries");
  CHECK(corefs_readdir(fs, "/", entries[n - 1].cookie, entries, 8) == 0, "readdir continues");
  ERR(corefs_readdir(fs, "/", 0, NULL, 8), EFAULT);

  /* Extended attributes. */
  OK(corefs_setxattr(fs, "c", "user.k", (const uint8_t *)"value", 5, 0));
  ERR(corefs_setxattr(fs, "c", "user.k", (const uint8_t *)"v", 1, COREFS_XATTR_CREATE), EEXIST);
  ERR(corefs_setxattr(fs, "c", "user.k", (const uint8_t *)"v", 1, 3), EINVAL);
  CHECK(corefs_getxattr(fs, "c", "user.k", NULL, 0) == 5, "xattr size");
  char value[16] = {0};
  CHECK(corefs_getxattr(fs, "c", "user.k", (uint8_t *)value, sizeof value) == 5, "getxattr");
  CHECK(strcmp(value, "value") == 0, "xattr value %s", value);
  char names[64];
  CHECK(corefs_listxattr(fs, "c", (uint8_t *)names, sizeof names) == 7, "listxattr");
  OK(corefs_removexattr(fs, "c", "user.k"));
  ERR(corefs_getxattr(fs, "c", "user.k", NULL, 0), ENODATA);

  /* getxattr and listxattr: a buffer too small is -ERANGE, as for the system calls. */
  OK(corefs_setxattr(fs, "c", "user.k", (const uint8_t *)"value", 5, 0));
  ERR(corefs_getxattr(fs, "c", "user.k", (uint8_t *)value, 2), ERANGE);
  ERR(corefs_listxattr(fs, "c", (uint8_t *)names, 3), ERANGE);
  OK(corefs_removexattr(fs, "c", "user.k"));

  /* Owners: the process's effective ids, a thread's own (corefs_set_owner), then back. */
  OK(corefs_mkdir(fs, "o", 0755));
  OK(corefs_stat(fs, "o", &st));
  CHECK(st.uid == geteuid() && st.gid == getegid(), "owner %u:%u", st.uid, st.gid);
  OK(corefs_set_owner(fs, 1234, 5678));
  OK(corefs_symlink(fs, "t", "o/s"));
  OK(corefs_stat(fs, "o/s", &st));
  CHECK(st.uid == 1234 && st.gid == 5678, "thread owner %u:%u", st.uid, st.gid);
  OK(corefs_set_owner(fs, COREFS_OWNER_DEFAULT, COREFS_OWNER_DEFAULT));
  ERR(corefs_set_owner(fs + 1000, 1, 1), EBADF);

  /* Paths: a trailing slash needs a directory; `.` and `..` resolve; names are bytes. */
  ERR(corefs_open(fs, "c/", COREFS_O_RDONLY, 0), ENOTDIR);
  ERR(corefs_unlink(fs, "c/"), ENOTDIR);
  ERR(corefs_stat(fs, "c/.", &st), ENOTDIR);
  OK(corefs_stat(fs, "./d/../o/./s", &st));
  CHECK(st.uid == 1234, "o/s through dots");
  ERR(corefs_stat(fs, "", &st), ENOENT);
  OK(corefs_mkdir(fs, "o/\xff\xfe", 0700));
  OK(corefs_stat(fs, "o/\xff\xfe/..", &st));
  CHECK((st.mode & 0170000) == 0040000, "o/\\xff\\xfe/.. is a directory");
  OK(corefs_rmdir(fs, "o/\xff\xfe/"));

  /* Special files: stored with their type and device number. */
  OK(corefs_mkfifo(fs, "o/fifo", 0600));
  OK(corefs_stat(fs, "o/fifo", &st));
  CHECK((st.mode & 0170000) == 0010000, "fifo mode %o", st.mode);
  OK(corefs_mknod(fs, "o/null", 0020000 | 0666, 0x103));
  OK(corefs_stat(fs, "o/null", &st));
  CHECK((st.mode & 0170000) == 0020000 && st.rdev == 0x103, "chr %o %x", st.mode, st.rdev);
  ERR(corefs_mknod(fs, "o/dir", 0040000 | 0755, 0), EPERM);

  /* An unlinked file lives on through its handle, with nlink 0, and goes at the release. */
  struct corefs_statfs sfs;
  OK(corefs_statfs(fs, &sfs));
  uint64_t inodes = sfs.inodes_used;
  CHECK(sfs.block_bytes == 4096 && sfs.name_max_bytes == 255 && inodes > 5, "statfs");
  ERR(corefs_statfs(fs, NULL), EFAULT);
  corefs_fd ufd = corefs_open(fs, "o/tmp", COREFS_O_CREAT | COREFS_O_RDWR, 0600);
  OK(ufd);
  CHECK(corefs_pwrite(fs, ufd, data, 5000, 0) == 5000, "pwrite before the unlink");
  OK(corefs_unlink(fs, "o/tmp"));
  ERR(corefs_stat(fs, "o/tmp", &st), ENOENT);
  OK(corefs_fstat(fs, ufd, &st));
  CHECK(st.nlink == 0 && st.size == 5000, "unlinked: nlink %u size %llu", st.nlink,
        (unsigned long long)st.size);
  CHECK(corefs_pread(fs, ufd, back, 5000, 0) == 5000 && memcmp(back, data, 5000) == 0,
        "read after the unlink");
  OK(corefs_statfs(fs, &sfs));
  CHECK(sfs.inodes_used == inodes + 1, "the open orphan counts");
  OK(corefs_release(fs, ufd));
  OK(corefs_statfs(fs, &sfs));
  CHECK(sfs.inodes_used == inodes, "the release deleted it");

  /* O_APPEND writes go at the end, whatever the offset; a read-only handle changes nothing. */
  corefs_fd lfd = corefs_open(fs, "o/log", COREFS_O_CREAT | COREFS_O_WRONLY | COREFS_O_APPEND,
                              0600);
  OK(lfd);
  CHECK(corefs_pwrite(fs, lfd, (const uint8_t *)"one,", 4, 0) == 4, "append");
  CHECK(corefs_pwrite(fs, lfd, (const uint8_t *)"two", 3, 0) == 3, "append");
  OK(corefs_release(fs, lfd));
  lfd = corefs_open(fs, "o/log", COREFS_O_RDONLY, 0);
  OK(lfd);
  CHECK(corefs_pread(fs, lfd, back, 16, 0) == 7 && memcmp(back, "one,two", 7) == 0, "log");
  ERR(corefs_fallocate(fs, lfd, 0, 0, 4096), EBADF);
  OK(corefs_release(fs, lfd));

  /* Asynchronous I/O: 64 writes and an fsync in flight, then reads back. */
  corefs_fd afd = corefs_open(fs, "async", COREFS_O_CREAT | COREFS_O_RDWR, 0644);
  OK(afd);
  uint8_t *bufs[64];
  for (int i = 0; i < 64; i++) {
    bufs[i] = corefs_buf_alloc(4096);
    CHECK(bufs[i] != NULL && ((uintptr_t)bufs[i] % 4096) == 0, "aligned buffer");
    fill(bufs[i], 4096, (unsigned)i);
    OK(corefs_submit_pwrite(fs, afd, bufs[i], 4096, (uint64_t)i * 4096, (uint64_t)i));
  }
  OK(corefs_submit_fsync(fs, afd, 0, 1000));
  ERR(corefs_submit_pwrite(fs, afd + 77, bufs[0], 4096, 0, 1), EBADF);
  ERR(corefs_poll(fs, NULL, 4, 0), EFAULT);
  struct corefs_completion done[16];
  int got = 0, fsynced = 0;
  while (got < 65) {
    int64_t k = corefs_poll(fs, done, 16, 1000000);
    OK(k);
    for (int i = 0; i < k; i++, got++) {
      if (done[i].token == 1000) {
        CHECK(done[i].result == 0, "async fsync %lld", (long long)done[i].result);
        CHECK(got == 64, "the fsync completed before a write submitted earlier");
        fsynced = 1;
      } else {
        CHECK(done[i].result == 4096, "async write %llu: %lld",
              (unsigned long long)done[i].token, (long long)done[i].result);
      }
    }
  }
  CHECK(fsynced, "fsync completion");
  for (int i = 0; i < 64; i++) {
    memset(bufs[i], 0, 4096);
    OK(corefs_submit_pread(fs, afd, bufs[i], 4096, (uint64_t)i * 4096, 5000 + (uint64_t)i));
  }
  got = 0;
  while (got < 64) {
    int64_t k = corefs_poll(fs, done, 16, 1000000);
    OK(k);
    for (int i = 0; i < k; i++) CHECK(done[i].result == 4096, "async read");
    got += (int)k;
  }
  uint8_t expect[4096];
  for (int i = 0; i < 64; i++) {
    fill(expect, 4096, (unsigned)i);
    CHECK(memcmp(bufs[i], expect, 4096) == 0, "async read %d differs", i);
    corefs_buf_free(bufs[i], 4096);
  }
  CHECK(corefs_buf_alloc(0) == NULL, "zero-length buffer");
  corefs_buf_free(NULL, 0);

  /* Statistics, sync, unlink. */
  struct corefs_stats stats;
  OK(corefs_get_stats(fs, &stats));
  CHECK(stats.fsyncs == 4 && stats.log_writes >= 1 && stats.ops > 50, "stats %llu %llu %llu",
        (unsigned long long)stats.fsyncs, (unsigned long long)stats.log_writes,
        (unsigned long long)stats.ops);
  ERR(corefs_get_stats(fs, NULL), EFAULT);
  OK(corefs_unlink(fs, "s"));
  ERR(corefs_unlink(fs, "s"), ENOENT);
  OK(corefs_sync(fs));
  OK(corefs_release(fs, fd));
  OK(corefs_release(fs, dfd));
  OK(corefs_release(fs, afd));

  /* Close; the handles die with it; a remount finds everything. */
  OK(corefs_close(fs));
  ERR(corefs_close(fs), EBADF);
  ERR(corefs_stat(fs, "c", &st), EBADF);
  ERR(corefs_pread(fs, fd, back, 10, 0), EBADF);
  fs = corefs_mount(device, NULL);
  OK(fs);
  OK(corefs_stat(fs, "d/b", &st));
  CHECK(st.size == 5000 && st.nlink == 2, "after remount: size %llu nlink %u",
        (unsigned long long)st.size, st.nlink);
  fd = corefs_open(fs, "c", COREFS_O_RDONLY, 0);
  OK(fd);
  CHECK(corefs_pread(fs, fd, back, 1000, 4096) == 904, "read after remount (5000-byte file)");
  CHECK(memcmp(back, data + 4096, 904) == 0, "data after remount");
  OK(corefs_close(fs));

  /* corefs_mkfs formats and closes. */
  OK(corefs_mkfs(device, NULL));
  fs = corefs_mount(device, NULL);
  OK(fs);
  ERR(corefs_stat(fs, "c", &st), ENOENT);
  OK(corefs_close(fs));

}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: api_test DIR\n");
    return 2;
  }
  char device[4096];

  /* Bad arguments to mount: no crash, a clear error. */
  ERR(corefs_mount(NULL, NULL), EFAULT);
  CHECK(corefs_mount("nosuch:/x", NULL) < 0, "a bad device string mounts");
  CHECK(strstr(corefs_last_error(), "nosuch") != NULL, "message names the device: %s",
        corefs_last_error());
  /* More reactors than shards: a clear error. */
  snprintf(device, sizeof device, "file:%s/api-many.img,size=64MiB", argv[1]);
  struct corefs_options many = {0};
  many.format = 1;
  many.shards = 2;
  many.reactors = 3;
  ERR(corefs_mount(device, &many), EINVAL);
  CHECK(strstr(corefs_last_error(), "reactors") != NULL, "message: %s", corefs_last_error());
  /* A core the process may not run on: a clear error naming it (it used to abort). */
  struct corefs_options pinned = {0};
  pinned.format = 1;
  pinned.pin = 1;
  pinned.core = 5000;
  ERR(corefs_mount(device, &pinned), EINVAL);
  CHECK(strstr(corefs_last_error(), "core 5000") != NULL && strstr(corefs_last_error(), "allowed"),
        "message: %s", corefs_last_error());

  /* Device-string options out of range: a clear error naming the option, never a crash
   * (the first once wrapped buf * bufs and the process died of SIGSEGV). */
  ERR(corefs_mount("mem:64MiB,buf=9223372036854779904,bufs=2", NULL), EINVAL);
  CHECK(strstr(corefs_last_error(), "buf=") != NULL, "message: %s", corefs_last_error());
  ERR(corefs_mount("mem:64MiB,bufs=20000", NULL), EINVAL);
  CHECK(strstr(corefs_last_error(), "bufs=") != NULL, "message: %s", corefs_last_error());

  /* The library as shipped has no test machinery: the simulated volatile cache is a clear
   * error naming the build feature it needs, never silently a device without one (a crash
   * test would then cut the power behind a cache that is not there). */
  ERR(corefs_mkfs("mem:64MiB,cache=volatile", NULL), EINVAL);
  CHECK(strstr(corefs_last_error(), "cache=volatile needs a build with the `sim` feature"),
        "message: %s", corefs_last_error());
  ERR(corefs_mount("mem:64MiB,flushdelay=2000", NULL), EINVAL);
  CHECK(strstr(corefs_last_error(), "flushdelay=2000") && strstr(corefs_last_error(), "`sim`"),
        "message: %s", corefs_last_error());

  /* One writer per image: a second mount (or mkfs) of a mounted image fails with EBUSY
   * naming the holder, this process; once the first is closed it mounts again. */
  snprintf(device, sizeof device, "file:%s/api-twice.img,size=64MiB", argv[1]);
  struct corefs_options format = {0};
  format.format = 1;
  format.shards = 2;
  corefs_fs first = corefs_mount(device, &format);
  OK(first);
  ERR(corefs_mount(device, NULL), EBUSY);
  char pid[32];
  snprintf(pid, sizeof pid, "pid %d", (int)getpid());
  CHECK(strstr(corefs_last_error(), pid) != NULL, "message names %s: %s", pid,
        corefs_last_error());
  ERR(corefs_mkfs(device, NULL), EBUSY);
  OK(corefs_close(first));
  corefs_fs again = corefs_mount(device, NULL);
  OK(again);
  OK(corefs_close(again));

  for (int reactors = 1; reactors <= 2; reactors++) {
    snprintf(device, sizeof device, "file:%s/api-%d.img,size=64MiB", argv[1], reactors);
    api(device, reactors);
  }
  printf("api_test: %d checks passed\n", checks);
  return 0;
}
