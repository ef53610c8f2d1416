//! Aligned buffers for I/O, from the process's shared buffer arena
//! ([`crate::service::arena`]) when there is one.
//! (Part of the C ABI: [`super`] states its conventions.)

use super::*;

/// Allocates a 4 KiB-aligned buffer of `len` bytes (zeroed) for I/O; NULL on failure.
///
/// The buffer comes from memory this process shares with every corefs server it connects
/// to (`corefs_connect`, `serve:` devices): a read or write through a server from or into
/// such a buffer is not copied on the caller's side (the server copies once, between it and
/// the engine), where any other buffer is copied once more into the connection's ring. In
/// process it saves the caller an alignment step, not a copy. The arena is 1 GiB of address
/// space (`COREFS_BUF_ARENA_MIB` sets it; 0 turns it off); when it is full, buffers come
/// from the heap. A buffer handed to `corefs_submit_pwrite` through a server must stay as it
/// is until the write's completion is polled.
#[no_mangle]
pub extern "C" fn corefs_buf_alloc(len: usize) -> *mut u8 {
    guard_or("corefs_buf_alloc", std::ptr::null_mut(), || {
        if len == 0 || len > (1 << 30) {
            set_error("corefs_buf_alloc: length must be 1 byte to 1 GiB");
            return std::ptr::null_mut();
        }
        if let Some(buf) = crate::service::arena::process().and_then(|a| a.alloc(len)) {
            return buf;
        }
        match std::alloc::Layout::from_size_align(len, 4096) {
            // SAFETY: the layout has a non-zero size.
            Ok(layout) => unsafe { std::alloc::alloc_zeroed(layout) },
            Err(_) => std::ptr::null_mut(),
        }
    })
}

/// Frees a buffer from `corefs_buf_alloc` (`len` as allocated). NULL is ignored.
///
/// # Safety
/// `buf` is NULL or came from `corefs_buf_alloc(len)` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn corefs_buf_free(buf: *mut u8, len: usize) {
    guard_or("corefs_buf_free", (), || {
        if buf.is_null() || len == 0 || crate::service::arena::free(buf) {
            return;
        }
        if let Ok(layout) = std::alloc::Layout::from_size_align(len, 4096) {
            // SAFETY: allocated by corefs_buf_alloc with this layout, by contract.
            unsafe { std::alloc::dealloc(buf, layout) };
        }
    })
}
