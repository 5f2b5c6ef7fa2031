//! Seeded randomness for the workload generators.
//!
//! SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number
//! generators", OOPSLA 2014): tiny, fast and good enough to draw arrival
//! gaps and lengths. The same seed always gives the same workload.

/// A seeded generator.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x6b76_726f_7574_6521)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// Exponential with the given mean.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }

    /// Log-normal with the given median and shape `sigma` (heavy tail for
    /// larger sigma), by Box-Muller.
    pub fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        let u1 = (1.0 - self.unit()).max(f64::MIN_POSITIVE);
        let u2 = self.unit();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        median * (sigma * z).exp()
    }

    /// Zipf-like pick in `0..n`: index i with weight 1/(i+1)^s.
    pub fn zipf(&mut self, n: usize, s: f64) -> usize {
        if n <= 1 {
            return 0;
        }
        let total: f64 = (1..=n).map(|i| (i as f64).powf(-s)).sum();
        let mut x = self.unit() * total;
        for i in 1..=n {
            x -= (i as f64).powf(-s);
            if x <= 0.0 {
                return i - 1;
            }
        }
        n - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..5).map(|_| r.next_u64()).collect()
        };
        let mut r = Rng::new(7);
        let b: Vec<u64> = (0..5).map(|_| r.next_u64()).collect();
        assert_eq!(a, b);
        let mut other = Rng::new(8);
        assert_ne!(a[0], other.next_u64());
    }

    #[test]
    fn draws_stay_in_range() {
        let mut r = Rng::new(1);
        for _ in 0..10_000 {
            let u = r.unit();
            assert!((0.0..1.0).contains(&u));
            assert!(r.below(3) < 3);
            assert!(r.exp(2.0) >= 0.0);
            assert!(r.lognormal(100.0, 1.0) > 0.0);
            assert!(r.zipf(5, 1.1) < 5);
        }
        let mean = (0..20_000).map(|_| r.exp(3.0)).sum::<f64>() / 20_000.0;
        assert!((mean - 3.0).abs() < 0.2, "exp mean {mean}");
    }
}
