//! Extended attributes: set, get, list, remove.
//! (Part of the C ABI: [`super`] states its conventions.)

use super::*;

/// An attribute name as setxattr(2) checks it: 1 to 255 bytes, else -ERANGE.
fn xattr_name(name: &[u8]) -> Result<Vec<u8>, Error> {
    if name.is_empty() || name.len() > path::NAME_MAX_BYTES {
        return Err(Error::new(
            libc::ERANGE,
            format!(
                "attribute name of {} bytes (1 to {})",
                name.len(),
                path::NAME_MAX_BYTES
            ),
        ));
    }
    Ok(name.to_vec())
}

/// Copies `value` into `out` as getxattr(2) and listxattr(2) do: an empty `out` learns the
/// size; one too small is -ERANGE (nothing copied).
fn sized_out(out: &mut [u8], value: &[u8], what: &str) -> Result<i64, Error> {
    if !out.is_empty() && out.len() < value.len() {
        return Err(Error::new(
            libc::ERANGE,
            format!(
                "{what} needs {} bytes, the buffer holds {}",
                value.len(),
                out.len()
            ),
        ));
    }
    Ok(copy_out(out, value))
}

/// Sets extended attribute `name` of `path` (flags: COREFS_XATTR_CREATE, _REPLACE). Values
/// up to 65536 bytes; a longer one is -E2BIG, a name that is empty or over 255 bytes -ERANGE,
/// as setxattr(2).
///
/// # Safety
/// `path` and `name` are NUL-terminated; `value` is valid for reading `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn corefs_setxattr(
    fs: corefs_fs,
    path: *const c_char,
    name: *const c_char,
    value: *const u8,
    len: usize,
    flags: c_int,
) -> c_int {
    status("corefs_setxattr", || {
        let fs = fs_of(fs)?;
        if len > MAX_XATTR_VALUE_BYTES {
            return Err(Error::new(
                libc::E2BIG,
                format!("attribute value of {len} bytes (at most {MAX_XATTR_VALUE_BYTES})"),
            ));
        }
        // SAFETY: forwarded from this function's contract.
        let (path, name, value) = unsafe {
            (
                c_bytes(path, "path")?,
                c_bytes(name, "name")?,
                bytes(value, len, "value")?,
            )
        };
        if flags & !(COREFS_XATTR_CREATE | COREFS_XATTR_REPLACE) != 0 {
            return Err(einval(format!("unsupported xattr flags {flags:#x}")));
        }
        let name = xattr_name(name)?;
        let flags = match flags {
            0 => XattrFlags::Any,
            COREFS_XATTR_CREATE => XattrFlags::Create,
            COREFS_XATTR_REPLACE => XattrFlags::Replace,
            _ => return Err(einval("COREFS_XATTR_CREATE and _REPLACE together".into())),
        };
        let value = value.to_vec();
        call_at(&fs, path, |ino| Op::SetXattr {
            ino,
            name,
            value,
            flags,
        })
        .map(drop)
    })
}

/// Copies the value of attribute `name` into `buf`; returns its size. With `len` 0 only
/// returns the size; a `len` too small for the value is -ERANGE, as getxattr(2).
///
/// # Safety
/// `path` and `name` are NUL-terminated; `buf` is valid for writing `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn corefs_getxattr(
    fs: corefs_fs,
    path: *const c_char,
    name: *const c_char,
    buf: *mut u8,
    len: usize,
) -> i64 {
    guard("corefs_getxattr", || {
        // SAFETY: forwarded from this function's contract.
        let ((fs, path), name, out) = unsafe {
            (
                fs_and_path(fs, path)?,
                c_bytes(name, "name")?,
                bytes_mut(buf, len, "buf")?,
            )
        };
        let name = xattr_name(name)?;
        let reply = call_at(&fs, path, |ino| Op::GetXattr { ino, name })?;
        sized_out(
            out,
            &expect_reply!(reply, Reply::Data(v) => v)?,
            "the value",
        )
    })
}

/// Copies the attribute names of `path`, each NUL-terminated, into `buf`; returns the bytes
/// they take. With `len` 0 only returns that; a `len` too small is -ERANGE, as listxattr(2).
///
/// # Safety
/// `path` is NUL-terminated; `buf` is valid for writing `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn corefs_listxattr(
    fs: corefs_fs,
    path: *const c_char,
    buf: *mut u8,
    len: usize,
) -> i64 {
    guard("corefs_listxattr", || {
        // SAFETY: forwarded from this function's contract.
        let ((fs, path), out) = unsafe { (fs_and_path(fs, path)?, bytes_mut(buf, len, "buf")?) };
        let reply = call_at(&fs, path, |ino| Op::ListXattr { ino })?;
        let names = expect_reply!(reply, Reply::Names(n) => n)?;
        let mut all = Vec::new();
        for n in names {
            all.extend_from_slice(&n);
            all.push(0);
        }
        sized_out(out, &all, "the names")
    })
}

/// Removes attribute `name` of `path`.
///
/// # Safety
/// `path` and `name` are NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn corefs_removexattr(
    fs: corefs_fs,
    path: *const c_char,
    name: *const c_char,
) -> c_int {
    status("corefs_removexattr", || {
        // SAFETY: forwarded from this function's contract.
        let ((fs, path), name) = unsafe { (fs_and_path(fs, path)?, c_bytes(name, "name")?) };
        let name = xattr_name(name)?;
        call_at(&fs, path, |ino| Op::RemoveXattr { ino, name }).map(drop)
    })
}
