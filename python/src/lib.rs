//! The native library of the `cuda_caching_allocator` Python package: the crate's per-device
//! registry behind a C ABI that PyTorch reaches in two ways (docs/pytorch.md):
//!
//! * the C++ shim (`cuda_caching_allocator/csrc/cca_shim.cpp`), a full
//!   `c10::cuda::CUDACachingAllocator::CUDAAllocator` compiled against the user's torch, which
//!   calls every `cca_*` function below through `dlsym`;
//! * the fallback without a compiler: PyTorch's `CUDAPluggableAllocator` over
//!   [`cca_alloc`] / [`cca_free`] and the hooks it takes from
//!   Python (`record_stream`, `empty_cache`, memory fraction, init, graph pools).
//!
//! The library is also a (methodless) Python extension module, `cuda_caching_allocator._cca`, so
//! that maturin packs it into a wheel that installs anywhere with no compiler: an abi3 module, one
//! wheel for every CPython from 3.8.
//!
//! Nothing unwinds across the C boundary: every entry point runs under `catch_unwind`. Failures
//! become a null pointer or a negative status; their message is kept per thread for
//! [`cca_last_error`] (the shim raises it as a Python exception) and, unless
//! [`cca_set_quiet`] turned it off, printed on stderr (the pluggable route has no other channel).

mod error;
mod hooks;
mod introspect;
mod ipc;
mod pools;
mod segments;
mod settings;

pub use error::{cca_last_error, cca_last_error_kind, cca_last_oom_sizes, cca_set_quiet};
pub use hooks::{
    cca_alloc, cca_bench_alloc_free, cca_check_config, cca_empty_cache, cca_enable_peer_access,
    cca_free, cca_free_checked, cca_init, cca_memory_fraction_hook, cca_print_summary,
    cca_record_stream, cca_record_stream_checked, cca_reset, cca_reset_peak_stats,
    cca_set_memory_fraction,
};
pub use introspect::{
    CcaBlock, CcaDeviceStats, CcaSegment, CcaStat, cca_abi_version, cca_base_allocation,
    cca_cache_info, cca_device_stats, cca_memory_fraction, cca_memory_stat,
    cca_reset_accumulated_stats, cca_snapshot,
};
pub use ipc::{cca_close_imported, cca_export_pages, cca_import_pages};
pub use pools::{
    CcaCheckpointBlock, MempoolId, cca_begin_allocate_to_pool, cca_begin_allocate_to_pool_with,
    cca_create_pool, cca_end_allocate_to_pool, cca_next_routing, cca_pool_use_count,
    cca_release_pool, cca_restore_pool, cca_set_no_split, cca_set_use_on_oom,
};
pub use segments::{SegmentCallback, cca_config_expandable, cca_set_segment_callback};
pub use settings::cca_settings_not_applied;

use std::ptr::{addr_of_mut, null_mut};

use pyo3_ffi::{PyModule_Create, PyModuleDef, PyModuleDef_HEAD_INIT, PyObject};

/// The module definition of `cuda_caching_allocator._cca`: no methods, no state.
static mut MODULE_DEF: PyModuleDef = PyModuleDef {
    m_base: PyModuleDef_HEAD_INIT,
    m_name: c"cuda_caching_allocator._cca".as_ptr(),
    m_doc: c"cuda-caching-allocator's native library (reached through ctypes and the C++ shim)"
        .as_ptr(),
    m_size: 0,
    m_methods: null_mut(),
    m_slots: null_mut(),
    m_traverse: None,
    m_clear: None,
    m_free: None,
};

/// The module's initialiser, called by the Python interpreter when it imports
/// `cuda_caching_allocator._cca`.
///
/// # Safety
/// Called by the Python interpreter, with the GIL held, as any extension module's `PyInit_*`.
#[unsafe(no_mangle)]
#[allow(non_snake_case)]
pub unsafe extern "C" fn PyInit__cca() -> *mut PyObject {
    // SAFETY: the interpreter calls this with the GIL held; `MODULE_DEF` is a static that lives
    // for the whole process, is never touched from Rust, and is handed to the interpreter only
    // here (the interpreter keeps it for the module's lifetime, as CPython requires).
    unsafe { PyModule_Create(addr_of_mut!(MODULE_DEF)) }
}
