//! Synthetic stress traces: deterministic generators of allocation patterns that fragment a
//! caching allocator, for tests, benches and policy comparisons.
//!
//! Every generator is a pure function of its parameters and a seed (a SplitMix64 stream, no
//! clocks, no hash order), so a trace can be named by `(workload, seed)` alone:
//!
//! * [`Workload::TransformerVarlen`]: training a transformer with a sequence length drawn anew
//!   for every step, activation checkpointing (layer inputs kept, the layer recomputed in the
//!   backward pass), bf16 weight casts, gradients set to `None` after every optimizer step and
//!   AdamW states;
//! * [`Workload::KvCacheGeneration`]: autoregressive decoding of batches of random size, prompt
//!   length and output length, with per-layer K/V caches that grow by one token per step the way
//!   `torch.cat` grows them (allocate the longer cache, free the old one);
//! * [`Workload::ManyStreams`]: six streams running inference loops of log-uniform activation
//!   sizes side by side, each freeing on its own stream, plus weights on stream 0;
//! * [`Workload::CappedTraining`]: the transformer workload (another seed stream) behind a
//!   per-process memory fraction set to 1.02 × its peak live bytes, so an allocator that wastes
//!   more than 2% must flush its cache or fail.
//!
//! May use: `trace`.
#![forbid(unsafe_code)]

use crate::trace::{Trace, TraceOp, TraceSource};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The simulated device size the generators assume for [`Workload::CappedTraining`]'s fraction
/// (80 GiB, `SimDevice`'s default capacity).
pub const DEFAULT_DEVICE_TOTAL: u64 = 80 * GIB;

/// A named synthetic workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Workload {
    /// Transformer training with variable sequence lengths and activation checkpointing.
    TransformerVarlen,
    /// Autoregressive generation with growing KV caches and variable batch sizes.
    KvCacheGeneration,
    /// Inference loops on six streams at once.
    ManyStreams,
    /// Transformer training under a memory fraction of 1.02 × its peak live bytes.
    CappedTraining,
}

impl Workload {
    /// Every workload, in a stable order.
    pub const ALL: [Workload; 4] = [
        Workload::TransformerVarlen,
        Workload::KvCacheGeneration,
        Workload::ManyStreams,
        Workload::CappedTraining,
    ];

    /// The workload's name (`synth_transformer_varlen`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Workload::TransformerVarlen => "synth_transformer_varlen",
            Workload::KvCacheGeneration => "synth_kv_cache_generation",
            Workload::ManyStreams => "synth_many_streams",
            Workload::CappedTraining => "synth_capped_training",
        }
    }

    /// The trace of this workload with its default parameters.
    pub fn trace(self, seed: u64) -> Trace {
        match self {
            Workload::TransformerVarlen => TransformerParams::default().generate(seed),
            Workload::KvCacheGeneration => KvCacheParams::default().generate(seed),
            Workload::ManyStreams => ManyStreamsParams::default().generate(seed),
            Workload::CappedTraining => capped(
                &TransformerParams::default(),
                seed ^ 0xcafe,
                1.02,
                DEFAULT_DEVICE_TOTAL,
            ),
        }
    }
}

/// SplitMix64: a tiny, well-mixed, deterministic generator.
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi]`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        // `hi - lo + 1` is 2^64 for the whole range: every value is then uniform already.
        match (hi - lo).checked_add(1) {
            Some(span) => lo + self.next_u64() % span,
            None => self.next_u64(),
        }
    }

    /// Log-uniform in `[lo, hi]`; `lo` when `hi <= lo` (an empty range, e.g. a size range
    /// divided below its minimum, is normalised to its lower end, never a panic).
    fn log_range(&mut self, lo: u64, hi: u64) -> u64 {
        let hi = hi.max(lo);
        let (a, b) = ((lo.max(1) as f64).ln(), (hi.max(1) as f64).ln());
        let u = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((a + (b - a) * u).exp() as u64).clamp(lo, hi)
    }
}

/// Trace builder: numbers allocations and tracks live bytes.
struct Gen {
    trace: Trace,
    next_id: u64,
    live: u64,
    peak_live: u64,
}

impl Gen {
    fn new() -> Self {
        Gen {
            trace: Trace::new(TraceSource::Synthetic),
            next_id: 1,
            live: 0,
            peak_live: 0,
        }
    }

    fn alloc_on(&mut self, size: u64, stream: u64) -> (u64, u64) {
        let id = self.next_id;
        self.next_id += 1;
        self.trace.push(TraceOp::Alloc {
            id,
            size,
            stream,
            addr: None,
        });
        self.live += size;
        self.peak_live = self.peak_live.max(self.live);
        (id, size)
    }

    fn alloc(&mut self, size: u64) -> (u64, u64) {
        self.alloc_on(size, 0)
    }

    fn free(&mut self, (id, size): (u64, u64)) {
        self.trace.push(TraceOp::Free { id });
        self.live -= size;
    }

    fn free_all(&mut self, v: &mut Vec<(u64, u64)>) {
        for a in v.drain(..) {
            self.free(a);
        }
    }
}

/// Parameters of [`Workload::TransformerVarlen`].
#[derive(Clone, Debug, PartialEq)]
pub struct TransformerParams {
    /// Transformer layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// Attention heads.
    pub heads: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Sequences per batch.
    pub batch: u64,
    /// Shortest sequence length.
    pub min_seq: u64,
    /// Longest sequence length.
    pub max_seq: u64,
    /// Training steps.
    pub steps: u64,
}

impl Default for TransformerParams {
    /// 12 layers of width 1024, 16 heads, 32k vocabulary, batch 8, sequences of 64..1024 tokens
    /// (multiples of 8), 8 steps: about 3 GB live at peak, some 20k events.
    fn default() -> Self {
        TransformerParams {
            layers: 12,
            hidden: 1024,
            heads: 16,
            vocab: 32_000,
            batch: 8,
            min_seq: 64,
            max_seq: 1024,
            steps: 8,
        }
    }
}

impl TransformerParams {
    /// The trace for `seed`.
    pub fn generate(&self, seed: u64) -> Trace {
        transformer(self, seed).trace
    }
}

/// Per-layer fp32 parameter shapes (elements): qkv, out-proj, fc1, fc2 weights, their biases and
/// two layer norms (weight and bias each).
fn layer_params(d: u64) -> Vec<u64> {
    vec![
        3 * d * d,
        d * d,
        4 * d * d,
        4 * d * d,
        3 * d,
        d,
        4 * d,
        d,
        d,
        d,
        d,
        d,
    ]
}

/// One layer's forward pass in bf16; returns the output and the temporaries still live (freed
/// by the caller; with checkpointing right away).
fn layer_forward(
    g: &mut Gen,
    p: &TransformerParams,
    tokens: u64,
    seq: u64,
) -> ((u64, u64), Vec<(u64, u64)>) {
    let d = p.hidden;
    let bf = 2;
    let mut tmp = Vec::new();
    // bf16 casts of the weights (autocast caches them for the layer).
    for &w in &layer_params(d)[..4] {
        tmp.push(g.alloc(w * bf));
    }
    let ln1 = g.alloc(tokens * d * bf);
    let qkv = g.alloc(tokens * 3 * d * bf);
    let scores = g.alloc(p.batch * p.heads * seq * seq * bf);
    let probs = g.alloc(p.batch * p.heads * seq * seq * bf);
    g.free(scores);
    let ctx = g.alloc(tokens * d * bf);
    let proj = g.alloc(tokens * d * bf);
    let res1 = g.alloc(tokens * d * bf);
    g.free(proj);
    let ln2 = g.alloc(tokens * d * bf);
    let fc1 = g.alloc(tokens * 4 * d * bf);
    let act = g.alloc(tokens * 4 * d * bf);
    let fc2 = g.alloc(tokens * d * bf);
    let out = g.alloc(tokens * d * bf);
    g.free(fc2);
    tmp.extend([ln1, qkv, probs, ctx, res1, ln2, fc1, act]);
    (out, tmp)
}

fn transformer(p: &TransformerParams, seed: u64) -> Gen {
    let mut rng = Rng(seed ^ 0x7472_616e_7366_6f72);
    let mut g = Gen::new();
    let d = p.hidden;
    let f32b = 4;
    // fp32 master weights: embedding, layers, final norm.
    let mut shapes = vec![p.vocab * d];
    for _ in 0..p.layers {
        shapes.extend(layer_params(d));
    }
    shapes.extend([d, d]);
    let weights: Vec<(u64, u64)> = shapes.iter().map(|&n| g.alloc(n * f32b)).collect();
    let mut adam: Vec<(u64, u64)> = Vec::new();
    for step in 0..p.steps {
        let seq = rng.range(p.min_seq / 8, p.max_seq / 8) * 8;
        let tokens = p.batch * seq;
        let input_ids = g.alloc(tokens * 8);
        let labels = g.alloc(tokens * 8);
        // Forward with checkpointing: keep each layer's input only.
        let emb_w = g.alloc(p.vocab * d * 2);
        let mut x = g.alloc(tokens * d * 2);
        g.free(emb_w);
        let mut checkpoints = Vec::new();
        for _ in 0..p.layers {
            let (out, mut tmp) = layer_forward(&mut g, p, tokens, seq);
            g.free_all(&mut tmp);
            checkpoints.push(x);
            x = out;
        }
        let head_w = g.alloc(p.vocab * d * 2);
        let logits = g.alloc(tokens * p.vocab * 2);
        let logits32 = g.alloc(tokens * p.vocab * 4);
        g.free(logits);
        let loss = g.alloc(4);
        // Backward.
        let mut grads: Vec<(u64, u64)> = Vec::new();
        let dlogits = g.alloc(tokens * p.vocab * 4);
        g.free(logits32);
        let dlogits16 = g.alloc(tokens * p.vocab * 2);
        g.free(dlogits);
        grads.push(g.alloc(p.vocab * d * f32b));
        let mut dx = g.alloc(tokens * d * 2);
        g.free(dlogits16);
        g.free(head_w);
        g.free(x);
        for _ in 0..p.layers {
            // Recompute the layer from its checkpoint, then walk back through it.
            let (out, mut tmp) = layer_forward(&mut g, p, tokens, seq);
            g.free(out);
            let mut gtmp = Vec::new();
            for &n in layer_params(d).iter().rev() {
                let gw = g.alloc(n * f32b);
                grads.push(gw);
            }
            for &(_, sz) in tmp.iter().rev().take(6) {
                gtmp.push(g.alloc(sz));
                if gtmp.len() > 2 {
                    let a = gtmp.remove(0);
                    g.free(a);
                }
            }
            while let Some(t) = tmp.pop() {
                g.free(t);
            }
            g.free_all(&mut gtmp);
            let ndx = g.alloc(tokens * d * 2);
            g.free(dx);
            dx = ndx;
            if let Some(c) = checkpoints.pop() {
                g.free(c);
            }
        }
        g.free(dx);
        g.free(loss);
        g.free(input_ids);
        g.free(labels);
        // AdamW: states on the first step, one temporary per parameter, grads set to None.
        if step == 0 {
            for &(_, sz) in &weights {
                adam.push(g.alloc(sz));
                adam.push(g.alloc(sz));
            }
        }
        for &(_, sz) in &weights {
            let t = g.alloc(sz);
            g.free(t);
        }
        g.free_all(&mut grads);
    }
    for w in weights.into_iter().chain(adam) {
        g.free(w);
    }
    g
}

/// Parameters of [`Workload::KvCacheGeneration`].
#[derive(Clone, Debug, PartialEq)]
pub struct KvCacheParams {
    /// Transformer layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// Attention heads.
    pub heads: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Batches of requests served one after the other.
    pub batches: u64,
    /// Largest batch size (each batch draws from 1 up to this).
    pub max_batch: u64,
    /// Prompt lengths are drawn from this range.
    pub prompt: (u64, u64),
    /// Generated lengths are drawn from this range.
    pub generate: (u64, u64),
}

impl Default for KvCacheParams {
    /// 8 layers of width 2048, 16 heads, 32k vocabulary, 8 batches of 1..32 sequences, prompts of
    /// 16..768 tokens, 8..96 generated tokens: some 40k events.
    fn default() -> Self {
        KvCacheParams {
            layers: 8,
            hidden: 2048,
            heads: 16,
            vocab: 32_000,
            batches: 8,
            max_batch: 32,
            prompt: (16, 768),
            generate: (8, 96),
        }
    }
}

impl KvCacheParams {
    /// The trace for `seed`.
    pub fn generate(&self, seed: u64) -> Trace {
        let p = self;
        let mut rng = Rng(seed ^ 0x6b76_6361_6368_6521);
        let mut g = Gen::new();
        let d = p.hidden;
        let bf = 2;
        let mut weights = vec![g.alloc(p.vocab * d * bf)];
        for _ in 0..p.layers {
            for &n in &layer_params(d) {
                weights.push(g.alloc(n * bf));
            }
        }
        for _ in 0..p.batches {
            let b = rng.range(1, p.max_batch);
            let prompt = rng.range(p.prompt.0, p.prompt.1);
            let gen_len = rng.range(p.generate.0, p.generate.1);
            // Prefill: full-sequence activations and the first caches.
            let mut caches: Vec<((u64, u64), (u64, u64))> = Vec::new();
            let tokens = b * prompt;
            let mut x = g.alloc(tokens * d * bf);
            for _ in 0..p.layers {
                let qkv = g.alloc(tokens * 3 * d * bf);
                let k = g.alloc(tokens * d * bf);
                let v = g.alloc(tokens * d * bf);
                let scores = g.alloc(b * p.heads * prompt * prompt * bf);
                g.free(qkv);
                let ctx = g.alloc(tokens * d * bf);
                g.free(scores);
                let fc1 = g.alloc(tokens * 4 * d * bf);
                let out = g.alloc(tokens * d * bf);
                g.free(fc1);
                g.free(ctx);
                g.free(x);
                x = out;
                caches.push((k, v));
            }
            let logits = g.alloc(b * p.vocab * 4);
            g.free(x);
            g.free(logits);
            // Decode: every step grows every layer's caches by one token.
            for t in 1..=gen_len {
                let len = prompt + t;
                let mut x = g.alloc(b * d * bf);
                for cache in caches.iter_mut() {
                    let qkv = g.alloc(b * 3 * d * bf);
                    let k = g.alloc(b * len * d * bf);
                    g.free(cache.0);
                    let v = g.alloc(b * len * d * bf);
                    g.free(cache.1);
                    *cache = (k, v);
                    let scores = g.alloc(b * p.heads * len * bf);
                    g.free(qkv);
                    let ctx = g.alloc(b * d * bf);
                    g.free(scores);
                    let fc1 = g.alloc(b * 4 * d * bf);
                    let out = g.alloc(b * d * bf);
                    g.free(fc1);
                    g.free(ctx);
                    g.free(x);
                    x = out;
                }
                let logits = g.alloc(b * p.vocab * 4);
                let next = g.alloc(b * 8);
                g.free(logits);
                g.free(x);
                g.free(next);
            }
            for (k, v) in caches {
                g.free(k);
                g.free(v);
            }
        }
        for w in weights {
            g.free(w);
        }
        g.trace
    }
}

/// Parameters of [`Workload::ManyStreams`].
#[derive(Clone, Debug, PartialEq)]
pub struct ManyStreamsParams {
    /// Streams (handles 1..=streams; weights live on stream 0).
    pub streams: u64,
    /// Iterations of each stream's loop.
    pub iterations: u64,
    /// Allocations per iteration.
    pub depth: u64,
    /// Allocation sizes are log-uniform in this range.
    pub sizes: (u64, u64),
    /// Bytes of weights allocated first on stream 0.
    pub weights: u64,
}

impl Default for ManyStreamsParams {
    /// 6 streams × 60 iterations of 24 allocations of 4 KiB..96 MiB, 2 GiB of weights.
    fn default() -> Self {
        ManyStreamsParams {
            streams: 6,
            iterations: 60,
            depth: 24,
            sizes: (4 * KIB, 96 * MIB),
            weights: 2 * GIB,
        }
    }
}

impl ManyStreamsParams {
    /// The trace for `seed`.
    pub fn generate(&self, seed: u64) -> Trace {
        let p = self;
        let mut rng = Rng(seed ^ 0x6d61_6e79_7374_726d);
        let mut g = Gen::new();
        let mut weights = Vec::new();
        let mut left = p.weights;
        while left > 0 {
            let sz = rng.log_range(MIB, 256 * MIB).min(left);
            weights.push(g.alloc_on(sz, 0));
            left -= sz;
        }
        // Each stream keeps a sliding window of live activations; streams take turns.
        let mut windows: Vec<Vec<(u64, u64)>> = vec![Vec::new(); p.streams as usize];
        for _ in 0..p.iterations {
            for s in 0..p.streams {
                let w = &mut windows[s as usize];
                let scale = rng.range(1, 4);
                for _ in 0..p.depth {
                    let sz = rng.log_range(p.sizes.0, p.sizes.1 / scale);
                    let a = g.alloc_on(sz, s + 1);
                    w.push(a);
                    if w.len() > (p.depth / 2) as usize {
                        let victim = (rng.next_u64() % 3) as usize;
                        let a = w.remove(victim.min(w.len() - 1));
                        g.free(a);
                    }
                }
                let keep = rng.range(0, p.depth / 4) as usize;
                while w.len() > keep {
                    if let Some(a) = w.pop() {
                        g.free(a);
                    }
                }
            }
        }
        for mut w in windows {
            g.free_all(&mut w);
        }
        for a in weights {
            g.free(a);
        }
        g.trace
    }
}

/// `params`' transformer trace behind a fraction cap of `headroom × peak live bytes` on a device
/// of `device_total` bytes (set by the trace's first event).
pub fn capped(params: &TransformerParams, seed: u64, headroom: f64, device_total: u64) -> Trace {
    let g = transformer(params, seed);
    let cap = g.peak_live as f64 * headroom;
    let fraction = (cap / device_total as f64).clamp(0.0, 1.0);
    let mut trace = Trace::new(TraceSource::Synthetic);
    trace.device_total = Some(device_total);
    trace.push(TraceOp::SetFraction { fraction });
    trace.events.extend(g.trace.events);
    trace
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generators_are_deterministic_and_balanced() {
        for w in Workload::ALL {
            let a = w.trace(7);
            assert_eq!(a, w.trace(7), "{}", w.name());
            assert_ne!(a, w.trace(8), "{}", w.name());
            let allocs = a.alloc_count();
            let frees = a
                .events
                .iter()
                .filter(|e| matches!(e.op, TraceOp::Free { .. }))
                .count();
            assert_eq!(allocs, frees, "{}: every allocation is freed", w.name());
        }
    }

    #[test]
    fn rng_ranges() {
        let mut r = Rng(1);
        for _ in 0..1000 {
            let x = r.range(3, 9);
            assert!((3..=9).contains(&x));
            let y = r.log_range(KIB, MIB);
            assert!((KIB..=MIB).contains(&y));
        }
    }
}
