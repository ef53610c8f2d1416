//! Paths and names: stat, chmod, mkdir and rmdir, unlink, rename, link, symlink, mknod and
//! mkfifo, readlink, readdir.
//! (Part of the C ABI: [`super`] states its conventions.)

use super::*;

/// Attributes of an open file.
///
/// # Safety
/// `out` is valid for writing one `corefs_stat`.
#[no_mangle]
pub unsafe extern "C" fn corefs_fstat(
    fs: corefs_fs,
    fd: corefs_fd,
    out: *mut corefs_stat,
) -> c_int {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        fill_out("corefs_fstat", fs, out, |fs| {
            let f = file(fs, fd)?;
            let mut s = stat_of(call(fs, Op::Stat { ino: f.ino })?)?;
            // Through a handle with an atomic batch open, the size the batch's writes give it.
            if let Some(end) = f.batch().with(|batch| batch.end()) {
                s.size = s.size.max(end);
            }
            Ok(to_c_stat(&s))
        })
    }
}

/// Attributes of `path`.
///
/// # Safety
/// `path` is NUL-terminated; `out` is valid for writing one `corefs_stat`.
#[no_mangle]
pub unsafe extern "C" fn corefs_stat(
    fs: corefs_fs,
    path: *const c_char,
    out: *mut corefs_stat,
) -> c_int {
    let stat = |fs: &Fs| {
        // SAFETY: forwarded from this function's contract.
        let path = unsafe { c_bytes(path, "path") }?;
        Ok(to_c_stat(&resolve(fs, path)?))
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { fill_out("corefs_stat", fs, out, stat) }
}

/// Sets the mode bits (permissions) of `path`.
///
/// # Safety
/// `path` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_chmod(fs: corefs_fs, path: *const c_char, mode: u32) -> c_int {
    status("corefs_chmod", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        let change = SetAttr {
            mode: Some(mode & 0o7777),
            ..Default::default()
        };
        call_at(&fs, path, |ino| Op::SetAttr { ino, change }).map(drop)
    })
}

/// Creates directory `path` (`d/` too). The owner is the caller's (see `corefs_set_owner`);
/// in a set-group-ID directory the group is the directory's, and so is the bit.
///
/// # Safety
/// `path` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_mkdir(fs: corefs_fs, path: *const c_char, mode: u32) -> c_int {
    status("corefs_mkdir", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        let owner = handles::owner(&fs);
        // mkdir(2) of `/`, `.` or `..`: they exist.
        call_entry(
            &fs,
            path,
            true,
            special(libc::EEXIST, path),
            any_entry,
            |dir, name| Op::Mkdir {
                dir,
                name: name.to_vec(),
                mode: mode & 0o7777,
                owner,
            },
        )
        .map(drop)
    })
}

/// Removes the empty directory `path` (`d/` too).
///
/// # Safety
/// `path` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_rmdir(fs: corefs_fs, path: *const c_char) -> c_int {
    status("corefs_rmdir", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        // rmdir(2): the root is busy, `.` is invalid, and `..` is not empty (it holds `.`).
        let special = |last: Last<'_>| match last {
            Last::Root => special(libc::EBUSY, path)(last),
            Last::Dot => special(libc::EINVAL, path)(last),
            _ => special(libc::ENOTEMPTY, path)(last),
        };
        call_entry(&fs, path, true, special, any_entry, |dir, name| Op::Rmdir {
            dir,
            name: name.to_vec(),
        })
        .map(drop)
    })
}

/// Removes the name `path`. The file goes with its last name unless a handle holds it (see
/// `corefs_open`). -ENOTDIR for `file/`, -EISDIR for a directory.
///
/// # Safety
/// `path` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_unlink(fs: corefs_fs, path: *const c_char) -> c_int {
    status("corefs_unlink", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        // unlink(2) of `x/`: never removes anything; the error says what `x` is.
        let slash = |fs: &Fs, e: &Entry<'_>, name: &[u8]| {
            if !e.trailing_slash {
                return Ok(());
            }
            Err(match lookup_entry(fs, e.dir, name)? {
                None => Error::new(libc::ENOENT, format!("{} does not exist", show(path))),
                Some(s) if s.is_dir() => {
                    Error::new(libc::EISDIR, format!("{} is a directory", show(path)))
                }
                Some(_) => Error::new(libc::ENOTDIR, format!("{} is not a directory", show(path))),
            })
        };
        call_entry(
            &fs,
            path,
            false,
            special(libc::EISDIR, path),
            slash,
            |dir, name| Op::Unlink {
                dir,
                name: name.to_vec(),
            },
        )
        .map(drop)
    })
}

/// Renames `from` to `to` (flags: COREFS_RENAME_NOREPLACE, COREFS_RENAME_EXCHANGE). A file
/// renamed over stays as long as a handle holds it (see `corefs_open`). As rename(2): a
/// trailing slash on either path needs a directory (-ENOTDIR), and `/`, `.` or `..` as either
/// last component is -EBUSY.
///
/// # Safety
/// `from` and `to` are NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_rename(
    fs: corefs_fs,
    from: *const c_char,
    to: *const c_char,
    flags: c_int,
) -> c_int {
    status("corefs_rename", || {
        let fs = fs_of(fs)?;
        // SAFETY: forwarded from this function's contract.
        let (from, to) = unsafe { (c_bytes(from, "from")?, c_bytes(to, "to")?) };
        if flags & !(COREFS_RENAME_NOREPLACE | COREFS_RENAME_EXCHANGE) != 0 {
            return Err(einval(format!("unsupported rename flags {flags:#x}")));
        }
        let exchange = flags & COREFS_RENAME_EXCHANGE != 0;
        let flags = RenameFlags {
            noreplace: flags & COREFS_RENAME_NOREPLACE != 0,
            exchange,
        };
        // Paths of plain names without a trailing slash: the reactor walks to the source's
        // directory in the request that renames, so a rename within one directory is one
        // request (the target's directory is the same, `SAME_DIR`) and one across directories
        // two (the target's directory walked first). Through a server each request is a
        // round trip; walking both directories here made every rename three.
        let (parsed_from, parsed_to) = (path::parse(from)?, path::parse(to)?);
        if !parsed_from.trailing_slash && !parsed_to.trailing_slash {
            if let (Some((from_dirs, from_name)), Some((to_dirs, to_name))) = (
                path::plain_entry(&parsed_from.parts),
                path::plain_entry(&parsed_to.parts),
            ) {
                let to_dir = if from_dirs == to_dirs {
                    SAME_DIR
                } else {
                    match entry(&fs, to) {
                        Ok(dst) => dst.dir,
                        // rename(2) resolves the source's directory first: its error wins.
                        Err(e) => {
                            entry(&fs, from)?;
                            return Err(e);
                        }
                    }
                };
                let rename = Op::Rename {
                    from_dir: 0,
                    from: from_name.to_vec(),
                    to_dir,
                    to: to_name.to_vec(),
                    flags,
                };
                return call(&fs, walk(&from_dirs, rename)).map(drop);
            }
        }
        let src = entry(&fs, from)?;
        let dst = entry(&fs, to)?;
        let from_name = src.name(special(libc::EBUSY, from))?;
        let to_name = dst.name(special(libc::EBUSY, to))?;
        if src.trailing_slash || dst.trailing_slash {
            // What moves must be a directory; in an exchange, what comes back too.
            let source = Names(&fs).lookup(src.dir, from_name)?;
            let not_dir = |path: &[u8]| {
                Error::new(libc::ENOTDIR, format!("{} is not a directory", show(path)))
            };
            if !source.is_dir() {
                return Err(not_dir(if src.trailing_slash { from } else { to }));
            }
            if exchange && dst.trailing_slash {
                let target = Names(&fs).lookup(dst.dir, to_name)?;
                if !target.is_dir() {
                    return Err(not_dir(to));
                }
            }
        }
        call(
            &fs,
            Op::Rename {
                from_dir: src.dir,
                from: from_name.to_vec(),
                to_dir: dst.dir,
                to: to_name.to_vec(),
                flags,
            },
        )
        .map(drop)
    })
}

/// Gives the file at `existing` the new name `path`.
///
/// # Safety
/// `existing` and `path` are NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_link(
    fs: corefs_fs,
    existing: *const c_char,
    path: *const c_char,
) -> c_int {
    status("corefs_link", || {
        let fs = fs_of(fs)?;
        // SAFETY: forwarded from this function's contract.
        let (existing, path) = unsafe { (c_bytes(existing, "existing")?, c_bytes(path, "path")?) };
        let ino = resolve(&fs, existing)?.ino;
        // link(2) to `/`, `.` or `..`: they exist.
        call_new(&fs, path, |dir, name| Op::Link {
            ino,
            dir,
            name: name.to_vec(),
        })
        .map(drop)
    })
}

/// Creates the symbolic link `path` pointing at `target` (1 to 4095 bytes, any but NUL; an
/// empty target is -ENOENT and a longer one -ENAMETOOLONG, as symlink(2)). The owner is the
/// caller's (see `corefs_set_owner`).
///
/// # Safety
/// `target` and `path` are NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_symlink(
    fs: corefs_fs,
    target: *const c_char,
    path: *const c_char,
) -> c_int {
    status("corefs_symlink", || {
        let fs = fs_of(fs)?;
        // SAFETY: forwarded from this function's contract.
        let (target, path) = unsafe { (c_bytes(target, "target")?, c_bytes(path, "path")?) };
        if target.is_empty() {
            return Err(Error::new(libc::ENOENT, "empty symlink target".into()));
        }
        if target.len() >= path::PATH_MAX_BYTES {
            return Err(Error::new(
                libc::ENAMETOOLONG,
                format!(
                    "symlink target of {} bytes (at most {})",
                    target.len(),
                    path::PATH_MAX_BYTES - 1
                ),
            ));
        }
        let owner = handles::owner(&fs);
        call_new(&fs, path, |dir, name| Op::Symlink {
            dir,
            name: name.to_vec(),
            target: target.to_vec(),
            owner,
        })
        .map(drop)
    })
}

/// Creates `path` as mknod(2) does: `mode` is a file type (S_IFIFO, S_IFSOCK, S_IFCHR,
/// S_IFBLK, S_IFREG or 0 for a regular file) and permission bits; `rdev` is the device
/// number of a character or block device (makedev(3); ignored for the other types).
/// corefs keeps these as names with a type and number (for a program that stores them, as
/// `corefs mount` does for the kernel); it runs no pipe or device behind them, and reads and
/// writes through a handle of one are -EINVAL. S_IFDIR is -EPERM (use `corefs_mkdir`),
/// another type -EINVAL, as is an `rdev` over 32 bits (as glibc's mknod). The owner is the
/// caller's (see `corefs_set_owner`).
///
/// # Safety
/// `path` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_mknod(
    fs: corefs_fs,
    path: *const c_char,
    mode: u32,
    rdev: u64,
) -> c_int {
    status("corefs_mknod", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        mknod(&fs, path, mode, rdev)
    })
}

/// Creates the FIFO `path` (mkfifo(3): `corefs_mknod` with S_IFIFO).
///
/// # Safety
/// `path` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_mkfifo(fs: corefs_fs, path: *const c_char, mode: u32) -> c_int {
    status("corefs_mkfifo", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        mknod(&fs, path, libc::S_IFIFO | (mode & 0o7777), 0)
    })
}

fn mknod(fs: &Fs, path: &[u8], mode: u32, rdev: u64) -> Result<(), Error> {
    // Checked before the path, as Linux checks the type first.
    match mode & libc::S_IFMT {
        0 | libc::S_IFREG | libc::S_IFIFO | libc::S_IFSOCK | libc::S_IFCHR | libc::S_IFBLK => {}
        libc::S_IFDIR => {
            return Err(Error::new(
                libc::EPERM,
                "mknod of a directory (use corefs_mkdir)".into(),
            ))
        }
        kind => return Err(einval(format!("mknod of file type {:#o}", kind))),
    }
    // The kernel's device numbers are 32 bits; glibc refuses a dev_t that does not fit.
    let rdev = u32::try_from(rdev)
        .map_err(|_| einval(format!("device number {rdev:#x} is over 32 bits")))?;
    // mknod(2) of `/`, `.` or `..`: they exist.
    let owner = handles::owner(fs);
    call_new(fs, path, |dir, name| Op::Mknod {
        dir,
        name: name.to_vec(),
        mode: mode & (libc::S_IFMT | 0o7777),
        rdev: rdev as u64,
        owner,
    })
    .map(drop)
}

/// Copies the target of symbolic link `path` into `buf` (not NUL-terminated); returns its
/// length (which may exceed `len`: then only `len` bytes were copied).
///
/// # Safety
/// `path` is NUL-terminated; `buf` is valid for writing `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn corefs_readlink(
    fs: corefs_fs,
    path: *const c_char,
    buf: *mut u8,
    len: usize,
) -> i64 {
    guard("corefs_readlink", || {
        // SAFETY: forwarded from this function's contract.
        let ((fs, path), out) = unsafe { (fs_and_path(fs, path)?, bytes_mut(buf, len, "buf")?) };
        let reply = call_at(&fs, path, |ino| Op::Readlink { ino })?;
        expect_reply!(reply, Reply::Data(target) => copy_out(out, &target))
    })
}

/// Reads up to `max` entries of directory `path` after `cookie` (0 to start) into `out`;
/// returns how many (0 at the end). `.` and `..` are not listed.
///
/// # Safety
/// `path` is NUL-terminated; `out` is valid for writing `max` entries.
#[no_mangle]
pub unsafe extern "C" fn corefs_readdir(
    fs: corefs_fs,
    path: *const c_char,
    cookie: u64,
    out: *mut corefs_dirent,
    max: usize,
) -> i64 {
    guard("corefs_readdir", || {
        // SAFETY: forwarded from this function's contract.
        let (fs, path) = unsafe { fs_and_path(fs, path) }?;
        if max == 0 {
            return Ok(0);
        }
        if out.is_null() {
            return Err(efault("out"));
        }
        let reply = call_at(&fs, path, |dir| Op::Readdir {
            dir,
            cookie: cookie.max(1),
            max: max.min(4096),
        })?;
        let entries = expect_reply!(reply, Reply::Entries(e) => e)?;
        for (i, e) in entries.iter().enumerate() {
            let mut d = corefs_dirent {
                ino: e.ino,
                cookie: e.cookie,
                kind: e.kind,
                name_len: e.name.len() as u8,
                name: [0; 256],
            };
            d.name[..e.name.len()].copy_from_slice(&e.name);
            // SAFETY: i < entries.len() ≤ max, and `out` holds `max` entries by contract.
            unsafe { out.add(i).write(d) };
        }
        Ok(entries.len() as i64)
    })
}
