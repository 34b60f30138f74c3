//! vps-host pools: instances, VMs that run on a reservation's atoms on a `vps-host` node.
//!
//! An instance is desired state: its row says whether it should run, how often it was rebooted and
//! whether it should exist; the node's NodeSpec carries that to the host (the `instances` section,
//! [`spec::InstancesPart`]); the host reports what it runs with its spec status, and the
//! `vps.instances` job ([`jobs::instances::InstancesJob`], one key per node) moves each instance through
//! its states (`better_compute_core::state::INSTANCE_STATE_TABLE`). One live instance per
//! reservation is a unique index, so no reservation's atoms are passed to two VMs; a reservation
//! that ends takes its instance with it.

pub mod hosts;
pub mod images;
pub mod instances;
#[cfg(feature = "testing")]
pub mod invariants;
pub mod jobs;
pub mod spec;
pub mod usage;

use std::sync::Arc;

use better_compute_db::Migration;
use better_compute_runtime::{Kind, Reconciler, Sink};

/// The vps module's migrations.
pub const VPS_MIGRATIONS: &[Migration] = &[
    Migration::numbered("vps", "0001_instances", include_str!("migrations/vps/0001_instances.sql")),
    Migration::numbered("vps", "0002_hosts", include_str!("migrations/vps/0002_hosts.sql")),
    Migration::numbered("vps", "0003_usage", include_str!("migrations/vps/0003_usage.sql")),
    Migration::numbered("vps", "0004_images", include_str!("migrations/vps/0004_images.sql")),
    Migration::repeatable("vps", "state_guards", include_str!("sql/state_guards.sql")),
    Migration::repeatable("vps", "usage", include_str!("sql/usage.sql")),
];

/// `vps.instances`: one key per node, moving its instances through their states. The report path
/// wakes it when a host's instances read differently or it applied a newer spec (the module's
/// `status_watches`).
pub const INSTANCES_KIND: Kind = Kind { name: "vps.instances", shard_by: better_compute_runtime::ShardBy::Node };

/// The vps module, for the registry.
pub struct VpsModule;

impl better_compute_runtime::Module for VpsModule {
    fn name(&self) -> &'static str {
        "vps"
    }

    fn migrations(&self) -> &'static [Migration] {
        VPS_MIGRATIONS
    }

    fn reconcilers(&self) -> Vec<Arc<dyn Reconciler>> {
        vec![Arc::new(jobs::instances::InstancesJob), Arc::new(jobs::bootstraps::BootstrapsJob), Arc::new(jobs::hosts::HostsJob), Arc::new(jobs::usage::UsageJob)]
    }

    fn subscribers(&self) -> Vec<Arc<dyn Sink>> {
        vec![Arc::new(jobs::instances::ReservationWatcher)]
    }

    fn status_watches(&self) -> Vec<better_compute_runtime::nodespec::StatusWatch> {
        vec![better_compute_runtime::nodespec::StatusWatch { section: "instances", pool_kind: "vps-host", kind: INSTANCES_KIND }]
    }

    fn command_kinds(&self) -> Vec<better_compute_runtime::commands::CommandKind> {
        hosts::command_kinds()
    }

    fn node_spec_parts(&self) -> Vec<Arc<dyn better_compute_runtime::nodespec::NodeSpecPart>> {
        vec![Arc::new(spec::InstancesPart)]
    }

    fn permissions(&self) -> Vec<better_compute_runtime::authz::Permission> {
        use better_compute_runtime::authz::Permission;
        vec![
            Permission { name: "compute:instances:create", description: "Create instances (VMs) on the tenant's reservations." },
            Permission { name: "compute:instances:read", description: "Read the tenant's instances." },
            Permission { name: "compute:instances:write", description: "Stop, start, reboot and delete the tenant's instances." },
            Permission { name: "compute:instances:console", description: "Read the serial consoles of the tenant's instances (what the guest prints there; not part of read)." },
        ]
    }

    fn event_types(&self) -> Vec<better_compute_runtime::events::EventType> {
        use better_compute_runtime::events::EventType;
        const INSTANCE: &[(&str, &str)] = &[
            ("state", "the instance's state after the change"),
            ("reservationId", "its reservation"),
            ("nodeId", "its host, once placed"),
            ("reason", "why it failed or is being deleted, when it is"),
            ("version", "the instance's version"),
        ];
        let e = |name, description| EventType { name, version: 1, audience: "tenant", description, data: INSTANCE };
        let h = |name, description| EventType { name, version: 1, audience: "fleet", description, data: &[("state", "the host's state"), ("reasons", "why it is not ready")] };
        vec![
            h("vps.host.bootstrapping", "A vps host waits for its vps.bootstrap report; it is tainted vps/not-ready."),
            h("vps.host.ready", "A vps host can run instances."),
            h("vps.host.degraded", "A vps host cannot run instances (the reasons say why); it is tainted vps/not-ready."),
            h("vps.host.draining", "A vps host's node is cordoned or drained: no new instances."),
            EventType {
                name: "vps.image.set",
                version: 1,
                audience: "fleet",
                description: "An image was added to the base image catalogue, or its source or digest changed: every vps host is bootstrapped again (the subject is the image's name).",
                data: &[("url", "where hosts fetch it"), ("sha256", "what its bytes hash to"), ("version", "the image record's version")],
            },
            EventType {
                name: "vps.image.deleted",
                version: 1,
                audience: "fleet",
                description: "An image left the base image catalogue: every vps host is bootstrapped again (hosts keep their cached copy).",
                data: &[],
            },
            e("instance.requested", "An instance was created; it waits for its reservation's placement and its host."),
            e("instance.provisioning", "An instance is in its host's desired state, to run; the host has not reported it running yet."),
            e("instance.running", "The host reports the instance running."),
            e("instance.stopping", "An instance was asked to stop."),
            e("instance.stopped", "The host reports the instance stopped; its disk is kept."),
            e("instance.deleting", "An instance is being deleted (asked for, or its reservation ended)."),
            e("instance.deleted", "The host no longer has the instance or its disk."),
            e("instance.failed", "The host could not run the instance; the reason says why. Delete it."),
            EventType {
                name: "instance.usageWindow",
                version: 1,
                audience: "tenant",
                description: "An instance's usage in one closed usage window: the seconds its VM was up (running or stopping), under the billing key cmp:<instanceId>:<windowStart> (the event's subject; deduplicate on it). Written once.",
                data: &[
                    ("key", "the billing key"),
                    ("instanceId", "the instance"),
                    ("poolId", "its pool"),
                    ("nodeId", "its host"),
                    ("flavour", "what it is metered as: its reservation's GPUs, vCPUs, memory and disk"),
                    ("windowStart", "RFC 3339"),
                    ("windowEnd", "RFC 3339"),
                    ("instanceSeconds", "seconds the VM was up in the window, to the microsecond"),
                ],
            },
            EventType {
                name: "instance.expiring",
                version: 1,
                audience: "tenant",
                description: "An instance's reservation ends soon (15 minutes ahead, once): extend the reservation or save what you need.",
                data: &[("reservationId", "its reservation"), ("endsAt", "when the reservation ends and the instance is deleted")],
            },
        ]
    }
}
