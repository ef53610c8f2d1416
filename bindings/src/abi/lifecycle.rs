//! The filesystem's life: mounting, formatting, closing, and the calling thread's last error.
//! (Part of the C ABI: [`super`] states its conventions.)

use super::*;

/// The message of the calling thread's last failed call ("" if none). Valid until that
/// thread's next corefs call.
#[no_mangle]
pub extern "C" fn corefs_last_error() -> *const c_char {
    guard_or("corefs_last_error", c"".as_ptr(), handles::last_error_ptr)
}

/// Starts a reactor on `device` (`file:/srv/fs.img,size=1GiB`, `nvme:/dev/ng0n1`,
/// `mem:256MiB`), formatting it if `options->format`, and mounts it (replaying the fsync logs).
/// `serve:SOCKET` connects to a corefs server instead, as `corefs_connect(SOCKET, options)`.
/// `options` may be NULL (defaults). Returns the filesystem handle or a negative errno:
/// -EINVAL for a bad device string (an option out of its range is named), -EBUSY when
/// another mount, mkfs or fsck holds the device (in this process or another: the message
/// names the holder's pid). The device is held exclusively until `corefs_close`.
///
/// # Safety
/// `device` is NULL or a NUL-terminated string; `options` is NULL or points to a
/// `corefs_options` whose `label` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_mount(
    device: *const c_char,
    options: *const corefs_options,
) -> corefs_fs {
    guard("corefs_mount", || {
        crate::logging::init_from_env();
        // SAFETY: forwarded from this function's contract.
        let device = unsafe { c_str(device, "device") }?;
        if let Some(socket) = device.strip_prefix("serve:") {
            // SAFETY: forwarded from this function's contract.
            return unsafe { connect(socket, options) };
        }
        let options = if options.is_null() {
            None
        } else {
            // SAFETY: non-NULL and points to a corefs_options by contract.
            Some(unsafe { *options })
        };
        let mut config = Config {
            device: device.to_string(),
            ..Default::default()
        };
        let mut mount = MountOptions::default();
        let mut owner = None;
        if let Some(o) = options {
            if o.owner_set != 0 {
                owner = Some(Owner {
                    uid: o.owner_uid,
                    gid: o.owner_gid,
                });
            }
            if o.format != 0 {
                let label = if o.label.is_null() {
                    String::new()
                } else {
                    // SAFETY: non-NULL and NUL-terminated by contract.
                    unsafe { c_str(o.label, "options.label") }?.to_string()
                };
                config.mkfs = Some(MkfsOptions {
                    shards: if o.shards == 0 {
                        MkfsOptions::default().shards
                    } else {
                        o.shards
                    },
                    label,
                    ..Default::default()
                });
            }
            if o.busy_poll != 0 {
                config.idle = IdlePolicy::BusyPoll;
            }
            config.reactors = (o.reactors as usize).max(1);
            if o.pin != 0 {
                // Checked here, so a core the process may not run on is -EINVAL naming it
                // and the allowed set.
                config.cores =
                    reactor::affinity::consecutive_cores(o.core as usize, config.reactors)?;
                config.core = config.cores.first().copied();
            }
            if o.commit_interval_ms != 0 {
                mount.commit_interval = Duration::from_millis(o.commit_interval_ms as u64);
            }
            if o.data_cache_off != 0 {
                mount.data_cache_blocks = 0;
            }
            mount.atime = match o.atime {
                COREFS_ATIME_RELATIME => engine::Atime::Relative,
                COREFS_ATIME_NOATIME => engine::Atime::Never,
                COREFS_ATIME_STRICT => engine::Atime::Strict,
                other => {
                    return Err(einval(format!(
                        "options.atime {other}: use COREFS_ATIME_RELATIME (0), \
                         COREFS_ATIME_NOATIME (1) or COREFS_ATIME_STRICT (2)"
                    )))
                }
            };
        }
        config.mount = mount;
        let runtime = Runtime::start(config)?;
        Ok(handles::register(runtime, owner))
    })
}

/// Connects to a corefs server (`corefs serve DEVICE --socket PATH`) at the Unix socket
/// `socket_path`: the filesystem it serves, used through every call here as if mounted in
/// this process (`corefs_mount` with the device string `serve:PATH` does the same). The
/// server acts as this process's user (its uid and groups, as the kernel reports them to the
/// server) and checks permissions as the kernel does; the owner of what this process creates
/// is its user (a root client may pick another with `corefs_set_owner`). `options` may be
/// NULL; a connection takes no option but `owner_*` (formatting, reactors and cores are the
/// server's): any other non-zero field is -EINVAL. Errors: -ENOENT or -ECONNREFUSED when no
/// server is there, -EACCES when the socket's mode keeps this user out, -EPROTO when the
/// server speaks another version. If the server goes, every call fails with -ENOTCONN
/// (within tens of milliseconds, never hanging); connect again once it is back.
///
/// # Safety
/// `socket_path` is NULL or NUL-terminated; `options` as for `corefs_mount`.
#[no_mangle]
pub unsafe extern "C" fn corefs_connect(
    socket_path: *const c_char,
    options: *const corefs_options,
) -> corefs_fs {
    guard("corefs_connect", || {
        crate::logging::init_from_env();
        // SAFETY: forwarded from this function's contract.
        let socket = unsafe { c_str(socket_path, "socket_path") }?;
        // SAFETY: forwarded from this function's contract.
        unsafe { connect(socket, options) }
    })
}

/// # Safety
/// `options` is NULL or points to a `corefs_options`.
unsafe fn connect(socket: &str, options: *const corefs_options) -> Result<i64, Error> {
    let mut owner = None;
    if !options.is_null() {
        // SAFETY: non-NULL and points to a corefs_options by contract.
        let o = unsafe { *options };
        if o.format != 0
            || o.busy_poll != 0
            || o.pin != 0
            || o.reactors != 0
            || o.shards != 0
            || o.commit_interval_ms != 0
            || o.data_cache_off != 0
            || o.atime != 0
        {
            return Err(einval(format!(
                "connecting to {socket}: formatting, reactors, cores, the commit interval, \
                 the cache and atime are the server's options (set only owner_*)"
            )));
        }
        if o.owner_set != 0 {
            owner = Some(Owner {
                uid: o.owner_uid,
                gid: o.owner_gid,
            });
        }
    }
    let conn = crate::service::client::Connection::connect(socket)?;
    Ok(handles::register_remote(conn, owner))
}

/// Formats `device` (see `corefs_mount`) and closes it again.
///
/// # Safety
/// As `corefs_mount`.
#[no_mangle]
pub unsafe extern "C" fn corefs_mkfs(
    device: *const c_char,
    options: *const corefs_options,
) -> c_int {
    // SAFETY: forwarded from this function's contract.
    guard_or("corefs_mkfs", -libc::EIO, || unsafe {
        mkfs(device, options)
    })
}

/// # Safety
/// As `corefs_mkfs`.
unsafe fn mkfs(device: *const c_char, options: *const corefs_options) -> c_int {
    let mut o = if options.is_null() {
        corefs_options::default()
    } else {
        // SAFETY: non-NULL and points to a corefs_options by contract.
        unsafe { *options }
    };
    o.format = 1;
    // SAFETY: forwarded from this function's contract.
    let fs = unsafe { corefs_mount(device, &o) };
    if fs < 0 {
        return fs as c_int;
    }
    corefs_close(fs)
}

/// Drains the operations in flight, closes the file handles still open (an unlinked file
/// goes with its last handle, as at process exit), commits, unmounts and stops the reactor.
/// The handle and every file handle of it are invalid afterwards (-EBADF). Do not call it
/// while another thread still uses the filesystem.
#[no_mangle]
pub extern "C" fn corefs_close(fs: corefs_fs) -> c_int {
    status("corefs_close", || {
        let fs = handles::unregister(fs)?;
        // Released here rather than left to the next mount (which deletes the orphans a
        // crash leaves): a closed image then holds no orphan, and their space is free now.
        // A failure is the runtime's, which the shutdown below reports.
        // Returns once no call still uses a handle (see handles' module doc).
        for f in handles::drain_files(&fs) {
            let _ = call(&fs, Op::Release { ino: f.ino });
        }
        handles::forget_client(fs.id);
        if let Some(remote) = &fs.remote {
            handles::take_thread_clients(&fs);
            remote.close();
            return Ok(());
        }
        let runtime = fs.runtime.lock().expect("runtime").take();
        // Other threads' clients go now, not when each next calls in (if ever).
        handles::take_thread_clients(&fs);
        match runtime {
            Some(runtime) => runtime.shutdown().map(drop).map_err(Error::from),
            None => Err(Error::new(libc::EBADF, "already closed".into())),
        }
    })
}
