//! Capacity: atoms, bookings, quotas, reservations and the placer. Double-booking is impossible
//! because every live claim on an atom is a row in `device_bookings`, whose exclusion constraint
//! refuses overlaps whatever the code does (an ended reservation's bookings move to
//! `device_booking_history`); scalars and quotas change only through guarded updates with
//! `CHECK` backstops; and the placer locks what it relies on `FOR SHARE`, so an operator's cordon,
//! taint or quarantine and a placement are strictly ordered.

pub mod availability;
pub mod batch;
pub mod inventory;
#[cfg(feature = "testing")]
pub mod invariants;
pub mod jobs;
pub mod mode;
pub mod occupant;
pub mod placer;
pub mod pools;
pub mod quota;
pub mod reservations;
pub mod service;
pub mod spec;
pub mod usage;

use std::sync::Arc;

use better_compute_db::Migration;
use better_compute_runtime::{Reconciler, Sink};

/// The capacity module's migrations: its tables, then its functions, one file per concept, in the
/// order they call each other (a SQL-language function's callees must exist when it is made).
pub const CAPACITY_MIGRATIONS: &[Migration] = &[
    Migration::numbered("capacity", "0001_capacity", include_str!("migrations/capacity/0001_capacity.sql")),
    Migration::numbered("capacity", "0002_end_reason", include_str!("migrations/capacity/0002_end_reason.sql")),
    Migration::numbered("capacity", "0003_usable", include_str!("migrations/capacity/0003_usable.sql")),
    Migration::numbered("capacity", "0004_usage", include_str!("migrations/capacity/0004_usage.sql")),
    Migration::numbered("capacity", "0005_history_atom_end", include_str!("migrations/capacity/0005_history_atom_end.sql")),
    Migration::repeatable("capacity", "state_guards", include_str!("sql/state_guards.sql")),
    Migration::repeatable("capacity", "eligibility", include_str!("sql/eligibility.sql")),
    Migration::repeatable("capacity", "resources", include_str!("sql/resources.sql")),
    Migration::repeatable("capacity", "counts", include_str!("sql/counts.sql")),
    Migration::repeatable("capacity", "placer", include_str!("sql/placer.sql")),
    Migration::repeatable("capacity", "quota", include_str!("sql/quota.sql")),
    Migration::repeatable("capacity", "reservation", include_str!("sql/reservation.sql")),
    Migration::repeatable("capacity", "release", include_str!("sql/release.sql")),
    Migration::repeatable("capacity", "batch", include_str!("sql/batch.sql")),
    Migration::repeatable("capacity", "usage", include_str!("sql/usage.sql")),
];

pub use jobs::reservations::RESERVATIONS_KIND;
pub use jobs::rollup::ROLLUP_KIND;
pub use jobs::usage::USAGE_KIND;

pub use better_compute_core::Caller;

/// The capacity module, for the registry.
pub struct CapacityModule;

impl better_compute_runtime::Module for CapacityModule {
    fn name(&self) -> &'static str {
        "capacity"
    }

    fn migrations(&self) -> &'static [Migration] {
        CAPACITY_MIGRATIONS
    }

    fn metrics(&self) -> &'static [better_compute_runtime::metrics::Metric] {
        use better_compute_runtime::metrics::{m, MetricKind::Counter};
        const METRICS: &[better_compute_runtime::metrics::Metric] = &[
            m("better_compute_placements_total", Counter, &["outcome"], "api", "Reservation creates by outcome: placed (or active), pending (no room yet; retried), refused (quota, pool, bad request), unavailable (the database was away)."),
            m("better_compute_placer_replans_total", Counter, &["reason"], "api", "Nodes that turned a placement away under the lock, each followed by a replan unless the request's attempts were spent: conflict (a concurrent placement took the atoms, or a change made the node ineligible), stale (the candidate index said it fit; under the lock it did not)."),
        ];
        METRICS
    }

    fn reconcilers(&self) -> Vec<Arc<dyn Reconciler>> {
        vec![Arc::new(jobs::ReservationsJob), Arc::new(jobs::Rollup), Arc::new(jobs::UsageJob)]
    }

    fn subscribers(&self) -> Vec<Arc<dyn Sink>> {
        vec![Arc::new(inventory::InventoryWatcher)]
    }

    fn node_spec_parts(&self) -> Vec<Arc<dyn better_compute_runtime::nodespec::NodeSpecPart>> {
        vec![Arc::new(spec::AllocationsPart)]
    }

    fn node_occupants(&self) -> Vec<Arc<dyn better_compute_runtime::occupancy::NodeOccupant>> {
        vec![Arc::new(occupant::ReservationOccupant)]
    }

    fn event_types(&self) -> Vec<better_compute_runtime::events::EventType> {
        use better_compute_runtime::events::EventType;
        const RESERVATION: &[(&str, &str)] = &[
            ("state", "the reservation's state after the change"),
            ("nodeId", "its node, once placed"),
            ("atoms", "the atoms booked"),
            ("version", "the reservation's version"),
            ("endReason", "why it ended, when neither its tenant nor its end ended it: drained"),
        ];
        let r = |name, description| EventType { name, version: 1, audience: "tenant", description, data: RESERVATION };
        vec![
            r("reservation.placed", "A reservation was placed: its atoms, vCPU, memory and disk are booked."),
            r("reservation.pending", "A reservation could not be placed now; it is retried every 30 s."),
            r("reservation.active", "A reservation's start has come."),
            r("reservation.extended", "A reservation's end moved later."),
            r("reservation.released", "A reservation was released; its quota, atoms and scalars returned."),
            r("reservation.expired", "A reservation's end has come."),
            EventType {
                name: "reservation.deviceUnhealthy",
                version: 1,
                audience: "tenant",
                description: "A GPU the reservation holds turned suspect or unhealthy. The reservation keeps it; nothing is released.",
                data: &[("deviceId", "the GPU"), ("state", "suspect or unhealthy"), ("reason", "why")],
            },
            EventType {
                name: "reservation.evictionRequested",
                version: 1,
                audience: "tenant",
                description: "The reservation's node is being drained: the reservation is released at the deadline (endReason drained) unless it ends first.",
                data: &[("nodeId", "the node being drained"), ("deadline", "when it is released"), ("reason", "the operator's reason for the drain")],
            },
            EventType {
                name: "device.mode_changed",
                version: 1,
                audience: "fleet",
                description: "A GPU's mode or MIG layout changed; its atoms were replaced.",
                data: &[("nodeId", "the GPU's node"), ("mode", "the new mode and layout")],
            },
            EventType {
                name: "usage.window",
                version: 1,
                audience: "tenant",
                description: "A usage window of a reservation closed (subject: its billing key `cmp:<reservationId>:<windowStart>`, deduplicate on it), or a late change to a closed one (an adjustment, key suffix `:<n>`: add it). Reserved time, not utilisation.",
                data: &[
                    ("key", "the billing key, unique: `cmp:<reservationId>:<windowStart>[:<adjustment>]`"),
                    ("reservationId", "the reservation (allocation)"),
                    ("poolId", "its pool"),
                    ("nodeId", "its node"),
                    ("windowStart", "RFC 3339, aligned to the fleet's window size in UTC"),
                    ("windowEnd", "RFC 3339"),
                    ("adjustment", "0 for the window, n for its n-th adjustment"),
                    ("gpu", "the atom class: kind (gpu, mig, slot), model, MIG profile"),
                    ("atomSeconds", "atoms held times seconds, exact to the microsecond"),
                    ("vcpuSeconds", "vCPUs times seconds held"),
                    ("memoryMibSeconds", "MiB times seconds held"),
                    ("diskGibSeconds", "GiB times seconds held"),
                ],
            },
        ]
    }

    fn permissions(&self) -> Vec<better_compute_runtime::authz::Permission> {
        use better_compute_runtime::authz::Permission;
        vec![
            Permission { name: "compute:reservations:create", description: "Create reservations in the tenant." },
            Permission { name: "compute:reservations:read", description: "Read the tenant's reservations." },
            Permission { name: "compute:reservations:write", description: "Extend and release the tenant's reservations." },
            Permission { name: "compute:quotas:read", description: "Read quotas (the tenant's own at tenant scope, any at fleet scope)." },
            Permission { name: "compute:quotas:write", description: "Set any tenant's quotas (fleet scope)." },
            Permission { name: "compute:usage:read", description: "Read usage windows (the tenant's own at tenant scope, every tenant's at fleet scope)." },
        ]
    }
}
