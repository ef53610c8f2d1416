/* corefs_vfs.c - a SQLite VFS named "corefs" on top of the corefs C ABI (corefs.h).
 *
 * Built as a loadable extension (the default):
 *   gcc -O2 -fPIC -shared corefs_vfs.c -I bindings/include -L target/release -lcorefs \
 *       -lpthread -o libcorefs_sqlite.so
 *   sqlite3 -cmd ".load ./libcorefs_sqlite" -cmd ".open file:/x.db?vfs=corefs" :memory:
 * (the shell opens a database named on its command line before running -cmd, when the VFS
 * is not registered yet, so it starts on :memory: and .opens the database after the .load)
 * or compiled into a program with -DCOREFS_VFS_STATIC, which then calls
 * corefs_vfs_register().
 *
 * Configuration (read at the first xOpen/xAccess/xDelete, which mounts the filesystem):
 *   COREFS_DEVICE  the corefs device string (file:/var/tmp/x.img,size=256MiB, mem:256MiB, ...)
 *   COREFS_FORMAT  "1": format the device at mount (destroys its content)
 *   COREFS_BUSY_POLL  1: the reactor busy-polls instead of spinning then parking.
 *   COREFS_BATCH_ATOMIC  "0": do not advertise SQLITE_IOCAP_BATCH_ATOMIC (see below).
 *   COREFS_VFS_PROFILE  "1" (static builds): count and time the calls into corefs (see
 *                  corefs_vfs_profile).
 *   COREFS_COMMIT_INTERVAL_MS  the transaction commit interval (default 5000).
 *   COREFS_SHARDS  shards when formatting (default 64). Shards share the device's space:
 *                  a database or WAL may use all of it.
 * The filesystem stays mounted until the process exits (an atexit handler closes it, which
 * commits everything).
 *
 * Batch atomic writes: a main database file advertises SQLITE_IOCAP_BATCH_ATOMIC and
 * implements SQLITE_FCNTL_BEGIN/COMMIT/ROLLBACK_ATOMIC_WRITE with corefs_atomic_begin /
 * _commit / _abort, so an SQLite built with SQLITE_ENABLE_BATCH_ATOMIC_WRITE (as
 * scripts/sqlite-build.sh builds it) commits a rollback-journal transaction without a journal:
 * its pages go to the file in one atomic batch, one fsync log record (docs/fsync-log.md). An
 * SQLite built without that option (Debian's, the stock shell) ignores the capability and
 * writes its journal as usual. A batch that fails (past its 64 MiB bound, -EFBIG) is an
 * SQLITE_IOERR, on which SQLite rolls the batch back and commits with a journal instead.
 *
 * Paths are absolute ("/db.sqlite"), relative to the root of the corefs filesystem.
 *
 * Locking: SQLite's SHARED/RESERVED/PENDING/EXCLUSIVE protocol and the WAL shared memory are
 * implemented in memory, per inode, for all connections of this process (as the in-process
 * part of os_unix.c). An in-process mount holds its device exclusively, so no other process
 * can reach the database. Through a corefs server (COREFS_DEVICE=serve:SOCKET) other
 * processes can: the process-level part of os_unix.c's locking is then done too, with
 * corefs_setlk byte-range locks that the server keeps across its clients (the same bytes
 * os_unix.c locks with fcntl). The WAL index of a database then lives in a POSIX shared
 * memory object (/dev/shm/corefs-wal-SOCKETHASH-INODE, the database's mode) that every client
 * process maps, and its locks are corefs_setlk locks on the database (see "WAL shared memory"
 * below): WAL works across processes as it does on a kernel filesystem.
 */
#ifdef COREFS_VFS_STATIC
#include <sqlite3.h>
#else
#include <sqlite3ext.h>
SQLITE_EXTENSION_INIT1
#endif

#include "corefs.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CFS_VFS_NAME "corefs"
#define CFS_MAX_PATHNAME 512
#define CFS_SECTOR_SIZE 4096
#define CFS_FILE_MODE 0644

/* ------------------------------------------------------------------------------------------ */
/* Global state                                                                               */
/* ------------------------------------------------------------------------------------------ */

/* Guards the lazy mount. */
static pthread_mutex_t g_mount_mutex = PTHREAD_MUTEX_INITIALIZER;
static corefs_fs g_fs = 0; /* > 0 once mounted */
/* Mounted through a corefs server (serve:SOCKET): other processes share the database, and
 * locks are taken across processes too (see "Locking" above). */
static int g_remote = 0;
/* Through a server: a hash of its socket's path, naming the WAL indexes' shared memory. */
static uint64_t g_socket_hash = 0;

/* The file methods (defined with the calls below). */
static const sqlite3_io_methods cfs_io_methods;
static int g_atexit_registered = 0;

/* Guards the inode table, its lock state and its shared memory. */
static pthread_mutex_t g_mutex = PTHREAD_MUTEX_INITIALIZER;

/* The VFS that xRandomness, xSleep, xCurrentTime... are delegated to. */
static sqlite3_vfs *g_default_vfs = 0;

/* Temporary file names. */
static unsigned long g_tmp_counter = 0;

typedef struct CfsShm CfsShm;

/* The WAL shared memory of one database (one inode), shared by the connections of this
 * process. */
typedef struct CfsShmNode {
  int szRegion;               /* size of each region (0 until the first xShmMap) */
  int nRegion;                /* regions in apRegion */
  char **apRegion;            /* the regions, zero-initialised (mapped from hShm, remote) */
  int hShm;                   /* through a server: the shared memory object, else -1 */
  char zShmName[64];          /* and its name (set by cfs_shm_open_remote) */
  int aLock[SQLITE_SHM_NLOCK]; /* per slot: 0 free, > 0 shared holders, -1 exclusive */
  CfsShm *pFirst;             /* connections using this node */
} CfsShmNode;

/* One connection's view of a CfsShmNode. */
struct CfsShm {
  CfsShmNode *pNode;
  CfsShm *pNext;
  uint16_t sharedMask; /* slots this connection holds shared */
  uint16_t exclMask;   /* slots this connection holds exclusive */
};

/* Lock state of one inode, shared by every open file of it. */
typedef struct CfsInode {
  uint64_t ino;
  int nRef;    /* open CfsFiles */
  int nShared; /* files holding SHARED or more */
  int eLock;   /* strongest lock held: NONE, SHARED, RESERVED, PENDING or EXCLUSIVE */
  CfsShmNode *pShmNode;
  struct CfsInode *pNext;
  /* Durability tracking, so that an xSync with nothing to make durable costs no call (SQLite
   * syncs the database right after a batch's commit, which made it durable already). Atomic
   * (__atomic builtins): any connection's handle of the inode writes and syncs.
   * writeGen counts changes through the VFS (writes, staged or not, and truncates);
   * syncedGen / dataSyncedGen are the writeGen that the last successful fsync or atomic
   * commit / fdatasync covered, -1 until one did (a file's first sync always runs: it also
   * makes the file's name durable). */
  int64_t writeGen;
  int64_t syncedGen;
  int64_t dataSyncedGen;
} CfsInode;

static CfsInode *g_inodes = 0;

typedef struct CfsFile {
  sqlite3_file base;
  corefs_fd fd;
  CfsInode *pInode;
  int eLock;     /* this file's lock level */
  int openFlags; /* SQLITE_OPEN_* */
  char *zDelete; /* path to unlink at close (DELETEONCLOSE), sqlite3_malloc'd */
  char *zPath;   /* for messages, sqlite3_malloc'd */
  CfsShm *pShm;  /* this connection's shared memory, when mapped */
  int inBatch;   /* an atomic batch is open on fd (SQLITE_FCNTL_BEGIN_ATOMIC_WRITE) */
  int nBatchWrite; /* xWrite calls since the batch opened (for the tear test hook) */
  /* A small write held back (WAL files only; see cfs_write): aPend[0..nPend) belongs at
   * iPendOfst. Sent by the next xWrite, joined to it when that one continues it, or before
   * any other method of this file runs. */
  uint8_t *aPend; /* sqlite3_malloc'd, nPendAlloc bytes */
  int nPendAlloc;
  int nPend;
  sqlite3_int64 iPendOfst;
} CfsFile;

/* The most bytes a WAL file holds back: a WAL frame header (24 bytes), or the WAL header
 * (32) followed by the first frame's header. */
#define CFS_PEND_MAX 64

/* Atomic batches committed, since the process started (corefs_vfs_atomic_commits). */
static unsigned long long g_atomic_commits = 0;

/* xWrite calls on WAL files, and the corefs_pwrite calls that wrote them
 * (corefs_vfs_wal_writes; see cfs_write). */
static unsigned long long g_wal_xwrites = 0, g_wal_pwrites = 0;

/* xSync calls that had nothing to make durable (corefs_vfs_syncs_skipped). */
static unsigned long long g_syncs_skipped = 0;

/* Whether main database files advertise SQLITE_IOCAP_BATCH_ATOMIC (COREFS_BATCH_ATOMIC). */
static int g_batch_atomic = 1;

#ifdef COREFS_VFS_STATIC
/* Whether the VFS calls are counted and timed (COREFS_VFS_PROFILE; see corefs_vfs_profile). */
static int g_prof_on = 0;

/* The tear test's hook (static builds only; test_sqlite's "tear" phase): when > 0, the write
 * that makes this many xWrite calls in an atomic batch is followed by a filesystem commit
 * (what corefs's commit timer may do between any two operations) and the end of the process
 * without closing the filesystem: on a device behind a volatile cache, a power cut in the
 * middle of a batch, right after a commit that would have persisted the batch's first pages
 * were they written rather than staged. */
static int g_tear_after_writes = 0;

void corefs_vfs_tear_after_writes(int n);
void corefs_vfs_tear_after_writes(int n) {
  g_tear_after_writes = n;
}
#endif

/* ------------------------------------------------------------------------------------------ */
/* Mount                                                                                      */
/* ------------------------------------------------------------------------------------------ */

static void *cfs_close_thread(void *arg) {
  corefs_fs fs = *(corefs_fs *)arg;
  int rc = corefs_close(fs);
  if (rc < 0) {
    sqlite3_log(SQLITE_IOERR, "corefs vfs: corefs_close failed (%d): %s", rc,
                corefs_last_error());
  }
  return 0;
}

/* At exit, glibc has already destroyed the calling thread's thread-local storage, which
 * libcorefs uses (its per-thread client and error message): corefs_close on this thread
 * aborts the process. Closing from a fresh thread avoids that. */
static void cfs_atexit(void) {
  pthread_t thread;
  corefs_fs fs;
  pthread_mutex_lock(&g_mount_mutex);
  fs = g_fs;
  g_fs = 0;
  pthread_mutex_unlock(&g_mount_mutex);
  if (fs <= 0) return;
  if (pthread_create(&thread, 0, cfs_close_thread, &fs) == 0) {
    pthread_join(thread, 0);
  } else {
    cfs_close_thread(&fs);
  }
}

/* Mounts the filesystem on first use. Returns SQLITE_OK and sets *pFs, or SQLITE_CANTOPEN. */
static int cfs_mounted(corefs_fs *pFs) {
  int rc = SQLITE_OK;
  pthread_mutex_lock(&g_mount_mutex);
  if (g_fs <= 0) {
    const char *device = getenv("COREFS_DEVICE");
    if (device == 0 || device[0] == 0) {
      sqlite3_log(SQLITE_CANTOPEN,
                  "corefs vfs: COREFS_DEVICE is not set (a corefs device string such as "
                  "file:/var/tmp/fs.img,size=256MiB or mem:256MiB)");
      rc = SQLITE_CANTOPEN;
    } else {
      struct corefs_options options;
      const char *format = getenv("COREFS_FORMAT");
      memset(&options, 0, sizeof(options));
      const char *shards = getenv("COREFS_SHARDS");
      options.format = (format != 0 && strcmp(format, "1") == 0) ? 1 : 0;
      {
        /* COREFS_BUSY_POLL=1: the reactor busy-polls (give it a dedicated core). */
        const char *busy = getenv("COREFS_BUSY_POLL");
        options.busy_poll = (busy != 0 && strcmp(busy, "1") == 0) ? 1 : 0;
      }
      if (shards != 0 && shards[0] != 0) options.shards = (uint32_t)strtoul(shards, 0, 10);
      {
        const char *interval = getenv("COREFS_COMMIT_INTERVAL_MS");
        const char *batch = getenv("COREFS_BATCH_ATOMIC");
        if (interval != 0 && interval[0] != 0) {
          options.commit_interval_ms = (uint32_t)strtoul(interval, 0, 10);
        }
        g_batch_atomic = !(batch != 0 && strcmp(batch, "0") == 0);
#ifdef COREFS_VFS_STATIC
        {
          const char *profile = getenv("COREFS_VFS_PROFILE");
          g_prof_on = profile != 0 && strcmp(profile, "1") == 0;
        }
#endif
      }
      corefs_fs fs = corefs_mount(device, &options);
      if (fs < 0) {
        sqlite3_log(SQLITE_CANTOPEN, "corefs vfs: corefs_mount(%s) failed (%lld): %s", device,
                    (long long)fs, corefs_last_error());
        rc = SQLITE_CANTOPEN;
      } else {
        g_fs = fs;
        g_remote = strncmp(device, "serve:", 6) == 0;
        if (g_remote) {
          /* FNV-1a of the socket's path. */
          uint64_t h = 0xcbf29ce484222325ull;
          for (const char *c = device + 6; *c; c++) h = (h ^ (uint8_t)*c) * 0x100000001b3ull;
          g_socket_hash = h;
        }
        if (!g_atexit_registered) {
          g_atexit_registered = 1;
          atexit(cfs_atexit);
        }
      }
    }
  }
  if (rc == SQLITE_OK) *pFs = g_fs;
  pthread_mutex_unlock(&g_mount_mutex);
  return rc;
}

static corefs_fs cfs_fs(void) {
  /* Only called on open files: the filesystem is mounted. */
  return g_fs;
}

/* Logs a failed corefs call and returns rc. */
static int cfs_fail(int rc, const char *call, const char *path, long long err) {
  sqlite3_log(rc, "corefs vfs: %s(%s) failed (%lld): %s", call, path ? path : "", err,
              corefs_last_error());
  return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* The inode table                                                                            */
/* ------------------------------------------------------------------------------------------ */

/* Finds or creates the entry of `ino` and takes a reference. Called with g_mutex held. */
static CfsInode *cfs_inode_ref(uint64_t ino) {
  CfsInode *p;
  for (p = g_inodes; p; p = p->pNext) {
    if (p->ino == ino) {
      p->nRef++;
      return p;
    }
  }
  p = sqlite3_malloc(sizeof(*p));
  if (p == 0) return 0;
  memset(p, 0, sizeof(*p));
  p->ino = ino;
  p->nRef = 1;
  p->syncedGen = -1;
  p->dataSyncedGen = -1;
  p->pNext = g_inodes;
  g_inodes = p;
  return p;
}

/* Drops a reference. Called with g_mutex held. */
static void cfs_inode_unref(CfsInode *pInode) {
  CfsInode **pp;
  if (--pInode->nRef > 0) return;
  for (pp = &g_inodes; *pp; pp = &(*pp)->pNext) {
    if (*pp == pInode) {
      *pp = pInode->pNext;
      break;
    }
  }
  /* The shared memory is gone once every connection unmapped it (see cfs_shm_unmap). */
  sqlite3_free(pInode);
}

/* A change through the VFS (see CfsInode.writeGen). */
static void cfs_changed(CfsFile *p) {
  if (p->pInode) __atomic_add_fetch(&p->pInode->writeGen, 1, __ATOMIC_SEQ_CST);
}

/* The change count a sync starting now will cover (taken before the call: a change racing
 * with it counts as not covered). */
static int64_t cfs_gen(CfsFile *p) {
  return p->pInode ? __atomic_load_n(&p->pInode->writeGen, __ATOMIC_SEQ_CST) : -1;
}

/* Records that a sync covering `gen` succeeded (a full one: data and metadata). */
static void cfs_synced(CfsFile *p, int64_t gen, int full) {
  int64_t *slots[2];
  int i;
  if (p->pInode == 0 || gen < 0) return;
  slots[0] = &p->pInode->dataSyncedGen;
  slots[1] = full ? &p->pInode->syncedGen : 0;
  for (i = 0; i < 2; i++) {
    int64_t seen;
    if (slots[i] == 0) continue;
    seen = __atomic_load_n(slots[i], __ATOMIC_SEQ_CST);
    while (seen < gen &&
           !__atomic_compare_exchange_n(slots[i], &seen, gen, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {
    }
  }
}

/* Whether a sync (full, or data only) has nothing to do: every change is covered already. */
static int cfs_sync_needless(CfsFile *p, int full) {
  int64_t gen = cfs_gen(p);
  if (p->pInode == 0) return 0;
  if (__atomic_load_n(&p->pInode->syncedGen, __ATOMIC_SEQ_CST) == gen) return 1;
  return !full && __atomic_load_n(&p->pInode->dataSyncedGen, __ATOMIC_SEQ_CST) == gen;
}

/* ------------------------------------------------------------------------------------------ */
/* I/O methods                                                                                */
/* ------------------------------------------------------------------------------------------ */

static int cfs_shm_unmap(sqlite3_file *pFile, int deleteFlag);
static int cfs_unlock(sqlite3_file *pFile, int eLock);
static int cfs_flush(CfsFile *p);

static int cfs_close(sqlite3_file *pFile) {
  CfsFile *p = (CfsFile *)pFile;
  int rc = p->fd > 0 ? cfs_flush(p) : SQLITE_OK;
  sqlite3_free(p->aPend);
  p->aPend = 0;
  p->nPendAlloc = 0;
  if (p->pShm) cfs_shm_unmap(pFile, 0);
  if (p->pInode) {
    cfs_unlock(pFile, SQLITE_LOCK_NONE);
    pthread_mutex_lock(&g_mutex);
    cfs_inode_unref(p->pInode);
    pthread_mutex_unlock(&g_mutex);
    p->pInode = 0;
  }
  if (p->fd > 0) {
    int e = corefs_release(cfs_fs(), p->fd);
    if (e < 0) rc = cfs_fail(SQLITE_IOERR_CLOSE, "corefs_release", p->zPath, e);
    p->fd = 0;
  }
  if (p->zDelete) {
    /* After the release: corefs frees an unlinked inode at once. */
    int e = corefs_unlink(cfs_fs(), p->zDelete);
    if (e < 0 && e != -ENOENT && rc == SQLITE_OK) {
      rc = cfs_fail(SQLITE_IOERR_DELETE, "corefs_unlink", p->zDelete, e);
    }
    sqlite3_free(p->zDelete);
    p->zDelete = 0;
  }
  sqlite3_free(p->zPath);
  p->zPath = 0;
  return rc;
}

static int cfs_read(sqlite3_file *pFile, void *zBuf, int iAmt, sqlite3_int64 iOfst) {
  CfsFile *p = (CfsFile *)pFile;
  uint8_t *buf = zBuf;
  size_t done = 0;
  {
    int rcFlush = cfs_flush(p);
    if (rcFlush != SQLITE_OK) return rcFlush;
  }
  while (done < (size_t)iAmt) {
    int64_t n = corefs_pread(cfs_fs(), p->fd, buf + done, (size_t)iAmt - done,
                             (uint64_t)iOfst + done);
    if (n < 0) return cfs_fail(SQLITE_IOERR_READ, "corefs_pread", p->zPath, n);
    if (n == 0) break;
    done += (size_t)n;
  }
  if (done < (size_t)iAmt) {
    memset(buf + done, 0, (size_t)iAmt - done);
    return SQLITE_IOERR_SHORT_READ;
  }
  return SQLITE_OK;
}

/* Writes buf[0..iAmt) at iOfst, whole. */
static int cfs_pwrite_all(CfsFile *p, const uint8_t *buf, int iAmt, sqlite3_int64 iOfst) {
  size_t done = 0;
  int retried = 0;
  if (p->openFlags & SQLITE_OPEN_WAL) __sync_add_and_fetch(&g_wal_pwrites, 1);
  while (done < (size_t)iAmt) {
    int64_t n = corefs_pwrite(cfs_fs(), p->fd, buf + done, (size_t)iAmt - done,
                              (uint64_t)iOfst + done);
    if (n == -ENOSPC && !retried) {
      /* corefs frees overwritten blocks only at its next commit (copy-on-write): a file
       * rewritten within one commit interval can run its shard out of space while the
       * freed blocks wait. Commit now and try once more. */
      retried = 1;
      if (corefs_sync(cfs_fs()) == 0) continue;
    }
    if (n < 0) {
      return cfs_fail(n == -ENOSPC ? SQLITE_FULL : SQLITE_IOERR_WRITE, "corefs_pwrite",
                      p->zPath, n);
    }
    if (n == 0) return cfs_fail(SQLITE_IOERR_WRITE, "corefs_pwrite (wrote 0)", p->zPath, 0);
    done += (size_t)n;
  }
  return SQLITE_OK;
}

/* Sends the held-back write, if any. Every method of a file but xWrite calls it first, so
 * that nothing observes the file without it. */
static int cfs_flush(CfsFile *p) {
  int n = p->nPend;
  if (n == 0) return SQLITE_OK;
  p->nPend = 0;
  return cfs_pwrite_all(p, p->aPend, n, p->iPendOfst);
}

/* Makes aPend hold at least n bytes. */
static int cfs_pend_reserve(CfsFile *p, int n) {
  uint8_t *a;
  if (n <= p->nPendAlloc) return SQLITE_OK;
  a = sqlite3_realloc(p->aPend, n);
  if (a == 0) return SQLITE_NOMEM;
  p->aPend = a;
  p->nPendAlloc = n;
  return SQLITE_OK;
}

/* SQLite writes a WAL frame as two writes: its 24-byte header, then the page right after it
 * (4120 bytes in all, so neither is block-aligned). Each write through corefs is a round trip
 * to the reactor and a read-modify-write of the blocks it touches, both of which the header
 * shares with the page: a WAL file therefore holds a small write back and sends it joined to
 * the write that continues it, one call per frame instead of two. This is safe because:
 * - nothing of this file observes the file before the held bytes are sent (cfs_flush runs
 *   first in every other method: xRead, xSync, xFileSize, xTruncate, xClose, ...), and a
 *   held write is no more exposed to a crash than an unsynced one;
 * - other connections read WAL frames only once the writer has published them in the
 *   wal-index, which SQLite does after writing the whole frame (header and page), so they
 *   never look for a held header;
 * - an error sending a held write is returned by the call that sent it (an xWrite, or the
 *   next method of the file, such as the commit's xSync). */
static int cfs_write(sqlite3_file *pFile, const void *zBuf, int iAmt, sqlite3_int64 iOfst) {
  CfsFile *p = (CfsFile *)pFile;
  const uint8_t *buf = zBuf;
  int rc;
  cfs_changed(p);
  if (p->openFlags & SQLITE_OPEN_WAL) __sync_add_and_fetch(&g_wal_xwrites, 1);
  if (p->nPend > 0) {
    if (iOfst == p->iPendOfst + p->nPend && !p->inBatch &&
        cfs_pend_reserve(p, p->nPend + iAmt) == SQLITE_OK) {
      int n = p->nPend + iAmt;
      memcpy(p->aPend + p->nPend, buf, (size_t)iAmt);
      if (n <= CFS_PEND_MAX) {
        p->nPend = n;
        return SQLITE_OK;
      }
      p->nPend = 0;
      return cfs_pwrite_all(p, p->aPend, n, p->iPendOfst);
    }
    rc = cfs_flush(p);
    if (rc != SQLITE_OK) return rc;
  }
  if ((p->openFlags & SQLITE_OPEN_WAL) && !p->inBatch && iAmt <= CFS_PEND_MAX &&
      cfs_pend_reserve(p, CFS_PEND_MAX) == SQLITE_OK) {
    memcpy(p->aPend, buf, (size_t)iAmt);
    p->nPend = iAmt;
    p->iPendOfst = iOfst;
    return SQLITE_OK;
  }
  rc = cfs_pwrite_all(p, buf, iAmt, iOfst);
  if (rc != SQLITE_OK) return rc;
#ifdef COREFS_VFS_STATIC
  if (p->inBatch && g_tear_after_writes > 0 && ++p->nBatchWrite == g_tear_after_writes) {
    int e = corefs_sync(cfs_fs());
    fprintf(stdout, "torn after write %d of a batch (corefs_sync: %d)\n", p->nBatchWrite, e);
    fflush(stdout);
    _exit(e < 0 ? 1 : 0);
  }
#endif
  return SQLITE_OK;
}

static int cfs_truncate(sqlite3_file *pFile, sqlite3_int64 size) {
  CfsFile *p = (CfsFile *)pFile;
  int e;
  {
    int rcFlush = cfs_flush(p);
    if (rcFlush != SQLITE_OK) return rcFlush;
  }
  cfs_changed(p);
  e = corefs_ftruncate(cfs_fs(), p->fd, (uint64_t)size);
  if (e < 0) return cfs_fail(SQLITE_IOERR_TRUNCATE, "corefs_ftruncate", p->zPath, e);
  return SQLITE_OK;
}

static int cfs_sync(sqlite3_file *pFile, int flags) {
  CfsFile *p = (CfsFile *)pFile;
  int full = !(flags & SQLITE_SYNC_DATAONLY);
  int64_t gen;
  int e;
  {
    int rcFlush = cfs_flush(p);
    if (rcFlush != SQLITE_OK) return rcFlush;
  }
  if (cfs_sync_needless(p, full)) {
    __sync_add_and_fetch(&g_syncs_skipped, 1);
    return SQLITE_OK;
  }
  gen = cfs_gen(p);
  if (!full) {
    e = corefs_fdatasync(cfs_fs(), p->fd);
    if (e < 0) return cfs_fail(SQLITE_IOERR_FSYNC, "corefs_fdatasync", p->zPath, e);
  } else {
    e = corefs_fsync(cfs_fs(), p->fd);
    if (e < 0) return cfs_fail(SQLITE_IOERR_FSYNC, "corefs_fsync", p->zPath, e);
  }
  cfs_synced(p, gen, full);
  return SQLITE_OK;
}

static int cfs_file_size(sqlite3_file *pFile, sqlite3_int64 *pSize) {
  CfsFile *p = (CfsFile *)pFile;
  struct corefs_stat st;
  {
    int rcFlush = cfs_flush(p);
    if (rcFlush != SQLITE_OK) return rcFlush;
  }
  int e = corefs_fstat(cfs_fs(), p->fd, &st);
  if (e < 0) return cfs_fail(SQLITE_IOERR_FSTAT, "corefs_fstat", p->zPath, e);
  *pSize = (sqlite3_int64)st.size;
  return SQLITE_OK;
}

/* os_unix.c's lock bytes: a PENDING byte, a RESERVED byte and the SHARED range, past the
 * first GiB (SQLite never writes pages there). */
#define CFS_PENDING_BYTE 0x40000000
#define CFS_RESERVED_BYTE (CFS_PENDING_BYTE + 1)
#define CFS_SHARED_FIRST (CFS_PENDING_BYTE + 2)
#define CFS_SHARED_SIZE 510

/* A process-level lock through the server (g_remote only): SQLITE_OK, SQLITE_BUSY when
 * another process holds a conflicting lock, or `ioerr`. */
static int cfs_plock(CfsFile *p, int kind, uint64_t start, uint64_t len, int ioerr) {
  int e = corefs_setlk(cfs_fs(), p->fd, kind, start, len);
  if (e == 0) return SQLITE_OK;
  if (e == -EAGAIN) return SQLITE_BUSY;
  return cfs_fail(ioerr, "corefs_setlk", p->zPath, e);
}

/* os_unix.c's unixLock: the in-process part always, the process-level part (its fcntl
 * locks, here corefs_setlk) through a server. Called with g_mutex held. */
static int cfs_lock_locked(CfsFile *p, CfsInode *pInode, int eLock) {
  int rc = SQLITE_OK;
  if (p->eLock != pInode->eLock &&
      (pInode->eLock >= SQLITE_LOCK_PENDING || eLock > SQLITE_LOCK_SHARED)) {
    /* Another file of this process holds a lock that excludes this one. */
    return SQLITE_BUSY;
  }
  if (eLock == SQLITE_LOCK_SHARED &&
      (pInode->eLock == SQLITE_LOCK_SHARED || pInode->eLock == SQLITE_LOCK_RESERVED)) {
    /* This process reads already: one more reader in it. */
    p->eLock = SQLITE_LOCK_SHARED;
    pInode->nShared++;
    return SQLITE_OK;
  }
  if (g_remote && (eLock == SQLITE_LOCK_SHARED ||
                   (eLock == SQLITE_LOCK_EXCLUSIVE && p->eLock == SQLITE_LOCK_RESERVED))) {
    /* PENDING first: held for good on the way to EXCLUSIVE (no new reader comes in),
     * briefly for SHARED (a reader waits while a writer is pending). */
    rc = cfs_plock(p, eLock == SQLITE_LOCK_SHARED ? COREFS_LOCK_READ : COREFS_LOCK_WRITE,
                   CFS_PENDING_BYTE, 1, SQLITE_IOERR_LOCK);
    if (rc != SQLITE_OK) return rc;
    if (eLock == SQLITE_LOCK_EXCLUSIVE) {
      p->eLock = SQLITE_LOCK_PENDING;
      pInode->eLock = SQLITE_LOCK_PENDING;
    }
  }
  if (eLock == SQLITE_LOCK_SHARED) {
    /* No file of this process holds the inode. */
    if (g_remote) {
      rc = cfs_plock(p, COREFS_LOCK_READ, CFS_SHARED_FIRST, CFS_SHARED_SIZE, SQLITE_IOERR_LOCK);
      int rcUnlock = cfs_plock(p, COREFS_LOCK_UNLOCK, CFS_PENDING_BYTE, 1, SQLITE_IOERR_UNLOCK);
      if (rc == SQLITE_OK) rc = rcUnlock;
      if (rc != SQLITE_OK) return rc;
    }
    p->eLock = SQLITE_LOCK_SHARED;
    pInode->nShared = 1;
    pInode->eLock = SQLITE_LOCK_SHARED;
    return SQLITE_OK;
  }
  if (eLock == SQLITE_LOCK_EXCLUSIVE && pInode->nShared > 1) {
    /* Other readers of this process remain: hold PENDING so that no new one comes in. */
    p->eLock = SQLITE_LOCK_PENDING;
    pInode->eLock = SQLITE_LOCK_PENDING;
    return SQLITE_BUSY;
  }
  /* RESERVED, or EXCLUSIVE with p the only reader of this process. */
  if (g_remote) {
    if (eLock == SQLITE_LOCK_RESERVED) {
      rc = cfs_plock(p, COREFS_LOCK_WRITE, CFS_RESERVED_BYTE, 1, SQLITE_IOERR_LOCK);
    } else {
      rc = cfs_plock(p, COREFS_LOCK_WRITE, CFS_SHARED_FIRST, CFS_SHARED_SIZE, SQLITE_IOERR_LOCK);
    }
    if (rc != SQLITE_OK) {
      if (eLock == SQLITE_LOCK_EXCLUSIVE) {
        /* Other processes still read: keep PENDING, try again later. */
        p->eLock = SQLITE_LOCK_PENDING;
        pInode->eLock = SQLITE_LOCK_PENDING;
      }
      return rc;
    }
  }
  p->eLock = eLock;
  pInode->eLock = eLock;
  return SQLITE_OK;
}

static int cfs_lock(sqlite3_file *pFile, int eLock) {
  CfsFile *p = (CfsFile *)pFile;
  CfsInode *pInode = p->pInode;
  int rc;

  if (p->eLock >= eLock) return SQLITE_OK;
  if (pInode == 0) return SQLITE_IOERR_LOCK;

  pthread_mutex_lock(&g_mutex);
  rc = cfs_lock_locked(p, pInode, eLock);
  pthread_mutex_unlock(&g_mutex);
  return rc;
}

/* os_unix.c's posixUnlock: the in-process part, and through a server the process-level
 * one. */
static int cfs_unlock(sqlite3_file *pFile, int eLock) {
  CfsFile *p = (CfsFile *)pFile;
  CfsInode *pInode = p->pInode;
  int rc = SQLITE_OK;

  if (p->eLock <= eLock) return SQLITE_OK;
  if (pInode == 0) return SQLITE_IOERR_UNLOCK;

  pthread_mutex_lock(&g_mutex);
  if (p->eLock > SQLITE_LOCK_SHARED) {
    /* p held the one RESERVED/PENDING/EXCLUSIVE lock of the inode in this process. */
    if (g_remote) {
      if (eLock == SQLITE_LOCK_SHARED) {
        rc = cfs_plock(p, COREFS_LOCK_READ, CFS_SHARED_FIRST, CFS_SHARED_SIZE,
                       SQLITE_IOERR_RDLOCK);
      }
      if (rc == SQLITE_OK) {
        rc = cfs_plock(p, COREFS_LOCK_UNLOCK, CFS_PENDING_BYTE, 2, SQLITE_IOERR_UNLOCK);
      }
    }
    pInode->eLock = SQLITE_LOCK_SHARED;
  }
  if (eLock == SQLITE_LOCK_NONE) {
    pInode->nShared--;
    if (pInode->nShared == 0) {
      if (g_remote) {
        int rcUnlock = cfs_plock(p, COREFS_LOCK_UNLOCK, 0, 0, SQLITE_IOERR_UNLOCK);
        if (rc == SQLITE_OK) rc = rcUnlock;
      }
      pInode->eLock = SQLITE_LOCK_NONE;
    }
  }
  p->eLock = eLock;
  pthread_mutex_unlock(&g_mutex);
  return rc;
}

static int cfs_check_reserved_lock(sqlite3_file *pFile, int *pResOut) {
  CfsFile *p = (CfsFile *)pFile;
  int reserved = 0;
  if (p->pInode) {
    pthread_mutex_lock(&g_mutex);
    reserved = p->pInode->eLock > SQLITE_LOCK_SHARED;
    if (!reserved && g_remote) {
      /* Another process's RESERVED lock. */
      int e = corefs_testlk(cfs_fs(), p->fd, COREFS_LOCK_WRITE, CFS_RESERVED_BYTE, 1);
      if (e < 0) {
        pthread_mutex_unlock(&g_mutex);
        return cfs_fail(SQLITE_IOERR_CHECKRESERVEDLOCK, "corefs_testlk", p->zPath, e);
      }
      reserved = e == 1;
    }
    pthread_mutex_unlock(&g_mutex);
  }
  *pResOut = reserved;
  return SQLITE_OK;
}

/* The atomic batch calls (see "Batch atomic writes" at the top). SQLite calls them only on a
 * file that advertised SQLITE_IOCAP_BATCH_ATOMIC, and only when built with
 * SQLITE_ENABLE_BATCH_ATOMIC_WRITE. A failed commit is an SQLITE_IOERR: SQLite then rolls
 * back (the batch is already closed) and commits the transaction with a journal. */
static int cfs_file_control(sqlite3_file *pFile, int op, void *pArg) {
  CfsFile *p = (CfsFile *)pFile;
  int e;
  (void)pArg;
  {
    int rcFlush = cfs_flush(p);
    if (rcFlush != SQLITE_OK) return rcFlush;
  }
  switch (op) {
#ifdef COREFS_VFS_MUTATION_UNSTAGED_BATCH
    /* A deliberate breakage, for checking that scripts/sqlite-test.sh's crash test catches it
     * (never in a normal build): the "batch" writes its pages one by one and fsyncs, so a
     * commit may persist part of a transaction that wrote no journal. */
    case SQLITE_FCNTL_BEGIN_ATOMIC_WRITE:
      (void)e;
      p->inBatch = 1;
      p->nBatchWrite = 0;
      return SQLITE_OK;
    case SQLITE_FCNTL_COMMIT_ATOMIC_WRITE:
      p->inBatch = 0;
      __sync_add_and_fetch(&g_atomic_commits, 1);
      return corefs_fsync(cfs_fs(), p->fd) < 0 ? SQLITE_IOERR_COMMIT_ATOMIC : SQLITE_OK;
    case SQLITE_FCNTL_ROLLBACK_ATOMIC_WRITE:
      p->inBatch = 0;
      return SQLITE_OK;
#else
    case SQLITE_FCNTL_BEGIN_ATOMIC_WRITE:
      e = corefs_atomic_begin(cfs_fs(), p->fd);
      if (e < 0) return cfs_fail(SQLITE_IOERR_BEGIN_ATOMIC, "corefs_atomic_begin", p->zPath, e);
      p->inBatch = 1;
      p->nBatchWrite = 0;
      return SQLITE_OK;
    case SQLITE_FCNTL_COMMIT_ATOMIC_WRITE:
      if (!p->inBatch) return SQLITE_IOERR_COMMIT_ATOMIC;
      p->inBatch = 0;
      {
        /* The commit makes the file durable as corefs_fsync does: SQLite's xSync right after
         * it then has nothing to do (see cfs_sync_needless). */
        int64_t gen = cfs_gen(p);
        e = corefs_atomic_commit(cfs_fs(), p->fd);
        if (e < 0) {
          return cfs_fail(SQLITE_IOERR_COMMIT_ATOMIC, "corefs_atomic_commit", p->zPath, e);
        }
        cfs_synced(p, gen, 1);
      }
      __sync_add_and_fetch(&g_atomic_commits, 1);
      return SQLITE_OK;
    case SQLITE_FCNTL_ROLLBACK_ATOMIC_WRITE:
      /* Also after a failed commit, which closed the batch already. */
      if (!p->inBatch) return SQLITE_OK;
      p->inBatch = 0;
      e = corefs_atomic_abort(cfs_fs(), p->fd);
      if (e < 0) {
        return cfs_fail(SQLITE_IOERR_ROLLBACK_ATOMIC, "corefs_atomic_abort", p->zPath, e);
      }
      return SQLITE_OK;
#endif
    default:
      return SQLITE_NOTFOUND;
  }
}

/* Atomic batches this process committed through the VFS (tests check that a transaction
 * used one). */
unsigned long long corefs_vfs_atomic_commits(void) {
  return __sync_add_and_fetch(&g_atomic_commits, 0);
}

/* xWrite calls on WAL files (*calls) and the writes into corefs they took (*sent). */
void corefs_vfs_wal_writes(unsigned long long *calls, unsigned long long *sent) {
  *calls = __sync_add_and_fetch(&g_wal_xwrites, 0);
  *sent = __sync_add_and_fetch(&g_wal_pwrites, 0);
}

/* xSync calls answered without a call into corefs, every change being durable already. */
unsigned long long corefs_vfs_syncs_skipped(void) {
  return __sync_add_and_fetch(&g_syncs_skipped, 0);
}

static int cfs_sector_size(sqlite3_file *pFile) {
  (void)pFile;
  return CFS_SECTOR_SIZE;
}

static int cfs_device_characteristics(sqlite3_file *pFile) {
  CfsFile *p = (CfsFile *)pFile;
  int caps = SQLITE_IOCAP_POWERSAFE_OVERWRITE;
  /* Only the database file: SQLite batches only its writes, and a journal or WAL file
   * advertising it would gain nothing. */
  if (g_batch_atomic && (p->openFlags & SQLITE_OPEN_MAIN_DB)) caps |= SQLITE_IOCAP_BATCH_ATOMIC;
  return caps;
}

/* ------------------------------------------------------------------------------------------ */
/* WAL shared memory                                                                          */
/* ------------------------------------------------------------------------------------------ */

/* In process, the WAL index is memory of this process, shared by its connections. Through a
 * server other processes open the database too, so it is what os_unix.c makes of a -shm
 * file: a POSIX shared memory object per database (named by the server's socket and the
 * database's inode, with the database's mode; tmpfs, never on the corefs device: the index is
 * rebuilt from the WAL whenever no process has it open), mapped region by region, and its
 * eight locks are process-level locks (corefs_setlk, kept by the server for every client and
 * released when a client goes, even killed) on bytes of the database past the ones the
 * database's own locks use, taken only when this process's connections together change what
 * they hold (the in-process counts decide, as in os_unix.c). A "dead man switch" byte tells
 * the first process to map the index that nobody else has it: it then empties the object
 * (an index left by processes that are gone, or by an earlier server, is stale), and every
 * process holds the byte shared while it has the index mapped. */
#define CFS_SHM_LOCK_BASE (CFS_PENDING_BYTE + 0x1000)
#define CFS_SHM_DMS (CFS_SHM_LOCK_BASE + SQLITE_SHM_NLOCK)

/* Opens the shared memory object of p's database and takes its dead man switch (remote). */
static int cfs_shm_open_remote(CfsFile *p, CfsShmNode *pNode) {
  char *zName = pNode->zShmName;
  struct corefs_stat st;
  mode_t mode = 0600;
  int fd, rc;

  /* 11 + 16 + 1 + up to 20 digits: always fits. */
  snprintf(zName, sizeof(pNode->zShmName), "/corefs-wal-%016llx-%llu",
           (unsigned long long)g_socket_hash, (unsigned long long)p->pInode->ino);
  memset(&st, 0, sizeof(st));
  if (corefs_fstat(cfs_fs(), p->fd, &st) == 0) mode = (mode_t)(st.mode & 0666);
  fd = shm_open(zName, O_RDWR | O_CREAT | O_CLOEXEC, mode);
  if (fd < 0) {
    sqlite3_log(SQLITE_IOERR_SHMOPEN, "corefs vfs: shm_open(%s): %s", zName, strerror(errno));
    return SQLITE_IOERR_SHMOPEN;
  }
  rc = cfs_plock(p, COREFS_LOCK_WRITE, CFS_SHM_DMS, 1, SQLITE_IOERR_LOCK);
  if (rc == SQLITE_OK) {
    /* Nobody else has the index: what the object holds is stale. */
    if (ftruncate(fd, 0) != 0) {
      sqlite3_log(SQLITE_IOERR_SHMOPEN, "corefs vfs: ftruncate(%s): %s", zName, strerror(errno));
      cfs_plock(p, COREFS_LOCK_UNLOCK, CFS_SHM_DMS, 1, SQLITE_IOERR_UNLOCK);
      close(fd);
      return SQLITE_IOERR_SHMOPEN;
    }
    rc = cfs_plock(p, COREFS_LOCK_READ, CFS_SHM_DMS, 1, SQLITE_IOERR_LOCK);
  } else if (rc == SQLITE_BUSY) {
    /* Others have it mapped (shared), or one is emptying it (BUSY: SQLite retries). */
    rc = cfs_plock(p, COREFS_LOCK_READ, CFS_SHM_DMS, 1, SQLITE_IOERR_LOCK);
  }
  if (rc != SQLITE_OK) {
    close(fd);
    return rc;
  }
  pNode->hShm = fd;
  return SQLITE_OK;
}

/* Frees a node nobody in this process uses any more: its regions, and through a server its
 * mappings, its dead man switch and its object (unlinked when `deleteFlag`). */
static void cfs_shm_node_free(CfsFile *p, CfsShmNode *pNode, int deleteFlag) {
  int i;
  for (i = 0; i < pNode->nRegion; i++) {
    if (pNode->hShm >= 0) {
      munmap(pNode->apRegion[i], (size_t)pNode->szRegion);
    } else {
      sqlite3_free(pNode->apRegion[i]);
    }
  }
  sqlite3_free(pNode->apRegion);
  if (pNode->hShm >= 0) {
    if (deleteFlag) shm_unlink(pNode->zShmName);
    cfs_plock(p, COREFS_LOCK_UNLOCK, CFS_SHM_DMS, 1, SQLITE_IOERR_UNLOCK);
    close(pNode->hShm);
  }
  if (p->pInode && p->pInode->pShmNode == pNode) p->pInode->pShmNode = 0;
  sqlite3_free(pNode);
}

static int cfs_shm_map(sqlite3_file *pFile, int iRegion, int szRegion, int bExtend,
                       void volatile **pp) {
  CfsFile *p = (CfsFile *)pFile;
  CfsShmNode *pNode;
  int rc = SQLITE_OK;

  *pp = 0;
  if (p->pInode == 0 || iRegion < 0 || szRegion <= 0) return SQLITE_IOERR_SHMMAP;
  pthread_mutex_lock(&g_mutex);
  if (p->pShm == 0) {
    CfsShm *pShm = sqlite3_malloc(sizeof(*pShm));
    if (pShm == 0) {
      rc = SQLITE_NOMEM;
      goto out;
    }
    memset(pShm, 0, sizeof(*pShm));
    pNode = p->pInode->pShmNode;
    if (pNode == 0) {
      pNode = sqlite3_malloc(sizeof(*pNode));
      if (pNode == 0) {
        sqlite3_free(pShm);
        rc = SQLITE_NOMEM;
        goto out;
      }
      memset(pNode, 0, sizeof(*pNode));
      pNode->hShm = -1;
      if (g_remote) {
        rc = cfs_shm_open_remote(p, pNode);
        if (rc != SQLITE_OK) {
          sqlite3_free(pNode);
          sqlite3_free(pShm);
          goto out;
        }
      }
      p->pInode->pShmNode = pNode;
    }
    pShm->pNode = pNode;
    pShm->pNext = pNode->pFirst;
    pNode->pFirst = pShm;
    p->pShm = pShm;
  }
  pNode = p->pShm->pNode;
  if (pNode->szRegion == 0) pNode->szRegion = szRegion;
  if (pNode->szRegion != szRegion) {
    rc = SQLITE_IOERR_SHMSIZE;
    goto out;
  }
  if (iRegion >= pNode->nRegion) {
    if (pNode->hShm >= 0) {
      /* Another process may have grown the object already: map what is there. */
      struct stat st;
      off_t need = (off_t)(iRegion + 1) * szRegion;
      if (fstat(pNode->hShm, &st) != 0) {
        rc = SQLITE_IOERR_SHMSIZE;
        goto out;
      }
      if (st.st_size < need) {
        if (!bExtend) goto out; /* not there yet: *pp stays NULL */
        if (ftruncate(pNode->hShm, need) != 0) {
          sqlite3_log(SQLITE_IOERR_SHMSIZE, "corefs vfs: growing the WAL index: %s",
                      strerror(errno));
          rc = SQLITE_IOERR_SHMSIZE;
          goto out;
        }
      }
    } else if (!bExtend) {
      goto out; /* not there yet: *pp stays NULL */
    }
    char **apNew = sqlite3_realloc64(pNode->apRegion, (sqlite3_uint64)(iRegion + 1) * sizeof(char *));
    if (apNew == 0) {
      rc = SQLITE_IOERR_NOMEM;
      goto out;
    }
    pNode->apRegion = apNew;
    while (pNode->nRegion <= iRegion) {
      char *pRegion;
      if (pNode->hShm >= 0) {
        void *m = mmap(0, (size_t)szRegion, PROT_READ | PROT_WRITE, MAP_SHARED, pNode->hShm,
                       (off_t)pNode->nRegion * szRegion);
        if (m == MAP_FAILED) {
          sqlite3_log(SQLITE_IOERR_SHMMAP, "corefs vfs: mapping the WAL index: %s",
                      strerror(errno));
          rc = SQLITE_IOERR_SHMMAP;
          goto out;
        }
        pRegion = m;
      } else {
        pRegion = sqlite3_malloc(szRegion);
        if (pRegion == 0) {
          rc = SQLITE_IOERR_NOMEM;
          goto out;
        }
        memset(pRegion, 0, (size_t)szRegion);
      }
      pNode->apRegion[pNode->nRegion++] = pRegion;
    }
  }
  *pp = pNode->apRegion[iRegion];
out:
  pthread_mutex_unlock(&g_mutex);
  return rc;
}

/* Through a server, the process-level side of a change to slot range [ofst, ofst+n): what
 * this process's connections together hold there after it (the in-process counts say).
 * Called with g_mutex held, before the counts change for a lock and after for an unlock. */
static int cfs_shm_plock(CfsFile *p, int kind, int ofst, int n) {
  if (p->pShm->pNode->hShm < 0) return SQLITE_OK;
  return cfs_plock(p, kind, CFS_SHM_LOCK_BASE + (uint64_t)ofst, (uint64_t)n,
                   kind == COREFS_LOCK_UNLOCK ? SQLITE_IOERR_UNLOCK : SQLITE_IOERR_SHMLOCK);
}

static int cfs_shm_lock(sqlite3_file *pFile, int ofst, int n, int flags) {
  CfsFile *p = (CfsFile *)pFile;
  CfsShm *pShm = p->pShm;
  CfsShmNode *pNode;
  uint16_t mask;
  int i, rc = SQLITE_OK;

  if (pShm == 0) return SQLITE_IOERR_SHMLOCK;
  if (ofst < 0 || n < 1 || ofst + n > SQLITE_SHM_NLOCK) return SQLITE_IOERR_SHMLOCK;
  if (!(flags == (SQLITE_SHM_LOCK | SQLITE_SHM_SHARED) ||
        flags == (SQLITE_SHM_LOCK | SQLITE_SHM_EXCLUSIVE) ||
        flags == (SQLITE_SHM_UNLOCK | SQLITE_SHM_SHARED) ||
        flags == (SQLITE_SHM_UNLOCK | SQLITE_SHM_EXCLUSIVE))) {
    return SQLITE_IOERR_SHMLOCK;
  }
  mask = (uint16_t)((1u << (ofst + n)) - (1u << ofst));
  pNode = pShm->pNode;

  pthread_mutex_lock(&g_mutex);
  if (flags & SQLITE_SHM_UNLOCK) {
    for (i = ofst; i < ofst + n; i++) {
      uint16_t bit = (uint16_t)(1u << i);
      int held = (pShm->exclMask | pShm->sharedMask) & bit;
      if (pShm->exclMask & bit) {
        pNode->aLock[i] = 0;
      } else if (pShm->sharedMask & bit) {
        pNode->aLock[i]--;
      }
      /* The last holder in this process lets the slot go for other processes too. */
      if (held && pNode->aLock[i] == 0) {
        int e = cfs_shm_plock(p, COREFS_LOCK_UNLOCK, i, 1);
        if (e != SQLITE_OK) rc = e;
      }
    }
    pShm->exclMask &= (uint16_t)~mask;
    pShm->sharedMask &= (uint16_t)~mask;
  } else if (flags & SQLITE_SHM_SHARED) {
    /* One slot at a time (SQLite never asks for more); handled as a range anyway. */
    for (i = ofst; i < ofst + n; i++) {
      uint16_t bit = (uint16_t)(1u << i);
      if ((pShm->sharedMask | pShm->exclMask) & bit) continue;
      if (pNode->aLock[i] < 0) {
        rc = SQLITE_BUSY;
        break;
      }
    }
    /* The first holder in this process takes the slot from other processes too. */
    for (i = ofst; rc == SQLITE_OK && i < ofst + n; i++) {
      uint16_t bit = (uint16_t)(1u << i);
      if ((pShm->sharedMask | pShm->exclMask) & bit) continue;
      if (pNode->aLock[i] == 0) rc = cfs_shm_plock(p, COREFS_LOCK_READ, i, 1);
      if (rc == SQLITE_OK) {
        pNode->aLock[i]++;
        pShm->sharedMask |= bit;
      }
    }
  } else {
    /* Exclusive: no other connection, here or in another process, may hold any lock of the
     * range. */
    for (i = ofst; i < ofst + n; i++) {
      uint16_t bit = (uint16_t)(1u << i);
      int others;
      if (pShm->exclMask & bit) continue; /* already ours */
      if (pNode->aLock[i] < 0) {          /* exclusive by another connection */
        rc = SQLITE_BUSY;
        break;
      }
      others = pNode->aLock[i] - ((pShm->sharedMask & bit) ? 1 : 0);
      if (others > 0) { /* shared by other connections */
        rc = SQLITE_BUSY;
        break;
      }
    }
    if (rc == SQLITE_OK) {
      uint16_t need = (uint16_t)(mask & ~pShm->exclMask);
      if (need) {
        int lo = ofst, hi = ofst + n;
        while (!(need & (1u << lo))) lo++;
        while (!(need & (1u << (hi - 1)))) hi--;
        rc = cfs_shm_plock(p, COREFS_LOCK_WRITE, lo, hi - lo);
      }
    }
    if (rc == SQLITE_OK) {
      for (i = ofst; i < ofst + n; i++) pNode->aLock[i] = -1;
      pShm->sharedMask &= (uint16_t)~mask;
      pShm->exclMask |= mask;
    }
  }
  pthread_mutex_unlock(&g_mutex);
  return rc;
}

static void cfs_shm_barrier(sqlite3_file *pFile) {
  (void)pFile;
  __sync_synchronize();
  pthread_mutex_lock(&g_mutex);
  pthread_mutex_unlock(&g_mutex);
}

static int cfs_shm_unmap(sqlite3_file *pFile, int deleteFlag) {
  CfsFile *p = (CfsFile *)pFile;
  CfsShm *pShm = p->pShm;
  CfsShmNode *pNode;
  CfsShm **pp;
  int i;

  if (pShm == 0) return SQLITE_OK;
  pthread_mutex_lock(&g_mutex);
  pNode = pShm->pNode;
  /* Release whatever this connection still holds (and, when it was this process's last
   * holder, for other processes too). */
  for (i = 0; i < SQLITE_SHM_NLOCK; i++) {
    uint16_t bit = (uint16_t)(1u << i);
    int held = (pShm->exclMask | pShm->sharedMask) & bit;
    if (pShm->exclMask & bit) pNode->aLock[i] = 0;
    else if (pShm->sharedMask & bit) pNode->aLock[i]--;
    if (held && pNode->aLock[i] == 0) cfs_shm_plock(p, COREFS_LOCK_UNLOCK, i, 1);
  }
  for (pp = &pNode->pFirst; *pp; pp = &(*pp)->pNext) {
    if (*pp == pShm) {
      *pp = pShm->pNext;
      break;
    }
  }
  sqlite3_free(pShm);
  p->pShm = 0;
  /* In process nothing is on disk: the memory goes with the last connection. */
  if (pNode->pFirst == 0) cfs_shm_node_free(p, pNode, deleteFlag);
  pthread_mutex_unlock(&g_mutex);
  return SQLITE_OK;
}

static int cfs_fetch(sqlite3_file *pFile, sqlite3_int64 iOfst, int iAmt, void **pp) {
  (void)pFile;
  (void)iOfst;
  (void)iAmt;
  *pp = 0;
  return SQLITE_OK;
}

static int cfs_unfetch(sqlite3_file *pFile, sqlite3_int64 iOfst, void *p) {
  (void)pFile;
  (void)iOfst;
  (void)p;
  return SQLITE_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Profile (static builds only)                                                               */
/* ------------------------------------------------------------------------------------------ */

#ifdef COREFS_VFS_STATIC
/* COREFS_VFS_PROFILE=1 (read at mount): the calls into the VFS that reach corefs are counted
 * and timed (two clock reads each), and corefs_vfs_profile() reports them per transaction
 * beside the reactor's own figures: where a transaction's time goes, client side. */
enum { P_READ, P_WRITE, P_TRUNCATE, P_SYNC, P_SIZE, P_FCNTL, P_OPEN, P_DELETE, P_ACCESS, P_N };
static const char *const g_prof_names[P_N] = {"xRead",        "xWrite",  "xTruncate",
                                              "xSync",        "xFileSize", "xFileControl",
                                              "xOpen",        "xDelete", "xAccess"};
static unsigned long long g_prof_calls[P_N], g_prof_ns[P_N];

static uint64_t cfs_prof_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Counts one call of kind k that started at start_ns (0: profiling off). */
static void cfs_prof_add(int k, uint64_t start_ns) {
  if (start_ns == 0) return;
  __sync_add_and_fetch(&g_prof_calls[k], 1);
  __sync_add_and_fetch(&g_prof_ns[k], cfs_prof_now_ns() - start_ns);
}

static uint64_t cfs_prof_start(void) {
  return g_prof_on ? cfs_prof_now_ns() : 0;
}

/* The timed wrappers the method tables point to in static builds. */
#define CFS_PROF_WRAP(kind, name, params, args) \
  static int name##_p params {                  \
    uint64_t start_ns = cfs_prof_start();       \
    int rc = name args;                         \
    cfs_prof_add(kind, start_ns);               \
    return rc;                                  \
  }
CFS_PROF_WRAP(P_READ, cfs_read, (sqlite3_file * f, void *b, int n, sqlite3_int64 o), (f, b, n, o))
CFS_PROF_WRAP(P_WRITE, cfs_write, (sqlite3_file * f, const void *b, int n, sqlite3_int64 o),
              (f, b, n, o))
CFS_PROF_WRAP(P_TRUNCATE, cfs_truncate, (sqlite3_file * f, sqlite3_int64 n), (f, n))
CFS_PROF_WRAP(P_SYNC, cfs_sync, (sqlite3_file * f, int flags), (f, flags))
CFS_PROF_WRAP(P_SIZE, cfs_file_size, (sqlite3_file * f, sqlite3_int64 * n), (f, n))
CFS_PROF_WRAP(P_FCNTL, cfs_file_control, (sqlite3_file * f, int op, void *arg), (f, op, arg))
#define CFS_M(name) name##_p
#else
#define CFS_M(name) name
#endif

static const sqlite3_io_methods cfs_io_methods = {
    3,                          /* iVersion */
    cfs_close,                  /* xClose */
    CFS_M(cfs_read),            /* xRead */
    CFS_M(cfs_write),           /* xWrite */
    CFS_M(cfs_truncate),        /* xTruncate */
    CFS_M(cfs_sync),            /* xSync */
    CFS_M(cfs_file_size),       /* xFileSize */
    cfs_lock,                   /* xLock */
    cfs_unlock,                 /* xUnlock */
    cfs_check_reserved_lock,    /* xCheckReservedLock */
    CFS_M(cfs_file_control),    /* xFileControl */
    cfs_sector_size,            /* xSectorSize */
    cfs_device_characteristics, /* xDeviceCharacteristics */
    cfs_shm_map,                /* xShmMap */
    cfs_shm_lock,               /* xShmLock */
    cfs_shm_barrier,            /* xShmBarrier */
    cfs_shm_unmap,              /* xShmUnmap */
    cfs_fetch,                  /* xFetch */
    cfs_unfetch,                /* xUnfetch */
};


/* ------------------------------------------------------------------------------------------ */
/* VFS methods                                                                                */
/* ------------------------------------------------------------------------------------------ */

static int cfs_open_errno_to_rc(long long e) {
  switch (-e) {
    case ENOSPC:
      return SQLITE_FULL;
    case ENOMEM:
      return SQLITE_NOMEM;
    default:
      /* ENOENT, EEXIST, EACCES, EISDIR, ENOTDIR, EINVAL, ... */
      return SQLITE_CANTOPEN;
  }
}

static int cfs_open(sqlite3_vfs *pVfs, const char *zName, sqlite3_file *pFile, int flags,
                    int *pOutFlags) {
  CfsFile *p = (CfsFile *)pFile;
  corefs_fs fs;
  char zTmp[64];
  const char *zPath = zName;
  int oflags;
  corefs_fd fd;
  struct corefs_stat st;
  int rc, e;

  (void)pVfs;
  memset(p, 0, sizeof(*p));
  rc = cfs_mounted(&fs);
  if (rc != SQLITE_OK) return rc;

  if (zPath == 0) {
    unsigned long n = __sync_add_and_fetch(&g_tmp_counter, 1);
    sqlite3_snprintf((int)sizeof(zTmp), zTmp, "/.corefs-tmp-%d-%lu", (int)getpid(), n);
    zPath = zTmp;
    flags |= SQLITE_OPEN_DELETEONCLOSE | SQLITE_OPEN_CREATE | SQLITE_OPEN_EXCLUSIVE;
  }

  oflags = (flags & SQLITE_OPEN_READWRITE) ? COREFS_O_RDWR : COREFS_O_RDONLY;
  if (flags & SQLITE_OPEN_CREATE) oflags |= COREFS_O_CREAT;
  if (flags & SQLITE_OPEN_EXCLUSIVE) oflags |= COREFS_O_EXCL;

  fd = corefs_open(fs, zPath, oflags, CFS_FILE_MODE);
  if (fd < 0 && (flags & SQLITE_OPEN_READWRITE) && (fd == -EACCES || fd == -EROFS ||
                                                     fd == -EISDIR)) {
    /* As os_unix.c: fall back to read-only. */
    flags = (flags & ~(SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE)) | SQLITE_OPEN_READONLY;
    fd = corefs_open(fs, zPath, COREFS_O_RDONLY, CFS_FILE_MODE);
  }
  if (fd < 0) return cfs_fail(cfs_open_errno_to_rc(fd), "corefs_open", zPath, fd);

  e = corefs_fstat(fs, fd, &st);
  if (e < 0) {
    corefs_release(fs, fd);
    return cfs_fail(SQLITE_CANTOPEN, "corefs_fstat", zPath, e);
  }

  p->fd = fd;
  p->openFlags = flags;
  p->zPath = sqlite3_mprintf("%s", zPath);
  if (flags & SQLITE_OPEN_DELETEONCLOSE) p->zDelete = sqlite3_mprintf("%s", zPath);
  pthread_mutex_lock(&g_mutex);
  p->pInode = cfs_inode_ref(st.ino);
  pthread_mutex_unlock(&g_mutex);
  if (p->zPath == 0 || ((flags & SQLITE_OPEN_DELETEONCLOSE) && p->zDelete == 0) ||
      p->pInode == 0) {
    if (p->pInode) {
      pthread_mutex_lock(&g_mutex);
      cfs_inode_unref(p->pInode);
      pthread_mutex_unlock(&g_mutex);
    }
    corefs_release(fs, fd);
    if (flags & SQLITE_OPEN_DELETEONCLOSE) corefs_unlink(fs, zPath);
    sqlite3_free(p->zPath);
    sqlite3_free(p->zDelete);
    memset(p, 0, sizeof(*p));
    return SQLITE_NOMEM;
  }
  p->base.pMethods = &cfs_io_methods;
  if (pOutFlags) *pOutFlags = flags;
  return SQLITE_OK;
}

/* Makes the entries of the directory holding `zPath` durable. */
static int cfs_sync_parent(corefs_fs fs, const char *zPath) {
  char zDir[CFS_MAX_PATHNAME + 1];
  const char *zSlash = strrchr(zPath, '/');
  size_t n = zSlash ? (size_t)(zSlash - zPath) : 0;
  corefs_fd dir;
  int e;
  if (n == 0) {
    strcpy(zDir, "/");
  } else {
    if (n > CFS_MAX_PATHNAME) return SQLITE_IOERR_DIR_FSYNC;
    memcpy(zDir, zPath, n);
    zDir[n] = 0;
  }
  dir = corefs_open(fs, zDir, COREFS_O_RDONLY | COREFS_O_DIRECTORY, 0);
  if (dir < 0) return cfs_fail(SQLITE_IOERR_DIR_FSYNC, "corefs_open", zDir, dir);
  e = corefs_fsync(fs, dir);
  corefs_release(fs, dir);
  if (e < 0) return cfs_fail(SQLITE_IOERR_DIR_FSYNC, "corefs_fsync", zDir, e);
  return SQLITE_OK;
}

static int cfs_delete(sqlite3_vfs *pVfs, const char *zName, int dirSync) {
  corefs_fs fs;
  int rc, e;

  (void)pVfs;
  (void)dirSync;
  rc = cfs_mounted(&fs);
  if (rc != SQLITE_OK) return SQLITE_IOERR_DELETE;
  e = corefs_unlink(fs, zName);
  if (e == -ENOENT) return SQLITE_IOERR_DELETE_NOENT;
  if (e < 0) return cfs_fail(SQLITE_IOERR_DELETE, "corefs_unlink", zName, e);
  /* The directory is synced whether or not SQLite asks (it does with synchronous=EXTRA only).
   * corefs runs inside this process, so a process crash loses whatever a power cut loses:
   * all that is not fsynced. Deleting the rollback journal is the commit of a transaction in
   * DELETE mode; if the unlink were lost, the next open would find the journal hot and roll
   * back a transaction that SQLite reported committed. */
  return cfs_sync_parent(fs, zName);
}

static int cfs_access(sqlite3_vfs *pVfs, const char *zName, int flags, int *pResOut) {
  corefs_fs fs;
  struct corefs_stat st;
  int rc, e;

  (void)pVfs;
  *pResOut = 0;
  rc = cfs_mounted(&fs);
  if (rc != SQLITE_OK) return SQLITE_IOERR_ACCESS;
  e = corefs_stat(fs, zName, &st);
  if (e == -ENOENT || e == -ENOTDIR) return SQLITE_OK;
  if (e < 0) return cfs_fail(SQLITE_IOERR_ACCESS, "corefs_stat", zName, e);
  if (flags == SQLITE_ACCESS_EXISTS) {
    /* As os_unix.c: an empty regular file (a journal) does not count. */
    *pResOut = (st.mode & 0170000) != 0100000 || st.size > 0;
  } else {
    *pResOut = 1;
  }
  return SQLITE_OK;
}

static int cfs_full_pathname(sqlite3_vfs *pVfs, const char *zName, int nOut, char *zOut) {
  (void)pVfs;
  if ((int)strlen(zName) + 2 > nOut) return SQLITE_CANTOPEN;
  if (zName[0] == '/') {
    sqlite3_snprintf(nOut, zOut, "%s", zName);
  } else {
    sqlite3_snprintf(nOut, zOut, "/%s", zName);
  }
  return SQLITE_OK;
}

static void *cfs_dl_open(sqlite3_vfs *pVfs, const char *zPath) {
  (void)pVfs;
  return g_default_vfs->xDlOpen(g_default_vfs, zPath);
}

static void cfs_dl_error(sqlite3_vfs *pVfs, int nByte, char *zErrMsg) {
  (void)pVfs;
  g_default_vfs->xDlError(g_default_vfs, nByte, zErrMsg);
}

static void (*cfs_dl_sym(sqlite3_vfs *pVfs, void *pHandle, const char *zSymbol))(void) {
  (void)pVfs;
  return g_default_vfs->xDlSym(g_default_vfs, pHandle, zSymbol);
}

static void cfs_dl_close(sqlite3_vfs *pVfs, void *pHandle) {
  (void)pVfs;
  g_default_vfs->xDlClose(g_default_vfs, pHandle);
}

static int cfs_randomness(sqlite3_vfs *pVfs, int nByte, char *zOut) {
  (void)pVfs;
  return g_default_vfs->xRandomness(g_default_vfs, nByte, zOut);
}

static int cfs_sleep(sqlite3_vfs *pVfs, int microseconds) {
  (void)pVfs;
  return g_default_vfs->xSleep(g_default_vfs, microseconds);
}

static int cfs_current_time(sqlite3_vfs *pVfs, double *pTime) {
  (void)pVfs;
  return g_default_vfs->xCurrentTime(g_default_vfs, pTime);
}

static int cfs_get_last_error(sqlite3_vfs *pVfs, int nByte, char *zErrMsg) {
  (void)pVfs;
  if (g_default_vfs->xGetLastError) {
    return g_default_vfs->xGetLastError(g_default_vfs, nByte, zErrMsg);
  }
  return 0;
}

static int cfs_current_time_int64(sqlite3_vfs *pVfs, sqlite3_int64 *pTime) {
  (void)pVfs;
  if (g_default_vfs->iVersion >= 2 && g_default_vfs->xCurrentTimeInt64) {
    return g_default_vfs->xCurrentTimeInt64(g_default_vfs, pTime);
  } else {
    double t;
    int rc = g_default_vfs->xCurrentTime(g_default_vfs, &t);
    *pTime = (sqlite3_int64)(t * 86400000.0);
    return rc;
  }
}

#ifdef COREFS_VFS_STATIC
CFS_PROF_WRAP(P_OPEN, cfs_open,
              (sqlite3_vfs * v, const char *z, sqlite3_file *f, int flags, int *out),
              (v, z, f, flags, out))
CFS_PROF_WRAP(P_DELETE, cfs_delete, (sqlite3_vfs * v, const char *z, int dirSync), (v, z, dirSync))
CFS_PROF_WRAP(P_ACCESS, cfs_access, (sqlite3_vfs * v, const char *z, int flags, int *out),
              (v, z, flags, out))

void corefs_vfs_profile(FILE *out, long long transactions);
/* Reports the profile per transaction (nothing unless COREFS_VFS_PROFILE=1). */
void corefs_vfs_profile(FILE *out, long long transactions) {
  struct corefs_stats st;
  double n = transactions > 0 ? (double)transactions : 1.0;
  int k;
  if (!g_prof_on) return;
  fprintf(out, "profile: %lld transactions; per transaction, client side (VFS calls into corefs):\n",
          transactions);
  for (k = 0; k < P_N; k++) {
    if (g_prof_calls[k] == 0) continue;
    fprintf(out, "  %-13s %6.2f calls %8.1f us (%.1f us each)\n", g_prof_names[k],
            (double)g_prof_calls[k] / n, (double)g_prof_ns[k] / n / 1e3,
            (double)g_prof_ns[k] / (double)g_prof_calls[k] / 1e3);
  }
  if (g_fs > 0 && corefs_get_stats(g_fs, &st) == 0) {
    fprintf(out,
            "  reactor: %.2f ops, %.1f us CPU, %.2f fsyncs (p50 %.1f us, p99 %.1f us), %.2f log "
            "writes, %.3f commits, per transaction\n",
            (double)st.ops / n, (double)st.reactor_cpu_ns / n / 1e3, (double)st.fsyncs / n,
            (double)st.fsync_p50_ns / 1e3, (double)st.fsync_p99_ns / 1e3,
            (double)st.log_writes / n, (double)st.commits / n);
  }
}
#endif

static sqlite3_vfs cfs_vfs = {
    2,                      /* iVersion */
    sizeof(CfsFile),        /* szOsFile */
    CFS_MAX_PATHNAME,       /* mxPathname */
    0,                      /* pNext */
    CFS_VFS_NAME,           /* zName */
    0,                      /* pAppData */
    CFS_M(cfs_open),        /* xOpen */
    CFS_M(cfs_delete),      /* xDelete */
    CFS_M(cfs_access),      /* xAccess */
    cfs_full_pathname,      /* xFullPathname */
    cfs_dl_open,            /* xDlOpen */
    cfs_dl_error,           /* xDlError */
    cfs_dl_sym,             /* xDlSym */
    cfs_dl_close,           /* xDlClose */
    cfs_randomness,         /* xRandomness */
    cfs_sleep,              /* xSleep */
    cfs_current_time,       /* xCurrentTime */
    cfs_get_last_error,     /* xGetLastError */
    cfs_current_time_int64, /* xCurrentTimeInt64 */
    0,                      /* xSetSystemCall */
    0,                      /* xGetSystemCall */
    0,                      /* xNextSystemCall */
};

/* Registers the VFS (not as the default); registering again is harmless. */
static int cfs_register(void) {
  if (sqlite3_vfs_find(CFS_VFS_NAME) == &cfs_vfs) return SQLITE_OK;
  g_default_vfs = sqlite3_vfs_find(0);
  if (g_default_vfs == 0) return SQLITE_ERROR;
  return sqlite3_vfs_register(&cfs_vfs, 0);
}

#ifdef COREFS_VFS_STATIC

int corefs_vfs_register(void);
int corefs_vfs_register(void) {
  return cfs_register();
}

#else

/* Entry points: sqlite3_extension_init (the default), sqlite3_corefssqlite_init (what SQLite
 * derives from libcorefs_sqlite.so) and sqlite3_corefsvfs_init. */
int sqlite3_corefsvfs_init(sqlite3 *db, char **pzErrMsg, const sqlite3_api_routines *pApi);
int sqlite3_corefssqlite_init(sqlite3 *db, char **pzErrMsg, const sqlite3_api_routines *pApi);
int sqlite3_extension_init(sqlite3 *db, char **pzErrMsg, const sqlite3_api_routines *pApi);

int sqlite3_corefsvfs_init(sqlite3 *db, char **pzErrMsg, const sqlite3_api_routines *pApi) {
  int rc;
  (void)db;
  SQLITE_EXTENSION_INIT2(pApi);
  rc = cfs_register();
  if (rc != SQLITE_OK) {
    if (pzErrMsg) *pzErrMsg = sqlite3_mprintf("corefs vfs: registration failed (%d)", rc);
    return rc;
  }
  return SQLITE_OK_LOAD_PERMANENTLY;
}

int sqlite3_corefssqlite_init(sqlite3 *db, char **pzErrMsg, const sqlite3_api_routines *pApi) {
  return sqlite3_corefsvfs_init(db, pzErrMsg, pApi);
}

int sqlite3_extension_init(sqlite3 *db, char **pzErrMsg, const sqlite3_api_routines *pApi) {
  return sqlite3_corefsvfs_init(db, pzErrMsg, pApi);
}

#endif
