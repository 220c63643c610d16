//! A counting global allocator for test binaries: the heap bytes each
//! thread holds (allocated minus freed), so a test can check that memory
//! does not grow with an attack or a flood. Include it with
//! `#[path = "common/heap.rs"] mod heap;` in the test binary's root.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    /// Bytes this thread holds on the heap (allocated minus freed).
    static LIVE: Cell<isize> = const { Cell::new(0) };
}

fn count(delta: isize) {
    // Never allocates; skipped while the thread is being torn down.
    let _ = LIVE.try_with(|c| c.set(c.get() + delta));
}

// SAFETY: every call goes to the system allocator unchanged; the counting
// touches only a thread-local integer.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            count(l.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            count(l.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(p, l) };
        count(-(l.size() as isize));
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            count(new as isize - l.size() as isize);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Bytes the calling thread holds on the heap now.
pub fn live_heap() -> isize {
    LIVE.with(|c| c.get())
}
