//! Two configurations compared key by key, in PyTorch's syntax: what a settings string would
//! change in a running configuration (the PyTorch package warns with it when
//! `torch.cuda.memory._set_allocator_settings` names keys that the crate's caches, configured once,
//! do not take at run time).
#![forbid(unsafe_code)]

use std::fmt;

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
    /// assert!(running.differences(&running.clone()).is_empty());
    /// ```
    pub fn differences(&self, other: &AllocatorConfig) -> Vec<SettingDifference> {
        let ours = settings_pairs(&self.to_settings());
        let theirs = settings_pairs(&other.to_settings());
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

    /// What applying `settings` on top of `self` would change ([`AllocatorConfig::with_settings`],
    /// which resets `max_split_size_mb`, `roundup_power2_divisions` and
    /// `garbage_collection_threshold` where the string does not name them, as PyTorch does).
    ///
    /// # Errors
    /// A [`ConfigError`] naming the bad key, token or value of `settings`.
    pub fn differences_with_settings(
        &self,
        settings: &str,
    ) -> Result<Vec<SettingDifference>, ConfigError> {
        let next = self.clone().with_settings(settings)?;
        Ok(self.differences(&next))
    }
}

/// The `key:value` items of a string that `to_settings` wrote, split at the commas outside
/// brackets (a bucketed `roundup_power2_divisions:[1:4,...]` is one item).
fn settings_pairs(s: &str) -> Vec<(String, String)> {
    let mut items = Vec::new();
    let mut depth = 0usize;
    let mut start = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                items.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&s[start..]);
    items
        .into_iter()
        .filter(|item| !item.is_empty())
        .map(|item| match item.split_once(':') {
            Some((k, v)) => (k.to_owned(), v.to_owned()),
            None => (item.to_owned(), String::new()),
        })
        .collect()
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
    fn pairs_keep_bracketed_lists_whole() {
        let p = settings_pairs("a:1,roundup_power2_divisions:[1:4,>:8],b:True");
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
        assert!(settings_pairs("").is_empty());
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
        // The reverse: PyTorch resets max_split_size_mb on a parse that does not name it.
        let with_split = pytorch
            .clone()
            .with_settings("max_split_size_mb:256")
            .unwrap();
        let reset = with_split
            .differences_with_settings("garbage_collection_threshold:0.5")
            .unwrap();
        let keys: Vec<&str> = reset.iter().map(|d| d.key.as_str()).collect();
        assert_eq!(keys, ["max_split_size_mb", "garbage_collection_threshold"]);
        assert_eq!(reset[0].to, None);
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
