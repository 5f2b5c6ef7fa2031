//! Shared by the fuzz targets: an allocation cap.
//!
//! The targets are built without a sanitizer (`make fuzz` passes `-s none`:
//! kvroute forbids `unsafe`, so AddressSanitizer would find little and it
//! costs an order of magnitude in executions per second). Without a
//! sanitizer libFuzzer's `-malloc_limit_mb` has no malloc hook to work
//! with, so each target installs [`Capped`] as its global allocator
//! instead: any single allocation over [`MAX_ALLOC_BYTES`] aborts, and
//! libFuzzer saves the input as a crash. Inputs are at most a few KiB, so an
//! allocation that large can only come from a length or count read from the
//! input and trusted. `-rss_limit_mb` still bounds the total.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;

/// The largest single allocation a target may make: 256 MiB.
pub const MAX_ALLOC_BYTES: usize = 256 << 20;

/// The system allocator, refusing (by aborting) single allocations over
/// [`MAX_ALLOC_BYTES`].
pub struct Capped;

fn check(size: usize) {
    if size > MAX_ALLOC_BYTES {
        // A static message: nothing here may allocate.
        let _ = std::io::stderr()
            .write_all(b"==kvroute-fuzz== single allocation over 256 MiB: unbounded allocation\n");
        std::process::abort();
    }
}

// SAFETY: every call is forwarded unchanged to `System`, which upholds the
// `GlobalAlloc` contract; the size check only adds an abort.
unsafe impl GlobalAlloc for Capped {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}
