/* test_sqlite.c - tests and benchmarks the corefs SQLite VFS (corefs_vfs.c, compiled in with
 * -DCOREFS_VFS_STATIC). The filesystem comes from COREFS_DEVICE (and COREFS_FORMAT=1).
 *
 *   test_sqlite write <wal|delete|batch> <N>
 *                                         N transactions on /t.db, printing "committed <k>"
 *   test_sqlite version                   the linked SQLite's version
 *   test_sqlite check <K>                 integrity and content of /t.db, at least K rows
 *   test_sqlite tear <N> <K>              batch mode: N transactions, then a power cut inside
 *                                         the next one's batch, after its K-th page write and
 *                                         a filesystem commit (needs cache=volatile); then
 *                                         "check N" must find exactly N rows, consistent
 *   test_sqlite bench <wal|delete|batch> <seconds> <dir|corefs>
 *                                         one-row transactions for that long; prints
 *                                         "tps <n> p50_us <x> p99_us <y>" (per-transaction
 *                                         latency percentiles)
 *
 * Modes: wal; delete (rollback journal, with the VFS's batch atomic writes turned off:
 * COREFS_BATCH_ATOMIC=0); batch (rollback journal with batch atomic writes: no journal is
 * written, each transaction is one corefs atomic batch — needs an SQLite built with
 * SQLITE_ENABLE_BATCH_ATOMIC_WRITE, which scripts/sqlite-build.sh compiles in, and checks that
 * every transaction used a batch).
 */
#include <sqlite3.h>

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int corefs_vfs_register(void);
unsigned long long corefs_vfs_atomic_commits(void);
unsigned long long corefs_vfs_syncs_skipped(void);
void corefs_vfs_wal_writes(unsigned long long *calls, unsigned long long *sent);
void corefs_vfs_tear_after_writes(int n);
void corefs_vfs_profile(FILE *out, long long transactions);

#define DB_URI "file:/t.db?vfs=corefs"
#define V_LEN 100

static void die(const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "test_sqlite: ");
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n");
  exit(1);
}

static void log_callback(void *arg, int code, const char *msg) {
  (void)arg;
  /* SQLITE_NOTICE / WARNING (e.g. recovered frames) are informational. */
  if ((code & 0xff) == SQLITE_NOTICE || (code & 0xff) == SQLITE_WARNING) return;
  fprintf(stderr, "sqlite log (%d): %s\n", code, msg);
}

/* The 100-byte value of row `id`. */
static void make_v(long long id, char *out) {
  int n = snprintf(out, V_LEN + 1, "row-%010lld-", id);
  for (int j = n; j < V_LEN; j++) out[j] = (char)('a' + (id * 31 + j) % 26);
  out[V_LEN] = 0;
}

static sqlite3 *open_db(const char *uri, int flags) {
  sqlite3 *db = 0;
  int rc = sqlite3_open_v2(uri, &db, flags | SQLITE_OPEN_URI, 0);
  if (rc != SQLITE_OK) {
    die("open %s: %s (%d)", uri, db ? sqlite3_errmsg(db) : "no memory", rc);
  }
  sqlite3_extended_result_codes(db, 1);
  return db;
}

static void exec(sqlite3 *db, const char *sql) {
  char *err = 0;
  int rc = sqlite3_exec(db, sql, 0, 0, &err);
  if (rc != SQLITE_OK) die("%s: %s (%d)", sql, err ? err : sqlite3_errmsg(db), rc);
}

/* Runs `sql`, expecting rc. */
static void exec_expect(sqlite3 *db, const char *sql, int expected) {
  int rc = sqlite3_exec(db, sql, 0, 0, 0);
  if (rc != expected) {
    die("%s: expected result %d, got %d (%s)", sql, expected, rc, sqlite3_errmsg(db));
  }
}

/* The first column of the first row of `sql`, as an integer. */
static long long query_int(sqlite3 *db, const char *sql) {
  sqlite3_stmt *st;
  long long v;
  int rc = sqlite3_prepare_v2(db, sql, -1, &st, 0);
  if (rc != SQLITE_OK) die("prepare %s: %s (%d)", sql, sqlite3_errmsg(db), rc);
  rc = sqlite3_step(st);
  if (rc != SQLITE_ROW) die("%s: %s (%d)", sql, sqlite3_errmsg(db), rc);
  v = sqlite3_column_int64(st, 0);
  sqlite3_finalize(st);
  return v;
}

/* The first column of the first row of `sql`, as text, into out. */
static void query_text(sqlite3 *db, const char *sql, char *out, size_t size) {
  sqlite3_stmt *st;
  int rc = sqlite3_prepare_v2(db, sql, -1, &st, 0);
  if (rc != SQLITE_OK) die("prepare %s: %s (%d)", sql, sqlite3_errmsg(db), rc);
  rc = sqlite3_step(st);
  if (rc != SQLITE_ROW) die("%s: %s (%d)", sql, sqlite3_errmsg(db), rc);
  snprintf(out, size, "%s", (const char *)sqlite3_column_text(st, 0));
  sqlite3_finalize(st);
}

/* Runs `sql` (a single-row query), expecting rc from the first step. */
static void query_expect(sqlite3 *db, const char *sql, int expected) {
  sqlite3_stmt *st;
  int rc = sqlite3_prepare_v2(db, sql, -1, &st, 0);
  if (rc == SQLITE_OK) rc = sqlite3_step(st);
  sqlite3_finalize(st);
  if (rc != expected) {
    die("%s: expected result %d, got %d (%s)", sql, expected, rc, sqlite3_errmsg(db));
  }
}

static void integrity_ok(sqlite3 *db) {
  char text[256];
  query_text(db, "PRAGMA integrity_check", text, sizeof(text));
  if (strcmp(text, "ok") != 0) die("integrity_check: %s", text);
}

/* The journal mode a test mode runs in; also sets up the VFS for it (before the first open,
 * which mounts) and checks that batch mode can work. */
static const char *journal_of(const char *mode) {
  if (strcmp(mode, "wal") == 0) return "wal";
  if (strcmp(mode, "delete") == 0) {
    setenv("COREFS_BATCH_ATOMIC", "0", 0);
    return "delete";
  }
  if (strcmp(mode, "batch") == 0) {
    if (!sqlite3_compileoption_used("ENABLE_BATCH_ATOMIC_WRITE")) {
      die("batch mode needs an SQLite built with SQLITE_ENABLE_BATCH_ATOMIC_WRITE (%s is not)",
          sqlite3_libversion());
    }
    return "delete";
  }
  die("mode must be wal, delete or batch, not %s", mode);
  return 0;
}

/* In batch mode, at least `min` transactions must have committed as atomic batches. */
static void batches_used(const char *mode, long long min) {
  if (strcmp(mode, "batch") == 0 && (long long)corefs_vfs_atomic_commits() < min) {
    die("%llu atomic batches for %lld transactions: SQLite wrote a journal instead",
        corefs_vfs_atomic_commits(), min);
  }
}

static void set_journal_mode(sqlite3 *db, const char *mode) {
  char sql[64], text[64];
  snprintf(sql, sizeof(sql), "PRAGMA journal_mode=%s", mode);
  query_text(db, sql, text, sizeof(text));
  if (strcmp(text, mode) != 0) die("%s returned %s", sql, text);
}

typedef struct Writer {
  sqlite3 *db;
  sqlite3_stmt *insert;
  sqlite3_stmt *update;
} Writer;

static void writer_prepare(Writer *w, sqlite3 *db) {
  w->db = db;
  if (sqlite3_prepare_v2(db, "INSERT INTO t(id, v, n) VALUES(?1, ?2, ?3)", -1, &w->insert, 0) ||
      sqlite3_prepare_v2(db, "UPDATE agg SET cnt = cnt + 1, total = total + ?1 WHERE k = 1",
                         -1, &w->update, 0)) {
    die("prepare: %s", sqlite3_errmsg(db));
  }
}

static void step_done(sqlite3 *db, sqlite3_stmt *st) {
  int rc = sqlite3_step(st);
  if (rc != SQLITE_DONE) die("%s: %s (%d)", sqlite3_sql(st), sqlite3_errmsg(db), rc);
  sqlite3_reset(st);
}

/* BEGIN, insert row id, update the aggregate (COMMIT is up to the caller). */
static void writer_body(Writer *w, long long id) {
  char v[V_LEN + 1];
  make_v(id, v);
  exec(w->db, "BEGIN");
  sqlite3_bind_int64(w->insert, 1, id);
  sqlite3_bind_text(w->insert, 2, v, V_LEN, SQLITE_TRANSIENT);
  sqlite3_bind_int64(w->insert, 3, id * 7);
  step_done(w->db, w->insert);
  sqlite3_bind_int64(w->update, 1, id * 7);
  step_done(w->db, w->update);
}

static void committed(long long id) {
  printf("committed %lld\n", id);
  fflush(stdout);
}

static int phase_write(const char *mode, long long n) {
  const char *journal = journal_of(mode);
  int wal = strcmp(mode, "wal") == 0;
  int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE;
  sqlite3 *db = open_db(DB_URI, flags);
  sqlite3 *reader;
  Writer w;
  long long id, busy_checks = 0, snapshot_checks = 0;

  sqlite3_busy_timeout(db, 5000);
  set_journal_mode(db, journal);
  exec(db, "PRAGMA synchronous=FULL");
  exec(db,
       "CREATE TABLE IF NOT EXISTS t(id INTEGER PRIMARY KEY, v TEXT, n INTEGER);"
       "CREATE TABLE IF NOT EXISTS agg(k INTEGER PRIMARY KEY, cnt INTEGER, total INTEGER);"
       "INSERT OR IGNORE INTO agg VALUES(1, 0, 0);");
  if (query_int(db, "SELECT count(*) FROM t") != 0) die("/t.db is not empty");

  /* A second connection of the same process. */
  reader = open_db(DB_URI, SQLITE_OPEN_READWRITE);
  sqlite3_busy_timeout(reader, 5000);
  writer_prepare(&w, db);

  for (id = 1; id <= n; id++) {
    if (id % 97 == 0 && wal) {
      /* A reader holds a read transaction while the writer commits: it keeps its snapshot. */
      long long before, after;
      exec(reader, "BEGIN");
      before = query_int(reader, "SELECT count(*) FROM t");
      if (before != id - 1) die("reader sees %lld rows, expected %lld", before, id - 1);
      writer_body(&w, id);
      exec(db, "COMMIT");
      committed(id);
      after = query_int(reader, "SELECT count(*) FROM t");
      if (after != before) die("reader's snapshot moved from %lld to %lld", before, after);
      exec(reader, "COMMIT");
      after = query_int(reader, "SELECT count(*) FROM t");
      if (after != id) die("reader sees %lld rows after its transaction, expected %lld", after, id);
      snapshot_checks++;
    } else if (id % 97 == 0) {
      /* Rollback journal: a reader's SHARED lock keeps the writer from committing (BUSY,
       * leaving it PENDING), PENDING keeps new readers out, and the commit goes through once
       * the reader is gone. */
      sqlite3_busy_timeout(reader, 0);
      sqlite3_busy_timeout(db, 0);
      exec(reader, "BEGIN");
      if (query_int(reader, "SELECT count(*) FROM t") != id - 1) die("reader: wrong count");
      writer_body(&w, id);
      exec_expect(db, "COMMIT", SQLITE_BUSY);
      exec(reader, "COMMIT");
      query_expect(reader, "SELECT count(*) FROM t", SQLITE_BUSY);
      exec(db, "COMMIT");
      committed(id);
      if (query_int(reader, "SELECT count(*) FROM t") != id) die("reader: wrong count after");
      sqlite3_busy_timeout(reader, 5000);
      sqlite3_busy_timeout(db, 5000);
      busy_checks++;
    } else {
      writer_body(&w, id);
      exec(db, "COMMIT");
      committed(id);
      if (id == 50) batches_used(mode, 40);
      if (id % 10 == 0) {
        long long c = query_int(reader, "SELECT count(*) FROM t");
        if (c != id) die("reader sees %lld rows, expected %lld", c, id);
      }
    }
  }

  sqlite3_finalize(w.insert);
  sqlite3_finalize(w.update);
  integrity_ok(db);
  batches_used(mode, n - n / 97);
  /* SQLite syncs the database right after each batch's commit, which made it durable
   * already: the VFS answers that sync without a call (one fsync per transaction, not two). */
  if (strcmp(mode, "batch") == 0 && (long long)corefs_vfs_syncs_skipped() < n - n / 97) {
    die("%llu syncs skipped for %lld batch transactions, expected one each",
        corefs_vfs_syncs_skipped(), n);
  }
  if (wal) {
    /* Each WAL frame is written by SQLite as its header then its page: the VFS sends both
     * in one corefs write (cfs_write), so at most a little over half the calls reach
     * corefs. */
    unsigned long long calls, sent;
    corefs_vfs_wal_writes(&calls, &sent);
    if (calls < (unsigned long long)n || sent * 10 > calls * 6) {
      die("%llu WAL writes took %llu corefs writes: frames were not written whole", calls, sent);
    }
    fprintf(stderr, "test_sqlite: %llu WAL writes, %llu corefs writes\n", calls, sent);
  }
  if (query_int(reader, "SELECT cnt FROM agg WHERE k = 1") != n) die("agg.cnt is wrong");
  if (sqlite3_close(reader) != SQLITE_OK) die("close reader: %s", sqlite3_errmsg(reader));
  if (sqlite3_close(db) != SQLITE_OK) die("close: %s", sqlite3_errmsg(db));
  fprintf(stderr,
          "test_sqlite: write %s: %lld transactions, %lld busy checks, %lld snapshot checks, "
          "%llu atomic batches, %llu needless syncs skipped\n",
          mode, n, busy_checks, snapshot_checks, corefs_vfs_atomic_commits(),
          corefs_vfs_syncs_skipped());
  return 0;
}

/* Batch mode: n committed transactions, then one more whose batch the VFS cuts after its
 * k-th page write (corefs_vfs_tear_after_writes): the process ends inside that write. A
 * transaction here writes page 1 (its change counter), t's leaf and agg's page, in page
 * order: with k = 2, a batch whose writes reached the filesystem one by one leaves the
 * committed image with the new row but the old agg (or the reverse), which check catches. */
static int phase_tear(long long n, int k) {
  const char *journal = journal_of("batch");
  sqlite3 *db = open_db(DB_URI, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE);
  Writer w;
  long long id;

  set_journal_mode(db, journal);
  exec(db, "PRAGMA synchronous=FULL");
  exec(db,
       "CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT, n INTEGER);"
       "CREATE TABLE agg(k INTEGER PRIMARY KEY, cnt INTEGER, total INTEGER);"
       "INSERT INTO agg VALUES(1, 0, 0);");
  writer_prepare(&w, db);
  for (id = 1; id <= n; id++) {
    writer_body(&w, id);
    exec(db, "COMMIT");
    committed(id);
  }
  batches_used("batch", n);
  corefs_vfs_tear_after_writes(k);
  writer_body(&w, n + 1);
  exec(db, "COMMIT");
  /* Reached only when the batch had fewer than k writes: the test would prove nothing. */
  die("transaction %lld committed without reaching write %d of its batch", n + 1, k);
  return 1;
}

static int phase_check(long long min) {
  sqlite3 *db = open_db(DB_URI, SQLITE_OPEN_READWRITE);
  sqlite3_stmt *st;
  long long count, expect_id = 1, sum = 0;
  char v[V_LEN + 1];
  int rc;

  sqlite3_busy_timeout(db, 5000);
  integrity_ok(db);
  count = query_int(db, "SELECT count(*) FROM t");
  if (count < min) die("%lld rows, expected at least %lld", count, min);
  if (sqlite3_prepare_v2(db, "SELECT id, v, n FROM t ORDER BY id", -1, &st, 0)) {
    die("prepare: %s", sqlite3_errmsg(db));
  }
  while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
    long long id = sqlite3_column_int64(st, 0);
    const char *text = (const char *)sqlite3_column_text(st, 1);
    long long nval = sqlite3_column_int64(st, 2);
    if (id != expect_id) die("row id %lld, expected %lld", id, expect_id);
    make_v(id, v);
    if (text == 0 || sqlite3_column_bytes(st, 1) != V_LEN || memcmp(text, v, V_LEN) != 0) {
      die("row %lld: wrong v", id);
    }
    if (nval != id * 7) die("row %lld: n = %lld, expected %lld", id, nval, id * 7);
    sum += nval;
    expect_id++;
  }
  if (rc != SQLITE_DONE) die("select: %s (%d)", sqlite3_errmsg(db), rc);
  sqlite3_finalize(st);
  if (expect_id - 1 != count) die("read %lld rows, count(*) says %lld", expect_id - 1, count);
  if (query_int(db, "SELECT cnt FROM agg WHERE k = 1") != count) die("agg.cnt != count(*)");
  if (query_int(db, "SELECT total FROM agg WHERE k = 1") != sum) die("agg.total != sum(n)");
  if (sqlite3_close(db) != SQLITE_OK) die("close: %s", sqlite3_errmsg(db));
  printf("ok %lld\n", count);
  fflush(stdout);
  return 0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* The q-quantile (0 < q < 1) of n sorted values, by the nearest-rank rule. */
static uint64_t quantile(const uint64_t *sorted, size_t n, double q) {
  size_t rank = (size_t)(q * (double)n + 0.999999);
  if (rank < 1) rank = 1;
  if (rank > n) rank = n;
  return sorted[rank - 1];
}

static int phase_bench(const char *mode, double seconds, const char *where) {
  const char *journal = journal_of(mode);
  int corefs = strcmp(where, "corefs") == 0;
  char path[4096], uri[4200], v[V_LEN + 1];
  sqlite3 *db;
  sqlite3_stmt *insert;
  long long n = 0;
  double start, elapsed, before;
  /* Each transaction's latency in ns; grown by doubling. */
  uint64_t *latency_ns = 0;
  size_t latency_cap = 0;

  if (corefs) {
    snprintf(path, sizeof(path), "/bench.db");
    snprintf(uri, sizeof(uri), "file:/bench.db?vfs=corefs");
  } else {
    snprintf(path, sizeof(path), "%s/bench-%d.db", where, (int)getpid());
    snprintf(uri, sizeof(uri), "file:%s", path);
  }
  db = open_db(uri, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE);
  set_journal_mode(db, journal);
  exec(db, "PRAGMA synchronous=FULL");
  exec(db, "CREATE TABLE IF NOT EXISTS b(id INTEGER PRIMARY KEY, v TEXT)");
  if (sqlite3_prepare_v2(db, "INSERT INTO b(v) VALUES(?1)", -1, &insert, 0)) {
    die("prepare: %s", sqlite3_errmsg(db));
  }
  start = now_s();
  before = start;
  do {
    double after;
    make_v(n, v);
    sqlite3_bind_text(insert, 1, v, V_LEN, SQLITE_TRANSIENT);
    step_done(db, insert); /* autocommit: one transaction per row */
    after = now_s();
    if ((size_t)n == latency_cap) {
      latency_cap = latency_cap ? 2 * latency_cap : 65536;
      latency_ns = realloc(latency_ns, latency_cap * sizeof(*latency_ns));
      if (latency_ns == 0) die("out of memory for %zu latencies", latency_cap);
    }
    latency_ns[n] = (uint64_t)((after - before) * 1e9);
    before = after;
    n++;
    elapsed = after - start;
  } while (elapsed < seconds);
  sqlite3_finalize(insert);
  if (corefs) batches_used(mode, n - 1);
  if (corefs) corefs_vfs_profile(stderr, n); /* COREFS_VFS_PROFILE=1 */
  if (sqlite3_close(db) != SQLITE_OK) die("close: %s", sqlite3_errmsg(db));

  {
    static const char *suffixes[] = {"", "-wal", "-shm", "-journal"};
    sqlite3_vfs *vfs = sqlite3_vfs_find(corefs ? "corefs" : 0);
    for (size_t i = 0; i < sizeof(suffixes) / sizeof(suffixes[0]); i++) {
      char file[4200];
      snprintf(file, sizeof(file), "%s%s", path, suffixes[i]);
      vfs->xDelete(vfs, file, 0);
    }
  }
  qsort(latency_ns, (size_t)n, sizeof(*latency_ns), cmp_u64);
  printf("tps %.0f p50_us %.1f p99_us %.1f\n", (double)n / elapsed,
         (double)quantile(latency_ns, (size_t)n, 0.50) / 1e3,
         (double)quantile(latency_ns, (size_t)n, 0.99) / 1e3);
  free(latency_ns);
  fflush(stdout);
  return 0;
}

int main(int argc, char **argv) {
  int rc;
  sqlite3_config(SQLITE_CONFIG_LOG, log_callback, (void *)0);
  rc = corefs_vfs_register();
  if (rc != SQLITE_OK) die("corefs_vfs_register: %d", rc);
  if (argc == 4 && strcmp(argv[1], "write") == 0) {
    long long n = atoll(argv[3]);
    if (n < 1) die("N must be at least 1");
    return phase_write(argv[2], n);
  }
  if (argc == 2 && strcmp(argv[1], "version") == 0) {
    printf("%s%s\n", sqlite3_libversion(),
           sqlite3_compileoption_used("ENABLE_BATCH_ATOMIC_WRITE")
               ? " (SQLITE_ENABLE_BATCH_ATOMIC_WRITE)"
               : "");
    return 0;
  }
  if (argc == 3 && strcmp(argv[1], "check") == 0) return phase_check(atoll(argv[2]));
  if (argc == 4 && strcmp(argv[1], "tear") == 0) {
    long long n = atoll(argv[2]);
    int k = atoi(argv[3]);
    if (n < 1 || k < 1) die("N and K must be at least 1");
    return phase_tear(n, k);
  }
  if (argc == 5 && strcmp(argv[1], "bench") == 0) {
    double seconds = atof(argv[3]);
    if (seconds <= 0) die("seconds must be positive");
    return phase_bench(argv[2], seconds, argv[4]);
  }
  fprintf(stderr,
          "usage: %s version | write <wal|delete|batch> <N> | check <K> | tear <N> <K> | bench <wal|delete|batch> <seconds> "
          "<dir|corefs>\n",
          argv[0]);
  return 2;
}
