//! Failure reporting across the C boundary: a panic guard, the calling thread's last error
//! (message and kind) for [`cca_last_error`] / [`cca_last_error_kind`], an out-of-memory
//! failure's sizes for [`cca_last_oom_sizes`], and the stderr line the pluggable route relies
//! on, which [`cca_set_quiet`] turns off.

use std::cell::RefCell;
use std::ffi::{CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};

use cuda_caching_allocator::AllocError;

/// No error on this thread since the last successful call that reports errors.
pub(crate) const KIND_NONE: c_int = 0;
/// The allocation failed for lack of memory (PyTorch raises `torch.OutOfMemoryError`).
pub(crate) const KIND_OOM: c_int = 1;
/// Any other failure: bad argument, unknown pointer, invalid pool, driver error.
pub(crate) const KIND_OTHER: c_int = 2;

static QUIET: AtomicBool = AtomicBool::new(false);

/// A thread's last failure: its kind, its message, and for an out-of-memory failure with a
/// report the request's rounded size and the device allocation the cache tried to make.
#[derive(Default)]
struct Last {
    kind: c_int,
    text: CString,
    oom_sizes: Option<(usize, usize)>,
}

thread_local! {
    static LAST: RefCell<Last> = RefCell::new(Last::default());
}

/// Records `msg` as this thread's last error of `kind`, and prints it unless quiet.
pub(crate) fn fail(kind: c_int, msg: String) {
    record(kind, msg, None);
}

/// [`fail`], with an out-of-memory failure's sizes (rounded request, device allocation).
fn record(kind: c_int, msg: String, oom_sizes: Option<(usize, usize)>) {
    if !QUIET.load(Ordering::Relaxed) {
        print_line(format_args!("cuda_caching_allocator: {msg}"));
    }
    // A message with an interior NUL (it never has one) loses everything from the NUL on.
    let bytes: Vec<u8> = msg
        .into_bytes()
        .into_iter()
        .take_while(|&b| b != 0)
        .collect();
    let text = CString::new(bytes).unwrap_or_default();
    // During the thread's exit (frees from static destructors, such as PyTorch's CUDA IPC limbo
    // at process exit) the slot is gone: the error is only printed then.
    let _ = LAST.try_with(|l| {
        *l.borrow_mut() = Last {
            kind,
            text,
            oom_sizes,
        }
    });
}

/// Writes one line to stderr, ignoring a failed write: `eprintln!` panics when stderr is a closed
/// pipe or a full disk, and a panic while reporting an error (or in [`guarded`]'s own report of
/// a panic) would reach the C boundary and abort the process.
pub(crate) fn print_line(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Records an allocator error, classified (out of memory or other). Out of memory inside a
/// graph capture is out of memory too: PyTorch raises `torch.OutOfMemoryError` there as well
/// (it only skips releasing cached blocks).
pub(crate) fn fail_alloc(context: &str, e: &AllocError) {
    let kind = if e.is_out_of_memory() {
        KIND_OOM
    } else {
        KIND_OTHER
    };
    let sizes = e.oom_report().map(|r| (r.rounded_bytes, r.segment_bytes));
    record(kind, format!("{context}: {e}"), sizes);
}

/// Clears this thread's last error (a call that succeeded).
pub(crate) fn clear() {
    let _ = LAST.try_with(|l| {
        let mut l = l.borrow_mut();
        if l.kind != KIND_NONE {
            *l = Last::default();
        }
    });
}

/// Runs `f` with this thread's last error cleared (so that [`cca_last_error_kind`] after a call
/// tells about that call alone), turning a panic into `fallback` and a recorded error.
pub(crate) fn guarded<T>(what: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    clear();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            fail(
                KIND_OTHER,
                format!("panic in {what}; returning an error to the caller"),
            );
            fallback
        }
    }
}

/// The message of the calling thread's last call's failure, or an empty string when that call
/// succeeded (every entry point clears it first, except this one, [`cca_last_error_kind`],
/// [`cca_last_oom_sizes`], [`cca_abi_version`](crate::cca_abi_version) and [`cca_set_quiet`],
/// which report no errors).
/// The pointer stays valid until the next call into this library on the same thread.
#[unsafe(no_mangle)]
pub extern "C" fn cca_last_error() -> *const c_char {
    LAST.try_with(|l| l.borrow().text.as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// The kind of the calling thread's last call's failure: 0 none, 1 out of memory, 2 any other
/// error.
#[unsafe(no_mangle)]
pub extern "C" fn cca_last_error_kind() -> c_int {
    LAST.try_with(|l| l.borrow().kind).unwrap_or(KIND_NONE)
}

/// The sizes of the calling thread's last call's out-of-memory failure, as PyTorch's allocator
/// uses them: `rounded` the request after rounding (its memory history's `oom` entry), `segment`
/// the device allocation the cache tried to make (what its out-of-memory observers and message
/// get). Returns 0 with both written, or -1, writing nothing, when that call did not fail for
/// lack of memory with a report (a request of 1 EiB or more has none).
///
/// # Safety
/// `rounded` and `segment` must be valid for a write of one `size_t` each.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_last_oom_sizes(rounded: *mut usize, segment: *mut usize) -> c_int {
    let sizes = LAST.try_with(|l| l.borrow().oom_sizes).ok().flatten();
    match sizes {
        Some((r, s)) if !rounded.is_null() && !segment.is_null() => {
            // SAFETY: the caller passes pointers valid for one write each (checked non-null).
            unsafe {
                rounded.write(r);
                segment.write(s);
            }
            0
        }
        _ => -1,
    }
}

/// `quiet` non-zero: failures are no longer printed on stderr (the C++ shim raises them as
/// Python exceptions instead); zero: printed again. Returns the previous setting (1 quiet, 0
/// not), so that a caller that silences the library for a moment can put back what it found.
#[unsafe(no_mangle)]
pub extern "C" fn cca_set_quiet(quiet: c_int) -> c_int {
    c_int::from(QUIET.swap(quiet != 0, Ordering::Relaxed))
}
