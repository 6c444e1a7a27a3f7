//! PyTorch's own figures for a trace, from a `reference.json` (as shipped beside the traces in
//! `examples/traces/`): what PyTorch 2.11's allocators did with the same trace.

use std::path::{Path, PathBuf};

use cuda_caching_allocator::Preset;

use crate::load::CliResult;
use serde_json::Value;

/// PyTorch's figures for one trace.
#[derive(Clone, Debug, Default)]
pub(crate) struct Reference {
    pub(crate) peak_live_bytes: Option<u64>,
    pub(crate) default_reserved: Option<u64>,
    pub(crate) default_allocated: Option<u64>,
    pub(crate) default_segments: Option<u64>,
    pub(crate) default_device_allocs: Option<u64>,
    pub(crate) expandable_reserved: Option<u64>,
    pub(crate) expandable_allocated: Option<u64>,
    pub(crate) async_reserved: Option<u64>,
    pub(crate) torch_ns_per_op: Option<u64>,
    pub(crate) async_ns_per_op: Option<u64>,
    pub(crate) torch: String,
    pub(crate) device: String,
}

impl Reference {
    /// The (reserved, allocated) figures of PyTorch's allocator matching `preset`.
    pub(crate) fn for_preset(
        &self,
        preset: Option<Preset>,
    ) -> (Option<u64>, Option<u64>, &'static str) {
        match preset {
            Some(Preset::PytorchExpandable) => (
                self.expandable_reserved,
                self.expandable_allocated,
                "PyTorch expandable",
            ),
            _ => (
                self.default_reserved,
                self.default_allocated,
                "PyTorch default",
            ),
        }
    }
}

fn trace_key(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let mut key = name.as_str();
    for ext in [".gz", ".csv", ".pickle", ".pkl"] {
        key = key.strip_suffix(ext).unwrap_or(key);
        key = key.strip_suffix(ext).unwrap_or(key);
    }
    key.to_string()
}

/// Finds and reads the reference figures for `trace`: `explicit` (`--reference`) if given, else
/// a `reference.json` in the trace's folder. `Ok(None)` when there is no `reference.json` beside
/// the trace or it has no entry for the trace.
///
/// # Errors
/// An explicit file that cannot be read, is not JSON or has no entry for the trace; a
/// `reference.json` beside the trace that exists but cannot be read or is not JSON.
pub(crate) fn find(trace: &Path, explicit: Option<&Path>) -> CliResult<Option<Reference>> {
    let path: PathBuf = match explicit {
        Some(p) => p.to_path_buf(),
        None => trace
            .parent()
            .unwrap_or(Path::new("."))
            .join("reference.json"),
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if explicit.is_none() && e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(None);
        }
        Err(e) => return Err(format!("--reference {}: {e}", path.display()).into()),
    };
    let root: Value = serde_json::from_str(&text)
        .map_err(|e| format!("--reference {}: not JSON: {e}", path.display()))?;
    let key = trace_key(trace);
    let Some(t) = root.get("traces").and_then(|t| t.get(&key)) else {
        if explicit.is_some() {
            return Err(format!(
                "--reference {}: no entry \"traces\".\"{key}\" for this trace",
                path.display()
            )
            .into());
        }
        return Ok(None);
    };
    let u = |v: Option<&Value>| v.and_then(Value::as_u64);
    Ok(Some(Reference {
        peak_live_bytes: u(t.get("peak_live_bytes")),
        default_reserved: u(t.pointer("/pytorch_default/peak_reserved_bytes")),
        default_allocated: u(t.pointer("/pytorch_default/peak_allocated_bytes")),
        default_segments: u(t.pointer("/pytorch_default/segment_count_peak")),
        default_device_allocs: u(t.pointer("/pytorch_default/num_device_alloc")),
        expandable_reserved: u(t.pointer("/pytorch_expandable/peak_reserved_bytes")),
        expandable_allocated: u(t.pointer("/pytorch_expandable/peak_allocated_bytes")),
        async_reserved: u(t.pointer("/cudaMallocAsync/peak_reserved_bytes")),
        torch_ns_per_op: u(t.pointer("/replay_ns_per_op_h200/pytorch")),
        async_ns_per_op: u(t.pointer("/replay_ns_per_op_h200/cudaMallocAsync")),
        torch: root
            .get("torch")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string(),
        device: root
            .get("device")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string(),
    }))
}

#[cfg(test)]
mod tests {
    use super::trace_key;
    use std::path::Path;

    #[test]
    fn keys() {
        assert_eq!(trace_key(Path::new("a/gpt2_train.csv.gz")), "gpt2_train");
        assert_eq!(trace_key(Path::new("bert_varlen.pickle")), "bert_varlen");
    }
}
