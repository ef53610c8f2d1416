//! Aligned buffers for I/O.
//! (Part of the C ABI: [`super`] states its conventions.)

use super::*;

/// Allocates a 4 KiB-aligned buffer of `len` bytes (zeroed) for I/O; NULL on failure. Today
/// the engine copies data between such buffers and its DMA slab: they save the caller an
/// alignment step, not a copy.
#[no_mangle]
pub extern "C" fn corefs_buf_alloc(len: usize) -> *mut u8 {
    guard_or("corefs_buf_alloc", std::ptr::null_mut(), || {
        if len == 0 || len > (1 << 30) {
            set_error("corefs_buf_alloc: length must be 1 byte to 1 GiB");
            return std::ptr::null_mut();
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
        if buf.is_null() || len == 0 {
            return;
        }
        if let Ok(layout) = std::alloc::Layout::from_size_align(len, 4096) {
            // SAFETY: allocated by corefs_buf_alloc with this layout, by contract.
            unsafe { std::alloc::dealloc(buf, layout) };
        }
    })
}
