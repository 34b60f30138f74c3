//! Lease time constants from the consistency spec, shared by workers and gateways.

/// Time to live of shard, pool, site and singleton leases.
pub const WORKER_LEASE_TTL_S: u64 = 15;
/// How often a holder renews a shard, pool, site or singleton lease.
pub const WORKER_LEASE_RENEW_EVERY_S: u64 = 5;
/// Time to live of a gateway's lease.
pub const GATEWAY_LEASE_TTL_S: u64 = 20;
/// How often a gateway renews its lease.
pub const GATEWAY_LEASE_RENEW_EVERY_S: u64 = 5;
/// A business clock whose prediction moves more than this from the database's is skewed.
pub const CLOCK_SKEW_LIMIT_MS: u64 = 1_000;
