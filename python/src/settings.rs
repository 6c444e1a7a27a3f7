//! PyTorch's allocator settings changed at run time (`torch.cuda.memory._set_allocator_settings`,
//! which reaches the shim through PyTorch's device configuration hook): the devices' caches take
//! their configuration once, so the shim asks here which keys of the new string would have changed
//! it, and warns with the answer instead of leaving the change silently unapplied.

use std::ffi::{CStr, c_char, c_long};

use cuda_caching_allocator::interop::AllocatorRegistry;

use crate::error::{KIND_OTHER, fail, guarded};

/// Writes into `out` (at most `cap` bytes, NUL-terminated when `cap > 0`) the keys whose values
/// `settings` (PyTorch's syntax) would change in the configuration the devices' caches use, as
/// `key (running -> asked)` items joined by `", "`; an empty string when it changes nothing.
/// Returns the text's full length without the NUL (call again with a larger buffer when it is
/// `cap` or more), or -1 for a string the crate cannot parse or a bad running configuration
/// ([`cca_last_error`](crate::cca_last_error) names what was wrong).
///
/// # Safety
/// `settings` is a NUL-terminated string; `out` is valid for writes of `cap` bytes (or null with
/// `cap` 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_settings_not_applied(
    settings: *const c_char,
    out: *mut c_char,
    cap: usize,
) -> c_long {
    guarded("cca_settings_not_applied", -1, || {
        if settings.is_null() {
            fail(KIND_OTHER, "cca_settings_not_applied: null settings".into());
            return -1;
        }
        // SAFETY: the caller passes a NUL-terminated string.
        let settings = unsafe { CStr::from_ptr(settings) };
        let Ok(settings) = settings.to_str() else {
            fail(KIND_OTHER, "allocator settings: not valid UTF-8".into());
            return -1;
        };
        let running = match AllocatorRegistry::global().config() {
            Ok(c) => c,
            Err(e) => {
                fail(KIND_OTHER, format!("bad configuration: {e}"));
                return -1;
            }
        };
        let text = match running.differences_with_settings(settings) {
            Ok(d) => d
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            Err(e) => {
                fail(KIND_OTHER, format!("allocator settings '{settings}': {e}"));
                return -1;
            }
        };
        if cap > 0 && !out.is_null() {
            let n = text.len().min(cap - 1);
            // SAFETY: `out` is valid for `cap` bytes and `n + 1 <= cap`; the text is ours, not
            // overlapping the caller's buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), out, n);
                *out.add(n) = 0;
            }
        }
        c_long::try_from(text.len()).unwrap_or(c_long::MAX)
    })
}
