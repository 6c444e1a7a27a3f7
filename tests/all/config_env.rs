//! Configuration strings: from the environment (the crate's own variable first, then PyTorch's),
//! presets by name, round trips through `to_settings`, and values out of range.

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
    // Regression (#15): the variables were read on top of the caller's base (the crate's
    // default in the registry), so the same string meant PyTorch + it to `parse` and the crate's
    // default + it here. A string always means what `parse` reads now.
    // SAFETY: as above.
    unsafe { std::env::set_var("CUDA_CACHING_ALLOCATOR_CONF", "max_split_size_mb:256") };
    let from_env = AllocatorConfig::from_env_or(AllocatorConfig::default()).unwrap();
    assert_eq!(
        from_env,
        AllocatorConfig::parse("max_split_size_mb:256").unwrap()
    );
    assert!(!from_env.expandable_segments);
    // SAFETY: as above.
    unsafe {
        std::env::set_var(
            "CUDA_CACHING_ALLOCATOR_CONF",
            "cca_preset:default,max_split_size_mb:256",
        )
    };
    let from_env = AllocatorConfig::from_env_or(AllocatorConfig::pytorch()).unwrap();
    assert!(from_env.expandable_segments);
    assert_eq!(from_env.max_split_size, 256 << 20);
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

/// A size key given more MiB than a size holds was refused with the message for a value that is
/// too small (`large_segment_size_mb` "must be > 10") or not positive (the `cca_*_mb` keys); the
/// message now says the value is too large and names the largest one taken, the same bound
/// whether the parser or `validate` finds it.
#[test]
fn size_keys_past_their_largest_value_say_so() {
    let huge = u64::MAX.to_string();
    for key in [
        "large_segment_size_mb",
        "cca_large_page_size_mb",
        "cca_max_handle_size_mb",
        "cca_min_growth_mb",
    ] {
        let e = AllocatorConfig::parse(&format!("{key}:{huge}")).unwrap_err();
        let m = e.message();
        assert!(m.contains(key), "{key}: {m}");
        assert!(m.contains("too large"), "{key}: {m}");
        assert!(
            !m.contains("must be > 10") && !m.contains("positive"),
            "{key}: {m}"
        );
    }
    // Between the largest segment the cache serves and the largest size: refused by the parser
    // too, in the words `validate` uses for a configuration built in code.
    let e = AllocatorConfig::parse("large_segment_size_mb:2000000000000").unwrap_err();
    let built = AllocatorConfig {
        large_segment_size: 1 << 61,
        ..AllocatorConfig::pytorch()
    };
    let v = built.validate().unwrap_err();
    assert!(e.message().contains("< 1099511627776"), "{e}");
    assert!(v.message().contains("< 1099511627776"), "{v}");
}

/// The resolved configuration a report prints reads back to the same configuration.
#[test]
fn settings_string_round_trips() {
    let mut configs: Vec<AllocatorConfig> = Preset::ALL.iter().map(|p| p.config()).collect();
    configs.push(
        AllocatorConfig::builder()
            .max_split_size_mb(256)
            .max_non_split_rounding_mb(64)
            .large_segment_size_mb(40)
            .roundup_power2_divisions_per_bucket([1, 2, 4, 4, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 16])
            .garbage_collection_threshold(0.6)
            .memory_fraction(0.75)
            .throw_on_cudamalloc_oom(true)
            .expandable_max_handle_size_mb(64)
            .fast_path(true)
            .cross_stream_reuse(true)
            .build()
            .unwrap(),
    );
    configs.push(
        AllocatorConfig::builder()
            .roundup_power2_divisions(4)
            .build()
            .unwrap(),
    );
    configs.push(AllocatorConfig {
        settings: String::new(),
        ..AllocatorConfig::parse(
            "expandable_segments:True,cca_min_growth_mb:20,cca_handle_per_growth:True,graph_capture_record_stream_reuse:True,cca_page_reuse:device,cca_page_reuse_fence:True",
        )
        .unwrap()
    });
    for c in configs {
        let s = c.to_settings();
        let back = AllocatorConfig::parse(&s).unwrap();
        assert_eq!(
            AllocatorConfig {
                settings: String::new(),
                ..back
            },
            c,
            "{s}"
        );
    }
    assert_eq!(AllocatorConfig::pytorch().to_settings(), "");
    assert_eq!(
        AllocatorConfig::parse("expandable_segments:True")
            .unwrap()
            .matching_preset(),
        Some(Preset::PytorchExpandable)
    );
    assert_eq!(
        AllocatorConfig::parse("max_split_size_mb:256")
            .unwrap()
            .matching_preset(),
        None
    );
}

/// One base for the library's entry points (#15): the builder, `parse` and the environment start
/// from PyTorch's defaults; `AllocatorConfig::default()` is the crate's own tuned configuration
/// and is reached by name (`cca_preset:default`, `AllocatorConfigBuilder::from_config`).
#[test]
fn builder_and_parse_share_pytorchs_base() {
    let bare = |c: AllocatorConfig| AllocatorConfig {
        settings: String::new(),
        ..c
    };
    let built = AllocatorConfig::builder().build().unwrap();
    assert_eq!(
        bare(built.clone()),
        bare(AllocatorConfig::parse("").unwrap())
    );
    assert_eq!(bare(built), AllocatorConfig::pytorch());
    assert_eq!(
        bare(AllocatorConfig::parse("cca_preset:default").unwrap()),
        bare(AllocatorConfig::default())
    );
    assert_ne!(AllocatorConfig::default(), AllocatorConfig::pytorch());
}
