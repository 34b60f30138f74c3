//! Per-token and per-tenant request rates: a token bucket for each, in this process's memory.
//!
//! Every authenticated request (a method call or a watch stream opened) takes one from its token's
//! bucket and one from its tenant's; an empty bucket answers `RATE_LIMITED` (429) with
//! `Retry-After`, before the request reads its body or the database. Each API process counts
//! alone, so a fleet of `n` API processes admits up to `n` times the rate; the limit exists to
//! keep one runaway client from starving the others on a process, not to meter.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use better_compute_core::{Error, ErrorCode};

/// Buckets held per kind; a full map is emptied (its keys start again with full buckets).
pub const BUCKETS_MAX: usize = 100_000;

/// The rates. A rate of 0 is no limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimits {
    /// Requests per second one token may make, on average.
    pub per_token_per_s: u32,
    /// Requests per second one tenant's tokens may make together, on average.
    pub per_tenant_per_s: u32,
    /// How many seconds of its rate a bucket may save up for a burst.
    pub burst_s: u32,
}

impl Default for RateLimits {
    fn default() -> RateLimits {
        RateLimits { per_token_per_s: 200, per_tenant_per_s: 1000, burst_s: 2 }
    }
}

impl RateLimits {
    /// No limit at all (benchmarks).
    pub const NONE: RateLimits = RateLimits { per_token_per_s: 0, per_tenant_per_s: 0, burst_s: 0 };
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at_ms: u64,
}

/// A monotonic clock in milliseconds (tests drive their own).
pub type RateClock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// The buckets of one process.
pub struct RateLimiter {
    limits: RateLimits,
    clock: RateClock,
    buckets: Mutex<(HashMap<String, Bucket>, HashMap<String, Bucket>)>,
}

impl RateLimiter {
    /// A limiter with full buckets, on the process's monotonic clock.
    pub fn new(limits: RateLimits) -> RateLimiter {
        let origin = Instant::now();
        RateLimiter::with_clock(limits, Arc::new(move || origin.elapsed().as_millis() as u64))
    }

    /// A limiter on a given clock (tests).
    pub fn with_clock(limits: RateLimits, clock: RateClock) -> RateLimiter {
        RateLimiter { limits, clock, buckets: Mutex::new((HashMap::new(), HashMap::new())) }
    }

    /// The limits it applies.
    pub fn limits(&self) -> RateLimits {
        self.limits
    }

    /// Takes one request from the token's and the tenant's buckets, or answers RATE_LIMITED
    /// with the whole seconds to wait in `details.retryAfterS`. A refused request takes nothing
    /// from either bucket.
    pub fn take(&self, token_id: &str, tenant_id: &str) -> Result<(), Error> {
        let now = (self.clock)();
        let mut b = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let (tokens, tenants) = &mut *b;
        let token_wait = wait_s(tokens, token_id, self.limits.per_token_per_s, self.limits.burst_s, now);
        let tenant_wait = wait_s(tenants, tenant_id, self.limits.per_tenant_per_s, self.limits.burst_s, now);
        let wait = token_wait.max(tenant_wait);
        if wait > 0.0 {
            let (what, rate) =
                if token_wait >= tenant_wait { ("token", self.limits.per_token_per_s) } else { ("tenant", self.limits.per_tenant_per_s) };
            let retry_after_s = wait.ceil().max(1.0) as u64;
            return Err(Error::new(ErrorCode::RateLimited, format!("this {what} made more than {rate} requests a second; retry after {retry_after_s} s"))
                .with_details(serde_json::json!({"retryAfterS": retry_after_s})));
        }
        for (map, key, rate) in [(tokens, token_id, self.limits.per_token_per_s), (tenants, tenant_id, self.limits.per_tenant_per_s)] {
            if rate > 0 && let Some(bucket) = map.get_mut(key) {
                bucket.tokens -= 1.0;
            }
        }
        Ok(())
    }
}

/// Refills `key`'s bucket to `now` and answers how long until it holds one request (0 when it does).
fn wait_s(map: &mut HashMap<String, Bucket>, key: &str, rate: u32, burst_s: u32, now_ms: u64) -> f64 {
    if rate == 0 {
        return 0.0;
    }
    let cap = f64::from(rate) * f64::from(burst_s.max(1));
    if map.len() >= BUCKETS_MAX && !map.contains_key(key) {
        map.clear();
    }
    let b = map.entry(key.to_owned()).or_insert(Bucket { tokens: cap, at_ms: now_ms });
    let elapsed_s = now_ms.saturating_sub(b.at_ms) as f64 / 1000.0;
    b.tokens = (b.tokens + elapsed_s * f64::from(rate)).min(cap);
    b.at_ms = b.at_ms.max(now_ms);
    if b.tokens >= 1.0 { 0.0 } else { (1.0 - b.tokens) / f64::from(rate) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    fn limiter(limits: RateLimits) -> (RateLimiter, Arc<AtomicU64>) {
        let now = Arc::new(AtomicU64::new(0));
        let c = now.clone();
        (RateLimiter::with_clock(limits, Arc::new(move || c.load(Ordering::SeqCst))), now)
    }

    #[test]
    fn a_token_gets_its_burst_then_its_rate_and_a_refusal_says_when_to_come_back() {
        let (l, now) = limiter(RateLimits { per_token_per_s: 10, per_tenant_per_s: 0, burst_s: 2 });
        let admitted = (0..25).filter(|_| l.take("tok_a", "ten_a").is_ok()).count();
        assert_eq!(admitted, 20, "the burst is 2 s of 10/s");
        let e = l.take("tok_a", "ten_a").unwrap_err();
        assert_eq!(e.code, ErrorCode::RateLimited);
        assert_eq!(e.details["retryAfterS"], 1);
        // Another token is not held back by this one.
        assert!(l.take("tok_b", "ten_a").is_ok());
        // A second later, ten more.
        now.store(1000, Ordering::SeqCst);
        assert_eq!((0..25).filter(|_| l.take("tok_a", "ten_a").is_ok()).count(), 10);
    }

    #[test]
    fn a_tenants_tokens_share_its_rate_and_another_tenant_is_not_held_back() {
        let (l, now) = limiter(RateLimits { per_token_per_s: 100, per_tenant_per_s: 5, burst_s: 1 });
        let admitted = (0..20).filter(|i| l.take(&format!("tok_{i}"), "ten_a").is_ok()).count();
        assert_eq!(admitted, 5);
        let e = l.take("tok_x", "ten_a").unwrap_err();
        assert!(e.message.contains("tenant"), "{}", e.message);
        assert!(l.take("tok_x", "ten_b").is_ok(), "another tenant is not held back");
        now.store(1000, Ordering::SeqCst);
        assert_eq!((0..20).filter(|i| l.take(&format!("tok_{i}"), "ten_a").is_ok()).count(), 5, "a second later, the rate again");
        assert!(RateLimiter::new(RateLimits::NONE).take("t", "t").is_ok());
    }
}
