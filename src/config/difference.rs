//! Two configurations compared key by key, in PyTorch's syntax: what a settings string would
//! change in a running configuration (the PyTorch package warns with it when
//! `torch.cuda.memory._set_allocator_settings` names keys that the crate's caches, configured once,
//! do not take at run time).
#![forbid(unsafe_code)]

use std::fmt;

use super::parse::items;
use super::{AllocatorConfig, ConfigError};

/// One key whose value differs between two configurations ([`AllocatorConfig::differences`]).
/// Values are written as [`AllocatorConfig::to_settings`] writes them; `None` stands for
/// PyTorch's default, which `to_settings` leaves out.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SettingDifference {
    /// The key, as a configuration string names it (`max_split_size_mb`, `cca_page_reuse`, ...).
    pub key: String,
    /// The value in the configuration compared (`self`).
    pub from: Option<String>,
    /// The value in the other configuration.
    pub to: Option<String>,
}

impl fmt::Display for SettingDifference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "PyTorch's default".into());
        write!(
            f,
            "{} ({} -> {})",
            self.key,
            show(&self.from),
            show(&self.to)
        )
    }
}

impl AllocatorConfig {
    /// The keys whose values differ between `self` and `other`, in the order
    /// [`AllocatorConfig::to_settings`] writes keys (those of `self` first). Only what
    /// `to_settings` writes is compared: the configuration string kept in `settings` is not.
    ///
    /// ```
    /// use cuda_caching_allocator::AllocatorConfig;
    /// let running = AllocatorConfig::default();
    /// let asked = running.clone().with_settings("expandable_segments:False").unwrap();
    /// let d = running.differences(&asked);
    /// assert_eq!(d.len(), 1);
    /// assert_eq!(d[0].to_string(), "expandable_segments (True -> PyTorch's default)");
    /// assert_eq!(
    ///     asked.differences(&running)[0].to_string(),
    ///     "expandable_segments (PyTorch's default -> True)"
    /// );
    /// assert!(running.differences(&running.clone()).is_empty());
    /// ```
    pub fn differences(&self, other: &AllocatorConfig) -> Vec<SettingDifference> {
        let ours = items(&self.to_settings());
        let theirs = items(&other.to_settings());
        let mut out = Vec::new();
        for (key, value) in &ours {
            let to = lookup(&theirs, key);
            if to != Some(value.as_str()) {
                out.push(SettingDifference {
                    key: key.clone(),
                    from: Some(value.clone()),
                    to: to.map(str::to_owned),
                });
            }
        }
        for (key, value) in &theirs {
            if lookup(&ours, key).is_none() {
                out.push(SettingDifference {
                    key: key.clone(),
                    from: None,
                    to: Some(value.clone()),
                });
            }
        }
        out
    }

    /// The keys that `settings` names whose values in it differ from `self`'s (all of `self`'s
    /// differences from the result when it names a `cca_preset`), as
    /// [`AllocatorConfig::differences`] reports them, except that a value `settings` sets to
    /// PyTorch's default is written as `settings` wrote it. Keys `settings` does not name are
    /// left out, even those [`AllocatorConfig::with_settings`] resets (a running
    /// configuration's `max_split_size_mb` is not what a string about another key asks to
    /// change).
    ///
    /// ```
    /// use cuda_caching_allocator::AllocatorConfig;
    /// let running = AllocatorConfig::parse("expandable_segments:True,max_split_size_mb:256").unwrap();
    /// let d = running.differences_with_settings("expandable_segments:False").unwrap();
    /// assert_eq!(d.len(), 1);
    /// assert_eq!(d[0].to_string(), "expandable_segments (True -> False)");
    /// ```
    ///
    /// # Errors
    /// A [`ConfigError`] naming the bad key, token or value of `settings`.
    pub fn differences_with_settings(
        &self,
        settings: &str,
    ) -> Result<Vec<SettingDifference>, ConfigError> {
        let next = self.clone().with_settings(settings)?;
        // Keys as the tokenizer reads them; a `cca_preset` replaces whatever came before it, so
        // only the items after the last one say what was asked.
        let given: Vec<(String, String)> = items(settings)
            .into_iter()
            .map(|(k, v)| (canonical_key(&k).to_owned(), v))
            .collect();
        let after_preset = given
            .iter()
            .rposition(|(k, _)| k == "cca_preset")
            .map_or(0, |i| i + 1);
        let asked = &given[after_preset..];
        let last = |key: &str| {
            asked
                .iter()
                .rev()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone())
        };
        let mut out = self.differences(&next);
        if after_preset == 0 {
            out.retain(|d| last(&d.key).is_some());
        }
        for d in &mut out {
            if d.to.is_none() {
                d.to = last(&d.key);
            }
        }
        Ok(out)
    }
}

/// The key [`AllocatorConfig::to_settings`] writes for a key a string may name.
fn canonical_key(key: &str) -> &str {
    match key {
        "release_lock_on_hipmalloc" => "release_lock_on_cudamalloc",
        k => k,
    }
}

fn lookup<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Preset;

    #[test]
    fn items_keep_bracketed_lists_whole() {
        let p = items("a:1,roundup_power2_divisions:[1:4,>:8],b:True");
        assert_eq!(
            p,
            vec![
                ("a".to_owned(), "1".to_owned()),
                (
                    "roundup_power2_divisions".to_owned(),
                    "[1:4,>:8]".to_owned()
                ),
                ("b".to_owned(), "True".to_owned()),
            ]
        );
        assert!(items("").is_empty());
    }

    #[test]
    fn a_key_set_only_on_one_side_is_named_with_pytorch_default_on_the_other() {
        let pytorch = Preset::Pytorch.config();
        let split = pytorch
            .differences_with_settings("max_split_size_mb:256")
            .unwrap();
        assert_eq!(split.len(), 1);
        assert_eq!(split[0].key, "max_split_size_mb");
        assert_eq!(split[0].from, None);
        assert_eq!(split[0].to.as_deref(), Some("256"));
        // A key the string does not name is not reported, though with_settings resets it.
        let with_split = pytorch
            .clone()
            .with_settings("max_split_size_mb:256")
            .unwrap();
        let other = with_split
            .differences_with_settings("garbage_collection_threshold:0.5")
            .unwrap();
        let keys: Vec<&str> = other.iter().map(|d| d.key.as_str()).collect();
        assert_eq!(keys, ["garbage_collection_threshold"]);
        assert!(
            with_split
                .differences_with_settings("pinned_use_background_threads:True")
                .unwrap()
                .is_empty()
        );
        // A value set back to PyTorch's default is written as the string wrote it.
        let flag = AllocatorConfig::default()
            .differences_with_settings("expandable_segments: False")
            .unwrap();
        assert_eq!(flag.len(), 1, "{flag:?}");
        assert_eq!(flag[0].to_string(), "expandable_segments (True -> False)");
        // An alias is matched to the key to_settings writes.
        let lock = pytorch
            .differences_with_settings("release_lock_on_hipmalloc:True")
            .unwrap();
        assert_eq!(lock.len(), 1, "{lock:?}");
        assert_eq!(lock[0].key, "release_lock_on_cudamalloc");
    }

    #[test]
    fn the_last_setting_of_a_key_after_the_last_preset_is_the_one_reported() {
        let running = AllocatorConfig::default();
        let d = running
            .differences_with_settings("expandable_segments:True,expandable_segments:False")
            .unwrap();
        assert_eq!(d[0].to_string(), "expandable_segments (True -> False)");
        let split = AllocatorConfig::parse("max_split_size_mb:256").unwrap();
        let d = split
            .differences_with_settings("max_split_size_mb:300,cca_preset:pytorch")
            .unwrap();
        let m = d.iter().find(|d| d.key == "max_split_size_mb").unwrap();
        assert_eq!(
            m.to_string(),
            "max_split_size_mb (256 -> PyTorch's default)"
        );
        // Whitespace inside a key is dropped, as the tokenizer drops it.
        let d = AllocatorConfig::pytorch()
            .differences_with_settings("max_split _size_mb:256")
            .unwrap();
        assert_eq!(d.len(), 1, "{d:?}");
    }

    #[test]
    fn a_preset_in_the_string_reports_every_difference() {
        let d = Preset::Pytorch
            .config()
            .differences_with_settings("cca_preset:default")
            .unwrap();
        assert!(d.iter().any(|d| d.key == "expandable_segments"), "{d:?}");
        assert!(d.len() > 3, "{d:?}");
    }

    #[test]
    fn the_same_values_again_change_nothing() {
        let running = AllocatorConfig::default();
        assert!(
            running
                .differences_with_settings(&running.to_settings())
                .unwrap()
                .is_empty()
        );
        // Keys the crate accepts and ignores (PyTorch's pinned allocator) change nothing either.
        assert!(
            running
                .differences_with_settings("pinned_use_cuda_host_register:True")
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn a_bad_string_is_an_error_naming_the_key() {
        let e = AllocatorConfig::default()
            .differences_with_settings("bogus:1")
            .unwrap_err();
        assert!(e.message().contains("bogus"), "{e}");
    }
}
