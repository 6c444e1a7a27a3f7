//! Configuration from the environment: the crate's own variable first, then PyTorch's.

use cuda_caching_allocator::{AllocatorConfig, ConfigError, Preset};

#[test]
fn environment_variables_in_order() {
    // SAFETY: this is the only test that touches these variables, and nothing else in the test
    // binary reads or writes the environment concurrently.
    unsafe {
        std::env::remove_var("CUDA_CACHING_ALLOCATOR_CONF");
        std::env::remove_var("PYTORCH_ALLOC_CONF");
        std::env::set_var("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64");
    }
    let c = AllocatorConfig::from_env_or(AllocatorConfig::pytorch()).unwrap();
    assert_eq!(c.max_split_size, 64 << 20);
    // SAFETY: as above.
    unsafe { std::env::set_var("CUDA_CACHING_ALLOCATOR_CONF", "expandable_segments:True") };
    let c = AllocatorConfig::from_env_or(AllocatorConfig::pytorch()).unwrap();
    assert!(c.expandable_segments);
    assert_eq!(c.max_split_size, usize::MAX, "the crate's variable wins");
    // SAFETY: as above.
    unsafe { std::env::set_var("CUDA_CACHING_ALLOCATOR_CONF", "expandable_segments:yes") };
    let e: ConfigError = AllocatorConfig::from_env_or(AllocatorConfig::pytorch()).unwrap_err();
    assert!(
        e.message()
            .starts_with("CUDA_CACHING_ALLOCATOR_CONF: Expected 'True' or 'False'"),
        "{e}"
    );
    // Regression (#14): a value that is not UTF-8 read as unset, so PyTorch's variable (set
    // above) silently applied instead. It is an error naming the variable now.
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let bad = std::ffi::OsStr::from_bytes(b"expandable_segments:\xff\xfe");
        // SAFETY: as above.
        unsafe { std::env::set_var("CUDA_CACHING_ALLOCATOR_CONF", bad) };
        let e = AllocatorConfig::from_env_or(AllocatorConfig::pytorch()).unwrap_err();
        assert!(
            e.message()
                .starts_with("CUDA_CACHING_ALLOCATOR_CONF: the value is not valid UTF-8"),
            "{e}"
        );
    }
    // SAFETY: as above.
    unsafe {
        std::env::remove_var("CUDA_CACHING_ALLOCATOR_CONF");
        std::env::remove_var("PYTORCH_CUDA_ALLOC_CONF");
    }
    assert_eq!(
        AllocatorConfig::from_env_or(Preset::Pytorch.config()).unwrap(),
        AllocatorConfig::pytorch()
    );
}

#[test]
fn presets_by_name() {
    for p in Preset::ALL {
        assert_eq!(Preset::from_name(p.name()).unwrap(), p);
        p.config().validate().unwrap();
    }
    let e = Preset::from_name("tf").unwrap_err();
    assert!(e.message().contains("known presets"));
    assert!(Preset::PytorchExpandable.config().expandable_segments);
}
