/* corefs_fio.c - a fio external ioengine for corefs (libcorefs_fio.so).
 *
 *   fio --name=j --ioengine=external:/path/libcorefs_fio.so \
 *       --corefs_dev=file:/var/tmp/fs.img,size=4GiB --corefs_format=1 \
 *       --filename=/bench/j --size=1g --rw=randread --bs=4k --iodepth=32
 *
 * The job's files are paths inside the corefs filesystem on the device `corefs_dev` names
 * (`nvme:/dev/ng0n1`, `file:/path`, `mem:SIZE`); nothing touches the host filesystem. Reads,
 * writes, fsync and fdatasync are submitted with corefs's asynchronous calls
 * (corefs_submit_pread/_pwrite/_fsync) and reaped with corefs_poll, so fio's iodepth is the
 * number in flight. Trim is corefs_fallocate(PUNCH_HOLE | KEEP_SIZE), synchronous: the C ABI
 * has no asynchronous trim (FIO_ASYNCIO_SYNC_TRIM tells fio so).
 *
 * Mounts. A device may be mounted once at a time (corefs holds it exclusively), so every job of
 * one process on the same device shares one mount, reference-counted: jobs as threads
 * (thread=1) share it; jobs as processes (fio's default) each mount in their own process, so
 * only one job per device may run at a time there (a second fails with EBUSY, and the message
 * says to use thread=1). fio sizes and lays out files in its parent process before it forks
 * the jobs (create_serialize=1): there the engine mounts for the moment it needs (stat, the
 * layout) and closes again, which commits, so a job starts on a fresh mount with durable data
 * and cold caches.
 *
 * Layout. A job that reads (or overwrites) a file shorter than its size gets the file written
 * whole first, as fio lays out a file on a kernel filesystem (fio's buffer contents, then
 * fsync when create_fsync is set, as it is by default); a write-only job starts from an empty
 * file, which fio would unlink and recreate.
 *
 * Errors are fio's: a negative errno from corefs becomes io_u->error (or td_verror) and the
 * message of corefs_last_error() is logged. Nothing here panics or exits; corefs_close at the
 * end of the last job on a device commits.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fio.h"
#include "optgroup.h"

#include "corefs.h"

/* The engine was written against this ioengine ABI (fio 3.33). */
_Static_assert(FIO_IOOPS_VERSION == 31, "fio ioengine ABI version 31 (fio 3.33)");

/* Operations one thread may have in flight on one filesystem (corefs's per-thread queue). */
#define COREFS_FIO_INFLIGHT_MAX 256
/* Devices one fio run may use at once. */
#define COREFS_FIO_MOUNTS_MAX 16
/* Layout writes this much at a time at least. */
#define COREFS_FIO_LAYOUT_CHUNK (1u << 20)

struct corefs_fio_options {
	void *pad; /* fio: an option's offset must not be 0 */
	char *dev;
	unsigned int format;
	unsigned int shards;
	unsigned int reactors;
	char *core;
	unsigned int busy_poll;
	unsigned int commit_interval_ms;
	unsigned int stats;
	unsigned int data_cache;
};

static struct fio_option options[] = {
	{
		.name = "corefs_dev",
		.lname = "corefs device",
		.type = FIO_OPT_STR_STORE,
		.off1 = offsetof(struct corefs_fio_options, dev),
		.help = "Device holding the corefs filesystem (nvme:/dev/ng0n1, file:/path, mem:SIZE)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "corefs_format",
		.lname = "corefs format",
		.type = FIO_OPT_BOOL,
		.off1 = offsetof(struct corefs_fio_options, format),
		.help = "Format the device at its first mount in this fio run (destroys its content)",
		.def = "0",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "corefs_shards",
		.lname = "corefs shards",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct corefs_fio_options, shards),
		/* 0: the library's default. Shards share the device's space (block groups), so a
		 * file may use all of it whatever their number. */
		.help = "Shards when formatting (0: the library's default, 64)",
		.def = "0",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "corefs_reactors",
		.lname = "corefs reactors",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct corefs_fio_options, reactors),
		.help = "Reactor threads serving the filesystem (0: one)",
		.def = "0",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "corefs_core",
		.lname = "corefs core",
		.type = FIO_OPT_STR_STORE,
		.off1 = offsetof(struct corefs_fio_options, core),
		.help = "Pin the reactors to cores N, N+1, ... (unset: not pinned)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "corefs_busy_poll",
		.lname = "corefs busy poll",
		.type = FIO_OPT_BOOL,
		.off1 = offsetof(struct corefs_fio_options, busy_poll),
		.help = "Reactors busy-poll (a dedicated core each) instead of spinning then parking",
		.def = "0",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "corefs_commit_interval_ms",
		.lname = "corefs commit interval",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct corefs_fio_options, commit_interval_ms),
		.help = "Commit interval in milliseconds (0: corefs's default, 5000)",
		.def = "0",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "corefs_data_cache",
		.lname = "corefs data cache",
		.type = FIO_OPT_BOOL,
		.off1 = offsetof(struct corefs_fio_options, data_cache),
		.help = "corefs keeps a data-block cache (0: every read of committed data goes to the "
			"device, as direct=1 reads on a kernel filesystem do)",
		.def = "1",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "corefs_stats",
		.lname = "corefs stats",
		.type = FIO_OPT_BOOL,
		.off1 = offsetof(struct corefs_fio_options, stats),
		.help = "Print corefs's engine figures (commits, log writes, fsync groups) at unmount",
		.def = "0",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = NULL,
	},
};

/* One mounted device, shared by the jobs of this process that name it. */
struct shared_mount {
	char *dev; /* NULL: a free slot */
	corefs_fs fs;
	unsigned int users;
	unsigned int stats;
};

static pthread_mutex_t mounts_lock = PTHREAD_MUTEX_INITIALIZER;
static struct shared_mount mounts[COREFS_FIO_MOUNTS_MAX];
/* Devices already formatted in this run (corefs_format=1 formats once, at the first mount;
 * fork copies the list to the jobs the parent starts after its layout mount). */
static char *formatted[COREFS_FIO_MOUNTS_MAX];

/* Per job (thread or process). */
struct corefs_td {
	corefs_fs fs;
	/* Operations submitted and not yet reaped, at most `inflight_max`. */
	unsigned int queued;
	unsigned int inflight_max;
	/* getevents' results, handed out by event(). */
	struct io_u **events;
	struct corefs_completion *completions;
	unsigned int events_max;
};

static struct corefs_fio_options *opts_of(struct thread_data *td)
{
	return td->eo;
}

static bool was_formatted(const char *dev)
{
	for (int i = 0; i < COREFS_FIO_MOUNTS_MAX; i++)
		if (formatted[i] && !strcmp(formatted[i], dev))
			return true;
	return false;
}

static void note_formatted(const char *dev)
{
	for (int i = 0; i < COREFS_FIO_MOUNTS_MAX; i++) {
		if (!formatted[i]) {
			formatted[i] = strdup(dev);
			return;
		}
	}
}

/* Mounts the job's device, or takes another reference to this process's mount of it (`job`:
 * the job's own mount, whose figures corefs_stats=1 prints, rather than a moment's mount to
 * size or lay out files). Returns 0 and sets *fs, or an errno (reported through td_verror). */
static int mount_acquire(struct thread_data *td, corefs_fs *fs, bool job)
{
	struct corefs_fio_options *o = opts_of(td);
	struct corefs_options mo;
	struct shared_mount *slot = NULL;
	corefs_fs mounted;
	int err = 0;

	if (!o || !o->dev || !o->dev[0]) {
		log_err("corefs: corefs_dev= is required (e.g. corefs_dev=file:/var/tmp/fs.img,size=4GiB "
			"or corefs_dev=nvme:/dev/ng0n1); it must follow ioengine= in the job\n");
		td_verror(td, EINVAL, "corefs_dev");
		return EINVAL;
	}
	pthread_mutex_lock(&mounts_lock);
	for (int i = 0; i < COREFS_FIO_MOUNTS_MAX; i++) {
		if (mounts[i].dev && !strcmp(mounts[i].dev, o->dev)) {
			mounts[i].users++;
			mounts[i].stats |= job && o->stats;
			*fs = mounts[i].fs;
			goto out;
		}
		if (!mounts[i].dev && !slot)
			slot = &mounts[i];
	}
	if (!slot) {
		log_err("corefs: more than %d devices in one run\n", COREFS_FIO_MOUNTS_MAX);
		err = EMFILE;
		td_verror(td, err, "corefs_mount");
		goto out;
	}
	memset(&mo, 0, sizeof(mo));
	mo.format = o->format && !was_formatted(o->dev);
	mo.shards = o->shards;
	mo.busy_poll = o->busy_poll != 0;
	if (o->reactors > 255) {
		log_err("corefs: corefs_reactors=%u is more than 255\n", o->reactors);
		err = EINVAL;
		td_verror(td, err, "corefs_reactors");
		goto out;
	}
	mo.reactors = (uint8_t)o->reactors;
	mo.commit_interval_ms = o->commit_interval_ms;
	mo.data_cache_off = o->data_cache == 0;
	if (o->core && o->core[0]) {
		char *end;
		unsigned long core = strtoul(o->core, &end, 10);

		if (*end || core > UINT32_MAX) {
			log_err("corefs: corefs_core=%s is not a core number\n", o->core);
			err = EINVAL;
			td_verror(td, err, "corefs_core");
			goto out;
		}
		mo.pin = 1;
		mo.core = (uint32_t)core;
	}
	mounted = corefs_mount(o->dev, &mo);
	if (mounted < 0) {
		err = (int)-mounted;
		log_err("corefs: mounting %s: %s%s\n", o->dev, corefs_last_error(),
			err == EBUSY && !td->o.use_thread ?
				" (jobs on one device must share one mount: run them as threads, thread=1)" :
				"");
		td_verror(td, err, "corefs_mount");
		goto out;
	}
	if (mo.format)
		note_formatted(o->dev);
	slot->dev = strdup(o->dev);
	slot->fs = mounted;
	slot->users = 1;
	slot->stats = job && o->stats;
	*fs = mounted;
out:
	pthread_mutex_unlock(&mounts_lock);
	return err;
}

/* Drops a reference; the last one unmounts (which commits). */
static int mount_release(struct thread_data *td, corefs_fs fs)
{
	int err = 0;

	pthread_mutex_lock(&mounts_lock);
	for (int i = 0; i < COREFS_FIO_MOUNTS_MAX; i++) {
		struct shared_mount *m = &mounts[i];

		if (!m->dev || m->fs != fs)
			continue;
		if (--m->users == 0) {
			struct corefs_stats s;

			/* fio's JSON output goes to stdout: the figures then go to stderr. */
			if (m->stats && corefs_get_stats(fs, &s) == 0)
				(output_format & FIO_OUTPUT_NORMAL ? log_info : log_err)("corefs %s: %llu ops, %llu commits (max %.2f ms), %llu fsyncs in "
					 "%llu log writes (%llu fell back to a commit), fsync p50 %.1f us, "
					 "p99 %.1f us\n",
					 m->dev, (unsigned long long)s.ops, (unsigned long long)s.commits,
					 s.commit_ns_max / 1e6, (unsigned long long)s.fsyncs,
					 (unsigned long long)s.log_writes,
					 (unsigned long long)s.fallback_commits, s.fsync_p50_ns / 1e3,
					 s.fsync_p99_ns / 1e3);
			int rc = corefs_close(fs);

			if (rc < 0) {
				err = -rc;
				log_err("corefs: unmounting %s: %s\n", m->dev, corefs_last_error());
				if (td)
					td_verror(td, err, "corefs_close");
			}
			free(m->dev);
			m->dev = NULL;
		}
		break;
	}
	pthread_mutex_unlock(&mounts_lock);
	return err;
}

/* A fio file name as a corefs path: corefs paths are relative to the root. */
static const char *corefs_path(const struct fio_file *f)
{
	const char *p = f->file_name;

	while (*p == '/')
		p++;
	return p;
}

static int report(struct thread_data *td, int rc, const char *call, const char *path)
{
	int err = rc < 0 ? -rc : EIO;

	log_err("corefs: %s %s: %s\n", call, path, corefs_last_error());
	td_verror(td, err, call);
	return err;
}

/* Creates the directories above `path` (mkdir -p of its parent). */
static int make_parents(struct thread_data *td, corefs_fs fs, const char *path)
{
	char buf[4096];
	size_t len = strlen(path);

	if (len >= sizeof(buf)) {
		log_err("corefs: path %s is too long\n", path);
		td_verror(td, ENAMETOOLONG, "corefs path");
		return ENAMETOOLONG;
	}
	memcpy(buf, path, len + 1);
	for (char *slash = strchr(buf, '/'); slash; slash = strchr(slash + 1, '/')) {
		int rc;

		*slash = '\0';
		rc = buf[0] ? corefs_mkdir(fs, buf, 0755) : 0;
		*slash = '/';
		if (rc < 0 && rc != -EEXIST)
			return report(td, rc, "corefs_mkdir", path);
	}
	return 0;
}

/* Size of `path`, 0 when it does not exist. */
static int file_size(struct thread_data *td, corefs_fs fs, const char *path, uint64_t *size)
{
	struct corefs_stat st;
	int rc = corefs_stat(fs, path, &st);

	if (rc == -ENOENT) {
		*size = 0;
		return 0;
	}
	if (rc < 0)
		return report(td, rc, "corefs_stat", path);
	*size = st.size;
	return 0;
}

/* Writes `path` whole, `bytes` long, with fio's buffer contents (as fio lays out a file). */
static int lay_out(struct thread_data *td, corefs_fs fs, const char *path, uint64_t bytes)
{
	unsigned long long chunk = td->o.max_bs[DDIR_WRITE];
	uint64_t at = 0;
	corefs_fd fd;
	void *buf;
	int err = 0;

	if (chunk < COREFS_FIO_LAYOUT_CHUNK)
		chunk = COREFS_FIO_LAYOUT_CHUNK;
	if ((err = make_parents(td, fs, path)))
		return err;
	fd = corefs_open(fs, path, COREFS_O_RDWR | COREFS_O_CREAT | COREFS_O_TRUNC, 0644);
	if (fd < 0)
		return report(td, (int)fd, "corefs_open", path);
	buf = malloc(chunk);
	if (!buf) {
		td_verror(td, ENOMEM, "malloc");
		corefs_release(fs, fd);
		return ENOMEM;
	}
	while (at < bytes && !td->terminate) {
		unsigned long long n = bytes - at < chunk ? bytes - at : chunk;
		int64_t wrote;

		fill_io_buffer(td, buf, n, n);
		wrote = corefs_pwrite(fs, fd, buf, n, at);
		if (wrote != (int64_t)n) {
			err = report(td, wrote < 0 ? (int)wrote : -EIO, "corefs_pwrite (layout)", path);
			if (wrote == -ENOSPC)
				log_err("corefs: the device is full: the job's files need a larger one "
					"(corefs_dev=file:PATH,size=)\n");
			break;
		}
		at += n;
	}
	if (!err && td->o.create_fsync) {
		int rc = corefs_fsync(fs, fd);

		if (rc < 0)
			err = report(td, rc, "corefs_fsync (layout)", path);
	}
	free(buf);
	corefs_release(fs, fd);
	return err;
}

static int refuse_unsupported(struct thread_data *td)
{
	const char *what = NULL;

	if (td->o.fill_device)
		what = "fill_device";
	else if (td->o.pre_read)
		what = "pre_read";
	if (what) {
		log_err("corefs: %s is not supported by the corefs engine\n", what);
		td_verror(td, EINVAL, what);
		return EINVAL;
	}
	return 0;
}

/* Sizes the job's files from the filesystem (called before fio computes I/O sizes, in fio's
 * parent process unless create_serialize=0). */
static int corefs_setup(struct thread_data *td)
{
	struct fio_file *f;
	unsigned int i;
	corefs_fs fs;
	int err;

	if ((err = refuse_unsupported(td)))
		return err;
	if ((err = mount_acquire(td, &fs, false)))
		return err;
	for_each_file(td, f, i) {
		uint64_t size = 0;

		if ((err = file_size(td, fs, corefs_path(f), &size)))
			break;
		f->real_file_size = size;
		fio_file_set_size_known(f);
	}
	mount_release(td, fs);
	return err;
}

/* Lays the file out when the job needs its contents, or empties it for a job that only
 * writes; called once the file's I/O range is known. */
static int corefs_prepopulate_file(struct thread_data *td, struct fio_file *f)
{
	const char *path = corefs_path(f);
	uint64_t need = f->file_offset + f->io_size;
	uint64_t size = 0;
	corefs_fs fs;
	int err;

	if ((err = mount_acquire(td, &fs, false)))
		return err;
	if ((err = file_size(td, fs, path, &size)))
		goto out;
	if (size < need) {
		if (td_read(td) || (td_write(td) && td->o.overwrite)) {
			if (output_format & FIO_OUTPUT_NORMAL)
				log_info("%s: laying out %s in corefs (%lluMiB)\n", td->o.name, path,
					 (unsigned long long)(need >> 20));
			if ((err = lay_out(td, fs, path, need)))
				goto out;
			size = need;
		} else if (size > 0 && !td->o.file_append) {
			int rc = corefs_unlink(fs, path);

			if (rc < 0 && rc != -ENOENT) {
				err = report(td, rc, "corefs_unlink", path);
				goto out;
			}
			size = 0;
		}
	}
	f->real_file_size = size > need ? size : need;
	fio_file_set_size_known(f);
out:
	mount_release(td, fs);
	return err;
}

static int corefs_get_file_size(struct thread_data *td, struct fio_file *f)
{
	uint64_t size = 0;
	corefs_fs fs;
	int err;

	if (fio_file_size_known(f))
		return 0;
	if ((err = mount_acquire(td, &fs, false)))
		return err;
	err = file_size(td, fs, corefs_path(f), &size);
	if (!err) {
		f->real_file_size = size;
		fio_file_set_size_known(f);
	}
	mount_release(td, fs);
	return err;
}

static int corefs_init(struct thread_data *td)
{
	struct corefs_td *cd;
	unsigned int depth = td->o.iodepth ? td->o.iodepth : 1;
	int err;

	if ((err = refuse_unsupported(td)))
		return err;
	cd = calloc(1, sizeof(*cd));
	if (!cd) {
		td_verror(td, ENOMEM, "calloc");
		return ENOMEM;
	}
	cd->inflight_max = depth < COREFS_FIO_INFLIGHT_MAX ? depth : COREFS_FIO_INFLIGHT_MAX;
	cd->events_max = depth;
	cd->events = calloc(depth, sizeof(*cd->events));
	cd->completions = calloc(depth, sizeof(*cd->completions));
	if (!cd->events || !cd->completions) {
		td_verror(td, ENOMEM, "calloc");
		err = ENOMEM;
		goto fail;
	}
	if ((err = mount_acquire(td, &cd->fs, true)))
		goto fail;
	td->io_ops_data = cd;
	return 0;
fail:
	free(cd->events);
	free(cd->completions);
	free(cd);
	return err;
}

static void corefs_cleanup(struct thread_data *td)
{
	struct corefs_td *cd = td->io_ops_data;

	if (!cd)
		return;
	mount_release(td, cd->fs);
	free(cd->events);
	free(cd->completions);
	free(cd);
	td->io_ops_data = NULL;
}

static corefs_fd file_fd(const struct fio_file *f)
{
	return (corefs_fd)(intptr_t)FILE_ENG_DATA(f);
}

static int corefs_open_file(struct thread_data *td, struct fio_file *f)
{
	struct corefs_td *cd = td->io_ops_data;
	const char *path = corefs_path(f);
	int flags = COREFS_O_RDONLY;
	corefs_fd fd;
	int err;

	if (!cd) {
		log_err("corefs: %s opened before the engine's init\n", path);
		td_verror(td, EINVAL, "corefs open_file");
		return EINVAL;
	}
	if ((td_write(td) || td_trim(td)) && !read_only) {
		flags = COREFS_O_RDWR;
		if (td->o.allow_create) {
			flags |= COREFS_O_CREAT;
			if ((err = make_parents(td, cd->fs, path)))
				return err;
		}
	}
	fd = corefs_open(cd->fs, path, flags, 0644);
	if (fd < 0)
		return report(td, (int)fd, "corefs_open", path);
	FILE_SET_ENG_DATA(f, (void *)(intptr_t)fd);
	return 0;
}

static int corefs_close_file(struct thread_data *td, struct fio_file *f)
{
	struct corefs_td *cd = td->io_ops_data;
	corefs_fd fd = file_fd(f);
	int rc;

	FILE_SET_ENG_DATA(f, NULL);
	if (!cd || fd <= 0)
		return 0;
	rc = corefs_release(cd->fs, fd);
	if (rc < 0)
		return report(td, rc, "corefs_release", corefs_path(f));
	return 0;
}

static int corefs_unlink_file(struct thread_data *td, struct fio_file *f)
{
	corefs_fs fs;
	int err, rc;

	if ((err = mount_acquire(td, &fs, false)))
		return err;
	rc = corefs_unlink(fs, corefs_path(f));
	if (rc < 0 && rc != -ENOENT)
		err = report(td, rc, "corefs_unlink", corefs_path(f));
	else if (rc == -ENOENT)
		err = ENOENT;
	mount_release(td, fs);
	return err;
}

/* corefs keeps no page cache; its data-block cache cannot be dropped through the C ABI. */
static int corefs_invalidate(struct thread_data *td, struct fio_file *f)
{
	return 0;
}

static enum fio_q_status corefs_queue(struct thread_data *td, struct io_u *io_u)
{
	struct corefs_td *cd = td->io_ops_data;
	corefs_fd fd = file_fd(io_u->file);
	uint64_t token = (uint64_t)(uintptr_t)io_u;
	int rc;

	fio_ro_check(td, io_u);
	if (ddir_rw(io_u->ddir) || ddir_sync(io_u->ddir)) {
		if (cd->queued >= cd->inflight_max)
			return FIO_Q_BUSY;
	}
	switch (io_u->ddir) {
	case DDIR_READ:
		rc = corefs_submit_pread(cd->fs, fd, io_u->xfer_buf, io_u->xfer_buflen, io_u->offset,
					 token);
		break;
	case DDIR_WRITE:
		rc = corefs_submit_pwrite(cd->fs, fd, io_u->xfer_buf, io_u->xfer_buflen,
					  io_u->offset, token);
		break;
	case DDIR_SYNC:
		rc = corefs_submit_fsync(cd->fs, fd, 0, token);
		break;
	case DDIR_DATASYNC:
		rc = corefs_submit_fsync(cd->fs, fd, 1, token);
		break;
	case DDIR_TRIM:
		/* Synchronous: the ABI has no asynchronous trim. Operations of one thread run in
		 * the order submitted, so it follows the writes queued before it. */
		rc = corefs_fallocate(cd->fs, fd, COREFS_FALLOC_PUNCH_HOLE | COREFS_FALLOC_KEEP_SIZE,
				      io_u->offset, io_u->xfer_buflen);
		if (rc < 0) {
			log_err("corefs: trim of %s: %s\n", corefs_path(io_u->file),
				corefs_last_error());
			io_u->error = -rc;
		}
		return FIO_Q_COMPLETED;
	default:
		/* sync_file_range and the rest have no corefs counterpart. */
		io_u->error = EINVAL;
		return FIO_Q_COMPLETED;
	}
	if (rc == -EAGAIN)
		return FIO_Q_BUSY;
	if (rc < 0) {
		log_err("corefs: %s of %s: %s\n", io_ddir_name(io_u->ddir), corefs_path(io_u->file),
			corefs_last_error());
		io_u->error = -rc;
		return FIO_Q_COMPLETED;
	}
	cd->queued++;
	return FIO_Q_QUEUED;
}

static uint64_t now_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static int corefs_getevents(struct thread_data *td, unsigned int min, unsigned int max,
			    const struct timespec *t)
{
	struct corefs_td *cd = td->io_ops_data;
	unsigned int got = 0;
	uint64_t deadline = 0;

	if (max > cd->events_max)
		max = cd->events_max;
	if (min > max)
		min = max;
	if (t)
		deadline = now_us() + (uint64_t)t->tv_sec * 1000000u + (uint64_t)t->tv_nsec / 1000u;
	while (got < max) {
		uint64_t wait_us = 0;
		int64_t n;

		if (got < min) {
			if (t) {
				uint64_t now = now_us();

				if (now >= deadline)
					break;
				wait_us = deadline - now;
			} else {
				/* No timeout: wait in slices, so a stuck device shows as a stalled
				 * job in fio's status, not a hang inside one call. */
				wait_us = 100000;
			}
		}
		n = corefs_poll(cd->fs, cd->completions, max - got, wait_us);
		if (n < 0) {
			log_err("corefs: poll: %s\n", corefs_last_error());
			td_verror(td, (int)-n, "corefs_poll");
			return (int)n;
		}
		if (n == 0 && got >= min)
			break;
		for (int64_t i = 0; i < n; i++) {
			struct io_u *io_u = (struct io_u *)(uintptr_t)cd->completions[i].token;
			int64_t result = cd->completions[i].result;

			if (result < 0) {
				io_u->error = (int)-result;
			} else if (ddir_rw(io_u->ddir) &&
				   (unsigned long long)result < io_u->xfer_buflen) {
				io_u->resid = io_u->xfer_buflen - (unsigned long long)result;
			}
			cd->events[got++] = io_u;
			cd->queued--;
		}
	}
	return (int)got;
}

static struct io_u *corefs_event(struct thread_data *td, int event)
{
	struct corefs_td *cd = td->io_ops_data;

	return cd->events[event];
}

/* fio finds an external engine through this symbol. */
/* fio's I/O buffers come from corefs_buf_alloc: through a server (corefs_dev=serve:PATH) they
 * lie in memory the server maps too, so their reads and writes are not copied on fio's side
 * (the server copies once, between the buffer and the engine). fio allocates and frees them
 * in the job's own thread; the length is kept for the free. */
static __thread size_t corefs_iomem_bytes;

static int corefs_iomem_alloc(struct thread_data *td, size_t total_mem)
{
	td->orig_buffer = (char *)corefs_buf_alloc(total_mem);
	if (!td->orig_buffer) {
		log_err("corefs: corefs_buf_alloc(%zu): %s\n", total_mem, corefs_last_error());
		return 1;
	}
	corefs_iomem_bytes = total_mem;
	return 0;
}

static void corefs_iomem_free(struct thread_data *td)
{
	corefs_buf_free((uint8_t *)td->orig_buffer, corefs_iomem_bytes);
	td->orig_buffer = NULL;
}

struct ioengine_ops ioengine = {
	.name = "corefs",
	.version = FIO_IOOPS_VERSION,
	/* DISKLESSIO: the files are not host files (fio must not stat, create or lay them out
	 * itself); NODISKUTIL: no host block device to sample; ASYNCIO_SYNC_TRIM: trim
	 * completes in queue(). */
	.flags = FIO_DISKLESSIO | FIO_NODISKUTIL | FIO_ASYNCIO_SYNC_TRIM,
	.setup = corefs_setup,
	.init = corefs_init,
	.cleanup = corefs_cleanup,
	.queue = corefs_queue,
	.getevents = corefs_getevents,
	.event = corefs_event,
	.open_file = corefs_open_file,
	.close_file = corefs_close_file,
	.unlink_file = corefs_unlink_file,
	.invalidate = corefs_invalidate,
	.get_file_size = corefs_get_file_size,
	.prepopulate_file = corefs_prepopulate_file,
	.iomem_alloc = corefs_iomem_alloc,
	.iomem_free = corefs_iomem_free,
	.options = options,
	.option_struct_size = sizeof(struct corefs_fio_options),
};
