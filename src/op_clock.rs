//! A cheap clock for timing single host operations (the replay's host time per allocation and
//! free), and an exact, allocation-light record of the times it measured.
//!
//! Note [Op clock]: `Instant::now` is a `clock_gettime` call, 20–35 ns each on the machines we
//! measure on, and the replay read it twice per operation: more than the operations it timed
//! (a cached pair takes about 60 ns). On x86-64 the clock reads the time-stamp counter instead
//! (`RDTSC`, one instruction, no system call): its ticks are converted to nanoseconds at the end
//! with the rate measured over the whole run against `Instant` (modern processors' counters tick
//! at a constant rate, whatever the core's frequency; Linux uses them as its own clock source).
//! Elsewhere a tick is a nanosecond of `Instant`. The times of a run stay exact per operation;
//! only the clock that reads them changed.
//!
//! Note [Sampled op times]: even so, the two reads cost about 12 ns each on the development VM
//! (AMD EPYC): timing every operation of the `generate` replay added about 20 ns to its 130 ns
//! of wall time per operation, the figure it was meant to describe. A replay may therefore time
//! one operation in `n` ([`Sampler`]): the gaps between timed operations are drawn from a fixed
//! pseudo-random sequence, uniform in `0..=2n - 2` (mean `n - 1`), so no period of the trace (an
//! alternation of allocations and frees, say) lines up with them, and the same operations are
//! timed in every run. The other operations run exactly as the timed ones, with no clock read
//! around them. The mean, percentiles and maximum are then those of the sample, whose size is
//! reported beside them: estimates of the run's (tens of thousands of timed operations on a long
//! trace), and the sample's maximum is a lower bound of the run's. Rare slow operations (a device
//! call) weigh on the mean, so a sample's mean moves more than its median; `n = 1` times every
//! operation, as a replay on a real device does by default (`cca --time-every`).
//!
//! May use: nothing internal.

use std::time::Instant;

/// Times below this many ticks are counted in a table (one counter each); longer ones are kept
/// one by one. With ticks near a nanosecond the table covers several microseconds: everything
/// but the rare slow operations (even under valgrind), so a run's record is the table's touched
/// pages plus its outliers.
const TABLE: usize = 1 << 14;

/// A clock for single operations: [`ticks`](Self::ticks), and the nanoseconds per tick over
/// the run (see Note [Op clock]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct OpClock {
    start: Instant,
    start_ticks: u64,
}

impl OpClock {
    /// A clock started now.
    pub(crate) fn start() -> Self {
        let start = Instant::now();
        let mut c = OpClock {
            start,
            start_ticks: 0,
        };
        c.start_ticks = c.ticks();
        c
    }

    /// The time now, in ticks.
    #[inline(always)]
    pub(crate) fn ticks(&self) -> u64 {
        #[cfg(target_arch = "x86_64")]
        {
            let _ = self;
            // SAFETY: RDTSC only copies the time-stamp counter into two registers: it reads
            // and writes no memory and has no precondition, and every x86-64 processor has it
            // (the intrinsic is `unsafe` as every `core::arch` function is).
            unsafe { core::arch::x86_64::_rdtsc() }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self.start.elapsed().as_nanos() as u64
        }
    }

    /// Nanoseconds per tick, measured from the clock's start to now (1 where a tick is a
    /// nanosecond; 0 when no tick has passed).
    pub(crate) fn ns_per_tick(&self) -> f64 {
        let ns = self.start.elapsed().as_nanos() as f64;
        let ticks = self.ticks().saturating_sub(self.start_ticks);
        if cfg!(target_arch = "x86_64") {
            if ticks == 0 { 0.0 } else { ns / ticks as f64 }
        } else {
            1.0
        }
    }
}

/// Which operations a replay times: one in `n` on average, at pseudo-random gaps (Note [Sampled
/// op times]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sampler {
    /// Operations still to pass untimed before the next timed one.
    skip: u32,
    /// Largest gap (`2n - 2`); 0 times every operation.
    span: u32,
    /// The xorshift state drawing the gaps (never 0).
    rng: u64,
}

impl Sampler {
    /// A sampler timing one operation in `n` (every operation for `n` of 0 or 1), starting
    /// with a timed one.
    pub(crate) fn one_in(n: u32) -> Self {
        Sampler {
            skip: 0,
            span: n.max(1).saturating_mul(2).saturating_sub(2),
            rng: 0x2545_f491_4f6c_dd1d,
        }
    }

    /// Whether to time the next operation.
    #[inline(always)]
    pub(crate) fn next(&mut self) -> bool {
        if self.skip > 0 {
            self.skip -= 1;
            return false;
        }
        if self.span > 0 {
            self.skip = self.gap();
        }
        true
    }

    /// The next gap, uniform in `0..=span`.
    #[cold]
    fn gap(&mut self) -> u32 {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        ((x >> 32) % (u64::from(self.span) + 1)) as u32
    }
}

/// The times of a run's operations, in ticks: a count per short time, and the long ones as they
/// came. Percentiles come out exactly as from the sorted list of every time.
#[derive(Debug, Default)]
pub(crate) struct OpTimes {
    /// `short[t]`: operations that took `t` ticks (`t < TABLE`).
    short: Vec<u64>,
    /// Times of `TABLE` ticks or more.
    long: Vec<u64>,
    sum: u64,
    max: u64,
}

/// Mean, median, 99th percentile and maximum of a run's times, in nanoseconds, and how many
/// operations were timed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct OpSummary {
    pub(crate) count: u64,
    pub(crate) mean_ns: f64,
    pub(crate) p50_ns: u64,
    pub(crate) p99_ns: u64,
    pub(crate) max_ns: u64,
}

impl OpTimes {
    /// An empty record with its table of short times (128 KiB of zeroed memory, touched only
    /// where times fall).
    pub(crate) fn new() -> Self {
        OpTimes {
            short: vec![0; TABLE],
            ..OpTimes::default()
        }
    }

    /// Records one operation that took `ticks`.
    #[inline]
    pub(crate) fn push(&mut self, ticks: u64) {
        self.sum = self.sum.saturating_add(ticks);
        self.max = self.max.max(ticks);
        match self.short.get_mut(ticks as usize) {
            Some(n) => *n += 1,
            None => self.long.push(ticks),
        }
    }

    /// The time of rank `k` (from 0) in ascending order, in ticks.
    fn rank(&mut self, k: u64) -> u64 {
        let mut below = 0u64;
        let seen = self.short.len().min((self.max as usize).saturating_add(1));
        for (t, &n) in self.short.iter().take(seen).enumerate() {
            below += n;
            if k < below {
                return t as u64;
            }
        }
        let k = (k - below) as usize;
        if k < self.long.len() {
            *self.long.select_nth_unstable(k).1
        } else {
            self.max
        }
    }

    /// The summary in nanoseconds, `ns_per_tick` converting (see [`OpClock::ns_per_tick`]);
    /// `None` when nothing was recorded.
    pub(crate) fn summary(&mut self, ns_per_tick: f64) -> Option<OpSummary> {
        let count = self.short.iter().sum::<u64>() + self.long.len() as u64;
        if count == 0 {
            return None;
        }
        let ns = |t: u64| (t as f64 * ns_per_tick).round() as u64;
        let last = count - 1;
        let pct = |p: f64| (last as f64 * p).round() as u64;
        let (k50, k99) = (pct(0.5), pct(0.99));
        Some(OpSummary {
            count,
            mean_ns: self.sum as f64 / count as f64 * ns_per_tick,
            p50_ns: ns(self.rank(k50)),
            p99_ns: ns(self.rank(k99)),
            max_ns: ns(self.max),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_those_of_the_sorted_times() {
        let mut all: Vec<u64> = (0..10_000u64)
            .map(|i| (i * 7919) % 5003 + if i % 97 == 0 { 100_000 + i } else { 0 })
            .collect();
        let mut t = OpTimes::new();
        for &x in &all {
            t.push(x);
        }
        let s = t.summary(1.0).unwrap();
        all.sort_unstable();
        let last = all.len() - 1;
        let at = |p: f64| all[(last as f64 * p).round() as usize];
        assert_eq!(s.p50_ns, at(0.5));
        assert_eq!(s.p99_ns, at(0.99));
        assert_eq!(s.max_ns, *all.last().unwrap());
        let mean = all.iter().sum::<u64>() as f64 / all.len() as f64;
        assert!((s.mean_ns - mean).abs() < 1e-6);
        assert_eq!(OpTimes::default().summary(1.0), None);
    }

    #[test]
    fn the_sampler_times_one_in_n_without_a_period() {
        let mut every = Sampler::one_in(1);
        assert!((0..100).all(|_| every.next()));
        assert!(Sampler::one_in(0).next());
        let mut s = Sampler::one_in(16);
        let picks: Vec<bool> = (0..160_000).map(|_| s.next()).collect();
        assert!(picks[0]);
        let n = picks.iter().filter(|&&p| p).count();
        assert!((9_000..11_000).contains(&n), "{n} of 160000");
        // Even and odd positions (an alternation of allocations and frees) both get their share.
        let even = picks.iter().step_by(2).filter(|&&p| p).count();
        assert!((n * 2 / 5..n * 3 / 5).contains(&even), "{even} of {n}");
        // The same operations every run.
        let mut again = Sampler::one_in(16);
        assert!(picks.iter().all(|&p| p == again.next()));
    }

    #[test]
    fn the_clock_runs_forward() {
        let c = OpClock::start();
        let a = c.ticks();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = c.ticks();
        assert!(b > a);
        let r = c.ns_per_tick();
        assert!(r > 0.0 && r.is_finite(), "{r}");
    }
}
