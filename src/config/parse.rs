//! PyTorch's allocator configuration syntax: `key:value` pairs separated by `,`, lists in
//! `[...]`, tokens split on `, : [ ]`, white space ignored, booleans exactly `True` / `False`.
//! Keys, value ranges and error messages follow PyTorch 2.11 (`ConfigTokenizer`,
//! `AcceleratorAllocatorConfig::parseArgs`, `CUDAAllocatorConfig::parseArgs`).
#![forbid(unsafe_code)]

use super::{
    AllocatorConfig, ConfigError, LARGE_BUFFER, MAX_ALLOCATION_SIZE, MIB, MIN_LARGE_ALLOC,
    PageReuse, ROUNDUP_POWER2_BUCKETS,
};

/// The crate's own environment variable, read before `PYTORCH_CUDA_ALLOC_CONF`.
pub const ENV_VAR: &str = "CUDA_CACHING_ALLOCATOR_CONF";

struct Tokens {
    tokens: Vec<String>,
}

impl Tokens {
    fn new(s: &str) -> Self {
        let mut tokens = Vec::new();
        let mut buf = String::new();
        for ch in s.chars() {
            if matches!(ch, ',' | ':' | '[' | ']') {
                if !buf.is_empty() {
                    tokens.push(std::mem::take(&mut buf));
                }
                tokens.push(ch.to_string());
            } else if !ch.is_whitespace() {
                buf.push(ch);
            }
        }
        if !buf.is_empty() {
            tokens.push(buf);
        }
        Tokens { tokens }
    }

    fn len(&self) -> usize {
        self.tokens.len()
    }

    fn get(&self, i: usize) -> Result<&str, ConfigError> {
        self.tokens.get(i).map(String::as_str).ok_or_else(|| {
            ConfigError::new(
                "Index out of bounds in ConfigTokenizer (the configuration ends too early)",
            )
        })
    }

    fn expect(&self, i: usize, token: &str) -> Result<(), ConfigError> {
        let got = self.get(i)?;
        if got == token {
            Ok(())
        } else {
            Err(ConfigError::new(format!(
                "Expected '{token}' in ConfigTokenizer but got '{got}'"
            )))
        }
    }

    fn size(&self, i: usize, key: &str) -> Result<usize, ConfigError> {
        let t = self.get(i)?;
        t.parse::<usize>().map_err(|_| {
            ConfigError::new(format!(
                "Expected an unsigned integer for '{key}' but got '{t}'"
            ))
        })
    }

    fn double(&self, i: usize, key: &str) -> Result<f64, ConfigError> {
        let t = self.get(i)?;
        t.parse::<f64>()
            .ok()
            .filter(|v| v.is_finite())
            .ok_or_else(|| ConfigError::new(format!("Expected a number for '{key}' but got '{t}'")))
    }

    /// A boolean value of `key`; the error keeps PyTorch's words and adds the key and the values
    /// it takes.
    fn boolean(&self, i: usize, key: &str) -> Result<bool, ConfigError> {
        match self.get(i)? {
            "True" => Ok(true),
            "False" => Ok(false),
            other => Err(ConfigError::new(format!(
                "Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{other}' \
                 (key '{key}' takes True or False, with capitals)"
            ))),
        }
    }

    /// Skips a key's value (a token or a bracketed list); returns the index of its last token.
    fn skip_value(&self, mut i: usize) -> Result<usize, ConfigError> {
        self.expect(i + 1, ":")?;
        i += 2;
        if self.get(i)? != "[" {
            return Ok(i);
        }
        loop {
            i += 1;
            match self.tokens.get(i) {
                Some(t) if t == "]" => return Ok(i),
                Some(_) => {}
                None => {
                    return Err(ConfigError::new(
                        "Expected closing bracket ']' in ConfigTokenizer but reached end of config",
                    ));
                }
            }
        }
    }
}

/// The `key:value` items of a settings string as PyTorch's tokenizer reads them (white space
/// dropped, a bracketed list one value), in order, with each value's tokens joined back
/// (`[1:4,>:8]`). Reading stops at the first item it cannot read; strings that
/// [`apply`] accepts are read whole.
pub(super) fn items(settings: &str) -> Vec<(String, String)> {
    let t = Tokens::new(settings);
    let mut out = Vec::new();
    let mut i = 0;
    while i < t.len() {
        let Ok(key) = t.get(i) else { break };
        if key == "," {
            i += 1;
            continue;
        }
        let Ok(end) = t.skip_value(i) else { break };
        out.push((key.to_owned(), t.tokens[i + 2..=end].concat()));
        i = end + 1;
    }
    out
}

/// Keys PyTorch accepts that configure only its pinned host allocator or its other backend; this
/// crate accepts and ignores them so one configuration string serves both.
const IGNORED_KEYS: &[&str] = &[
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
    "pinned_free_catch_all",
    "expandable_segments_reserve",
    "expandable_segments_reserve_by_class",
];

/// Every key `apply_keys` reads (the ignored ones aside), for the hint of an unknown key.
const KEYS: &[&str] = &[
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "large_segment_size_mb",
    "garbage_collection_threshold",
    "per_process_memory_fraction",
    "roundup_power2_divisions",
    "expandable_segments",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "throw_on_cudamalloc_oom",
    "graph_capture_record_stream_reuse",
    "cca_large_page_size_mb",
    "cca_max_handle_size_mb",
    "cca_min_growth_mb",
    "cca_handle_per_growth",
    "cca_page_reuse",
    "cca_page_reuse_slack",
    "cca_page_reuse_fence",
    "cca_borrow_blocks",
    "cca_page_lending",
    "cca_unmap_helper",
    "cca_page_move_budget",
    "cca_precise_cap",
    "cca_fast_path",
    "cca_cross_stream_reuse",
    "cca_preset",
    "backend",
];

/// What follows PyTorch's words for an unknown key: `key=value` written for `key:value`, or the
/// known key a typo is closest to (at most two edits, or a quarter of the key's length).
fn unknown_key_hint(key: &str) -> String {
    if let Some((k, v)) = key.split_once('=') {
        if !k.is_empty() && !v.is_empty() {
            return format!(" Keys and values are separated by ':', as in '{k}:{v}'.");
        }
    }
    let limit = (key.chars().count() / 4).max(2);
    KEYS.iter()
        .chain(IGNORED_KEYS)
        .map(|k| (edit_distance(key, k), *k))
        .filter(|&(d, _)| d <= limit)
        .min()
        .map(|(_, k)| format!(" Did you mean '{k}'? (Every key: docs/configuration.md.)"))
        .unwrap_or_default()
}

/// Levenshtein distance between two strings, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = Vec::with_capacity(b.len() + 1);
        cur.push(i + 1);
        for (j, &cb) in b.iter().enumerate() {
            let substitute = prev[j] + usize::from(ca != cb);
            cur.push(substitute.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

pub(super) fn apply(c: AllocatorConfig, settings: &str) -> Result<AllocatorConfig, ConfigError> {
    let mut key = String::new();
    apply_keys(c, settings, &mut key).map_err(|e| name_key(e, &key))
}

/// `e` with the key whose setting it met, where PyTorch's words leave the key out (a value
/// missing at the end, an interval that is not a power of two).
fn name_key(e: ConfigError, key: &str) -> ConfigError {
    if key.is_empty() || e.message().contains(key) {
        e
    } else {
        ConfigError::new(format!(
            "{} (in the setting of '{key}')",
            e.message().trim_end()
        ))
    }
}

/// A size key's value of more MiB than it takes: names the key, the value and the bound (the
/// messages for values that are too small or zero would mislead here).
fn too_large(key: &str, mb: usize, below: bool, bound: u64, why: &str) -> ConfigError {
    let rule = if below { "<" } else { "at most" };
    ConfigError::new(format!(
        "{key}: {mb} MiB is too large; it must be {rule} {bound} MiB ({why})"
    ))
}

/// [`apply`]'s work; `current` holds the key being read when an error ends it (empty once the
/// keys are read).
fn apply_keys(
    mut c: AllocatorConfig,
    settings: &str,
    current: &mut String,
) -> Result<AllocatorConfig, ConfigError> {
    // PyTorch resets these three on every parse.
    c.max_split_size = usize::MAX;
    c.roundup_power2_divisions = [0; ROUNDUP_POWER2_BUCKETS];
    c.garbage_collection_threshold = 0.0;
    c.settings = settings.to_string();

    let t = Tokens::new(settings);
    let mut i = 0;
    while i < t.len() {
        let key = t.get(i)?.to_string();
        current.clone_from(&key);
        match key.as_str() {
            "max_split_size_mb" => {
                t.expect(i + 1, ":")?;
                i += 2;
                let mb = t.size(i, &key)?;
                if mb < LARGE_BUFFER / MIB {
                    return Err(ConfigError::new(format!(
                        "CachingAllocator option max_split_size_mb too small, must be >= {}",
                        LARGE_BUFFER / MIB
                    )));
                }
                c.max_split_size = mb.min(usize::MAX / MIB) * MIB;
            }
            "max_non_split_rounding_mb" => {
                t.expect(i + 1, ":")?;
                i += 2;
                let mb = t.size(i, &key)?;
                if mb < LARGE_BUFFER / MIB {
                    return Err(ConfigError::new(format!(
                        "CachingAllocator option max_non_split_rounding_mb too small, must be >= {}",
                        LARGE_BUFFER / MIB
                    )));
                }
                c.max_non_split_rounding = mb.min(usize::MAX / MIB) * MIB;
            }
            "large_segment_size_mb" => {
                t.expect(i + 1, ":")?;
                i += 2;
                let mb = t.size(i, &key)?;
                if mb <= MIN_LARGE_ALLOC / MIB {
                    return Err(ConfigError::new(format!(
                        "CachingAllocator option large_segment_size_mb must be > {}",
                        MIN_LARGE_ALLOC / MIB
                    )));
                }
                let max = MAX_ALLOCATION_SIZE / MIB as u64;
                if mb as u64 >= max {
                    return Err(too_large(
                        &key,
                        mb,
                        true,
                        max,
                        "1 EiB: the cache serves no request that large",
                    ));
                }
                c.large_segment_size = mb * MIB;
            }
            "garbage_collection_threshold" => {
                t.expect(i + 1, ":")?;
                i += 2;
                let v = t.double(i, &key)?;
                if !(v > 0.0 && v < 1.0) {
                    return Err(ConfigError::new(
                        "garbage_collect_threshold is invalid, set it in (0.0, 1.0)",
                    ));
                }
                c.garbage_collection_threshold = v;
            }
            "per_process_memory_fraction" => {
                t.expect(i + 1, ":")?;
                i += 2;
                let v = t.double(i, &key)?;
                if !(0.0..=1.0).contains(&v) {
                    return Err(ConfigError::new(
                        "per_process_memory_fraction is invalid, set it in [0.0, 1.0]",
                    ));
                }
                c.per_process_memory_fraction = v;
            }
            "roundup_power2_divisions" => {
                i = parse_divisions(&t, i, &mut c.roundup_power2_divisions)?;
            }
            "expandable_segments" => {
                t.expect(i + 1, ":")?;
                i += 2;
                c.expandable_segments = t.boolean(i, &key)?;
            }
            "release_lock_on_cudamalloc" | "release_lock_on_hipmalloc" => {
                t.expect(i + 1, ":")?;
                i += 2;
                c.release_lock_on_cudamalloc = t.boolean(i, &key)?;
            }
            "throw_on_cudamalloc_oom" => {
                t.expect(i + 1, ":")?;
                i += 2;
                c.throw_on_cudamalloc_oom = t.boolean(i, &key)?;
            }
            "graph_capture_record_stream_reuse" => {
                t.expect(i + 1, ":")?;
                i += 2;
                c.graph_capture_record_stream_reuse = t.boolean(i, &key)?;
            }
            // Crate-specific keys (prefix `cca_`); PyTorch does not know them.
            "cca_large_page_size_mb" => {
                t.expect(i + 1, ":")?;
                i += 2;
                let mb = t.size(i, &key)?;
                if mb == 0 {
                    return Err(ConfigError::new(
                        "cca_large_page_size_mb must be a whole, positive number of MiB",
                    ));
                }
                if mb > usize::MAX / MIB {
                    let max = (usize::MAX / MIB) as u64;
                    return Err(too_large(&key, mb, false, max, "the largest size in bytes"));
                }
                c.expandable_large_page_size = Some(mb * MIB);
            }
            "cca_max_handle_size_mb" => {
                t.expect(i + 1, ":")?;
                i += 2;
                let mb = t.size(i, &key)?;
                if mb == 0 {
                    return Err(ConfigError::new(
                        "cca_max_handle_size_mb must be a whole, positive number of MiB",
                    ));
                }
                if mb > usize::MAX / MIB {
                    let max = (usize::MAX / MIB) as u64;
                    return Err(too_large(&key, mb, false, max, "the largest size in bytes"));
                }
                c.expandable_max_handle_size = Some(mb * MIB);
            }
            "cca_min_growth_mb" => {
                t.expect(i + 1, ":")?;
                i += 2;
                let mb = t.size(i, &key)?;
                if mb > usize::MAX / MIB {
                    let max = (usize::MAX / MIB) as u64;
                    return Err(too_large(&key, mb, false, max, "the largest size in bytes"));
                }
                c.expandable_min_growth = mb * MIB;
            }
            "cca_handle_per_growth" => {
                t.expect(i + 1, ":")?;
                i += 2;
                c.expandable_handle_per_growth = t.boolean(i, &key)?;
            }
            "cca_page_reuse" => {
                t.expect(i + 1, ":")?;
                i += 2;
                c.page_reuse = match t.get(i)? {
                    "off" => PageReuse::Off,
                    "segment" => PageReuse::Segment,
                    "device" => PageReuse::Device,
                    other => {
                        return Err(ConfigError::new(format!(
                            "cca_page_reuse must be off, segment or device (got '{other}')"
                        )));
                    }
                };
            }
            "cca_page_reuse_slack" => {
                t.expect(i + 1, ":")?;
                i += 2;
                let v = t.double(i, &key)?;
                if !(0.0..=1.0).contains(&v) {
                    return Err(ConfigError::new(
                        "cca_page_reuse_slack is invalid, set it in [0.0, 1.0]",
                    ));
                }
                c.page_reuse_slack = v;
            }
            "cca_page_reuse_fence" => {
                t.expect(i + 1, ":")?;
                i += 2;
                c.page_reuse_fence = t.boolean(i, &key)?;
            }
            "cca_borrow_blocks" => {
                t.expect(i + 1, ":")?;
                i += 2;
                c.borrow_blocks = t.boolean(i, &key)?;
            }
            "cca_page_lending" => {
                t.expect(i + 1, ":")?;
                i += 2;
                c.page_lending = t.boolean(i, &key)?;
            }
            "cca_unmap_helper" => {
                t.expect(i + 1, ":")?;
                i += 2;
                c.unmap_helper = t.boolean(i, &key)?;
            }
            "cca_page_move_budget" => {
                t.expect(i + 1, ":")?;
                i += 2;
                c.page_move_budget = t.size(i, &key)? as u64;
            }
            "cca_precise_cap" => {
                t.expect(i + 1, ":")?;
                i += 2;
                c.precise_fraction_cap = t.boolean(i, &key)?;
            }
            "cca_fast_path" => {
                t.expect(i + 1, ":")?;
                i += 2;
                c.fast_path = t.boolean(i, &key)?;
            }
            "cca_cross_stream_reuse" => {
                t.expect(i + 1, ":")?;
                i += 2;
                c.cross_stream_reuse = t.boolean(i, &key)?;
            }
            "cca_preset" => {
                // This crate's key: start over from a named preset; keys after it apply on top.
                t.expect(i + 1, ":")?;
                i += 2;
                let preset = super::Preset::from_name(t.get(i)?)?;
                c = preset.config();
                c.settings = settings.to_string();
            }
            "backend" => {
                t.expect(i + 1, ":")?;
                i += 2;
                match t.get(i)? {
                    "native" => {}
                    "cudaMallocAsync" => {
                        return Err(ConfigError::new(
                            "backend:cudaMallocAsync is not provided by this crate (it is the driver's own pool); \
                             use backend:native or leave the key out",
                        ));
                    }
                    other => {
                        return Err(ConfigError::new(format!(
                            "Unknown allocator backend, options are native and cudaMallocAsync (got '{other}')"
                        )));
                    }
                }
            }
            k if IGNORED_KEYS.contains(&k) => {
                i = t.skip_value(i)?;
            }
            _ => {
                return Err(ConfigError::new(format!(
                    "Unrecognized key '{key}' in CUDA allocator config.{}",
                    unknown_key_hint(&key)
                )));
            }
        }
        if i + 1 < t.len() {
            i += 1;
            t.expect(i, ",")?;
        }
        i += 1;
    }
    current.clear();
    c.validate()?;
    Ok(c)
}

fn parse_divisions(
    t: &Tokens,
    mut i: usize,
    out: &mut [usize; ROUNDUP_POWER2_BUCKETS],
) -> Result<usize, ConfigError> {
    let key = "roundup_power2_divisions";
    t.expect(i + 1, ":")?;
    i += 2;
    if t.get(i)? != "[" {
        let v = t.size(i, key)?;
        if !v.is_power_of_two() {
            return Err(ConfigError::new(
                "For roundups, the divisions has to be power of 2 ",
            ));
        }
        *out = [v; ROUNDUP_POWER2_BUCKETS];
        return Ok(i);
    }
    let mut first = true;
    let mut last_index = 0usize;
    loop {
        i += 1;
        match t.tokens.get(i) {
            None => {
                return Err(ConfigError::new(
                    "Expected closing bracket ']' in ConfigTokenizer but reached end of config",
                ));
            }
            Some(tok) if tok == "]" => return Ok(i),
            Some(_) => {}
        }
        let value_index = i;
        t.expect(i + 1, ":")?;
        i += 2;
        let value = t.size(i, key)?;
        if value != 0 && !value.is_power_of_two() {
            return Err(ConfigError::new(
                "For roundups, the divisions has to be power of 2 or 0 to disable roundup ",
            ));
        }
        if t.get(value_index)? == ">" {
            for slot in out.iter_mut().skip(last_index + 1) {
                *slot = value;
            }
        } else {
            let boundary = t.size(value_index, key)?;
            if !boundary.is_power_of_two() {
                return Err(ConfigError::new(format!(
                    "For roundups, the intervals have to be power of 2 {boundary}"
                )));
            }
            let index = (boundary.trailing_zeros() as usize).min(ROUNDUP_POWER2_BUCKETS - 1);
            if first {
                for slot in out.iter_mut().take(index) {
                    *slot = value;
                }
                first = false;
            }
            out[index] = value;
            last_index = index;
        }
        match t.tokens.get(i + 1).map(String::as_str) {
            Some("]") => {}
            Some(_) => {
                i += 1;
                t.expect(i, ",")?;
            }
            None => {
                return Err(ConfigError::new(
                    "Expected closing bracket ']' in ConfigTokenizer but reached end of config",
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<AllocatorConfig, ConfigError> {
        apply(AllocatorConfig::pytorch(), s)
    }

    fn err(s: &str) -> String {
        parse(s).unwrap_err().to_string()
    }

    #[test]
    fn empty_string_is_pytorch_defaults() {
        let c = parse("").unwrap();
        assert_eq!(
            c,
            AllocatorConfig {
                settings: String::new(),
                ..AllocatorConfig::pytorch()
            }
        );
        assert!(parse("  ").is_ok());
    }

    #[test]
    fn scalar_keys() {
        let c = parse(
            "max_split_size_mb:128, garbage_collection_threshold:0.6,expandable_segments:True",
        )
        .unwrap();
        assert_eq!(c.max_split_size, 128 * MIB);
        assert_eq!(c.garbage_collection_threshold, 0.6);
        assert!(c.expandable_segments);
        let c = parse("max_non_split_rounding_mb:40,large_segment_size_mb:32,per_process_memory_fraction:0.25").unwrap();
        assert_eq!(c.max_non_split_rounding, 40 * MIB);
        assert_eq!(c.large_segment_size, 32 * MIB);
        assert_eq!(c.per_process_memory_fraction, 0.25);
        let c =
            parse("release_lock_on_cudamalloc:True,backend:native,pinned_num_register_threads:8")
                .unwrap();
        assert!(c.release_lock_on_cudamalloc);
        assert!(!c.fast_path);
        assert!(parse("cca_fast_path:True").unwrap().fast_path);
        let c = apply(AllocatorConfig::default(), "cca_fast_path:False").unwrap();
        assert!(!c.fast_path);
        assert!(err("cca_fast_path:yes").contains("Expected 'True' or 'False'"));
    }

    #[test]
    fn cross_stream_reuse_key() {
        assert!(!parse("").unwrap().cross_stream_reuse);
        assert!(
            parse("cca_cross_stream_reuse:True")
                .unwrap()
                .cross_stream_reuse
        );
        assert!(
            !parse("cca_cross_stream_reuse:False")
                .unwrap()
                .cross_stream_reuse
        );
        let c = parse("expandable_segments:True, cca_cross_stream_reuse : True").unwrap();
        assert!(c.cross_stream_reuse && c.expandable_segments);
        let c = apply(AllocatorConfig::default(), "cca_cross_stream_reuse:True").unwrap();
        assert!(c.cross_stream_reuse && c.expandable_segments);
        assert_eq!(
            err("cca_cross_stream_reuse:yes"),
            "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'yes' \
             (key 'cca_cross_stream_reuse' takes True or False, with capitals)"
        );
        assert_eq!(
            err("cca_cross_stream_reuse:1"),
            "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got '1' \
             (key 'cca_cross_stream_reuse' takes True or False, with capitals)"
        );
        assert!(err("cca_cross_stream_reuse").contains("ends too early"));
        // A preset named after the key starts over (off again).
        let c = parse("cca_cross_stream_reuse:True,cca_preset:pytorch").unwrap();
        assert!(!c.cross_stream_reuse);
        let b = AllocatorConfig::builder()
            .cross_stream_reuse(true)
            .build()
            .unwrap();
        assert!(b.cross_stream_reuse);
    }

    #[test]
    fn divisions_scalar_and_list() {
        let c = parse("roundup_power2_divisions:4").unwrap();
        assert_eq!(c.roundup_power2_divisions, [4; 16]);
        let c = parse("roundup_power2_divisions:[64:8,256:4,1024:4,>:1]").unwrap();
        // The first key fills the buckets below it; buckets between keys (7 and 9) keep their
        // reset value 0, exactly as PyTorch leaves them; `>` fills the buckets after the last key.
        assert_eq!(
            c.roundup_power2_divisions,
            [8, 8, 8, 8, 8, 8, 8, 0, 4, 0, 4, 1, 1, 1, 1, 1]
        );
    }

    #[test]
    fn every_key_of_the_hint_list_is_read() {
        for key in KEYS {
            let e = apply(AllocatorConfig::pytorch(), &format!("{key}:x")).unwrap_err();
            assert!(!e.message().contains("Unrecognized key"), "{key}: {e}");
        }
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("same", "same"), 0);
    }

    #[test]
    fn errors_use_pytorch_words() {
        assert_eq!(
            err("foo:1"),
            "Unrecognized key 'foo' in CUDA allocator config."
        );
        assert_eq!(
            err("max_split_size_mb:19"),
            "CachingAllocator option max_split_size_mb too small, must be >= 20"
        );
        assert_eq!(
            err("garbage_collection_threshold:1.0"),
            "garbage_collect_threshold is invalid, set it in (0.0, 1.0) \
             (in the setting of 'garbage_collection_threshold')"
        );
        assert_eq!(
            err("expandable_segments:true"),
            "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'true' \
             (key 'expandable_segments' takes True or False, with capitals)"
        );
        assert_eq!(
            err("max_split_size_mb=20"),
            "Unrecognized key 'max_split_size_mb=20' in CUDA allocator config. Keys and values \
             are separated by ':', as in 'max_split_size_mb:20'."
        );
        assert_eq!(
            err("max_split_sise_mb:20"),
            "Unrecognized key 'max_split_sise_mb' in CUDA allocator config. Did you mean \
             'max_split_size_mb'? (Every key: docs/configuration.md.)"
        );
        assert!(err("cca_page_reuse_slak:0.01").contains("Did you mean 'cca_page_reuse_slack'?"));
        assert!(!err("=5").contains("as in"), "{}", err("=5"));
        assert!(!err("中中中_preset:1").contains("Did you mean"));
        assert_eq!(
            err("roundup_power2_divisions:3"),
            "For roundups, the divisions has to be power of 2 \
             (in the setting of 'roundup_power2_divisions')"
        );
        assert_eq!(
            err("roundup_power2_divisions:[3:4]"),
            "For roundups, the intervals have to be power of 2 3 \
             (in the setting of 'roundup_power2_divisions')"
        );
        assert!(err("roundup_power2_divisions:[64:4").contains("']'"));
        // Regression (#14): 2^55 divisions passed and overflowed every rounding.
        for too_many in [
            "roundup_power2_divisions:36028797018963968",
            "roundup_power2_divisions:[64:36028797018963968]",
            "roundup_power2_divisions:[64:4,>:9223372036854775808]",
        ] {
            let e = err(too_many);
            assert!(
                e.contains("too many") && e.contains("2^54"),
                "{too_many}: {e}"
            );
        }
        assert!(parse("roundup_power2_divisions:18014398509481984").is_ok());
        assert!(err("max_split_size_mb:abc").contains("'abc'"));
        for cut in ["max_split_size_mb", "max_split_size_mb:"] {
            let e = err(cut);
            assert!(
                e.contains("ends too early") && e.contains("'max_split_size_mb'"),
                "{e}"
            );
        }
        assert!(
            err("expandable_segments:True;max_split_size_mb:20")
                .contains("Expected 'True' or 'False'")
        );
        assert_eq!(
            err("expandable_segments:True max_split_size_mb:20"),
            "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'Truemax_split_size_mb' \
             (key 'expandable_segments' takes True or False, with capitals)"
        );
        assert!(err("per_process_memory_fraction:1.5").contains("[0.0, 1.0]"));
        assert!(err("large_segment_size_mb:10").contains("> 10"));
        // Past the largest allocation the cache accepts, every mid-size allocation would ask
        // the device for an impossible segment and fail as out of memory.
        let huge = parse("large_segment_size_mb:17592186044415");
        let e = huge
            .and_then(|c| c.validate().map(|()| c))
            .unwrap_err()
            .to_string();
        assert!(e.contains("< 1099511627776"), "{e}");
        assert!(err("backend:cudaMallocAsync").contains("cudaMallocAsync"));
    }

    #[test]
    fn parse_resets_the_three_reset_keys() {
        let c = parse("max_split_size_mb:64,roundup_power2_divisions:2").unwrap();
        let c = apply(c, "expandable_segments:True").unwrap();
        assert_eq!(c.max_split_size, usize::MAX);
        assert_eq!(c.roundup_power2_divisions, [0; 16]);
        assert!(c.expandable_segments);
    }
}

#[cfg(test)]
mod preset_key_tests {
    use super::*;

    #[test]
    fn cca_preset_starts_over_from_a_preset() {
        let c = apply(AllocatorConfig::default(), "cca_preset:pytorch").unwrap();
        assert_eq!(
            AllocatorConfig {
                settings: String::new(),
                ..c.clone()
            },
            AllocatorConfig::pytorch()
        );
        let c = apply(
            AllocatorConfig::pytorch(),
            "cca_preset:pytorch-expandable,max_split_size_mb:64",
        )
        .unwrap();
        assert!(c.expandable_segments);
        assert_eq!(c.max_split_size, 64 << 20);
        assert!(
            apply(AllocatorConfig::pytorch(), "cca_preset:nope")
                .unwrap_err()
                .message()
                .contains("known presets")
        );
    }
}
