//! The crate's names beside cudarc's under glob imports: `use cuda_caching_allocator::*;` and
//! `use cudarc::driver::*;` together must leave every name unambiguous. Before 0.1 the crate's
//! address type was called `DevicePtr`, which collided with cudarc's `DevicePtr` trait (rustc's
//! `ambiguous_glob_imports`, a future error); warnings are denied here so that a name that collides
//! again fails the build of this file.
#![cfg(feature = "cuda")]
#![deny(warnings)]

use cuda_caching_allocator::interop::*;
use cuda_caching_allocator::*;
use cudarc::driver::*;

/// Generic over cudarc's trait by its bare name, as code written against cudarc is.
fn is_device_ptr<T, S: DevicePtr<T>>() -> &'static str {
    std::any::type_name::<S>()
}

#[test]
fn cudarc_trait_and_crate_address_resolve_under_globs() {
    // `DevicePtr` is cudarc's trait, and the cached buffer implements it.
    let t = std::any::type_name::<dyn DevicePtr<f32>>();
    assert!(t.contains("cudarc::driver"), "DevicePtr resolved to {t}");
    assert!(is_device_ptr::<f32, CachedSlice<f32>>().contains("CachedSlice"));
    assert!(is_device_ptr::<f32, CudaSlice<f32>>().contains("CudaSlice"));
    // The crate's address type, by its bare name.
    let a = DeviceAddr(0x1000);
    assert_eq!(a.offset(16).addr(), 0x1010);
    assert!(std::any::type_name::<DeviceAddr>().starts_with("cuda_caching_allocator::"));
}
