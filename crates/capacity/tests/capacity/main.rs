//! The capacity module's tests against a real PostgreSQL, one module per concept: reservations
//! and their placement, the batch placer, the seeded torture of every operation at once, and
//! usage metering. One binary, so the tests link once.

mod batch;
mod reservations;
mod torture;
mod usage;
