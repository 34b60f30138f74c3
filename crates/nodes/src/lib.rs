//! The node inventory: sites, pools, nodes, GPUs and their atoms, node resources, and the operator
//! actions that change whether the placer may use them (cordon, taint, liveness, health,
//! quarantine). Every such action is an update of the same row the placer locks `FOR SHARE`, so
//! whichever transaction commits second sees the first.

pub mod actions;
pub mod commands;
pub mod conditions;
pub mod drain;
pub mod health;
pub mod inventory;
pub mod jobs;
pub mod listing;
pub mod sessions;
pub mod spec;
pub mod workflows;

use better_compute_db::Migration;

/// The nodes module's migrations.
pub const NODES_MIGRATIONS: &[Migration] = &[
    Migration::numbered("nodes", "0001_nodes", include_str!("migrations/nodes/0001_nodes.sql")),
    Migration::numbered("nodes", "0002_drains", include_str!("migrations/nodes/0002_drains.sql")),
    Migration::numbered("nodes", "0003_health", include_str!("migrations/nodes/0003_health.sql")),
    Migration::numbered("nodes", "0004_findings", include_str!("migrations/nodes/0004_findings.sql")),
    Migration::numbered("nodes", "0005_site_boot", include_str!("migrations/nodes/0005_site_boot.sql")),
    Migration::numbered("nodes", "0006_node_conditions", include_str!("migrations/nodes/0006_node_conditions.sql")),
    Migration::numbered("nodes", "0007_health_counters", include_str!("migrations/nodes/0007_health_counters.sql")),
    Migration::numbered("nodes", "0008_command_signatures", include_str!("migrations/nodes/0008_command_signatures.sql")),
    Migration::numbered("nodes", "0009_command_keys", include_str!("migrations/nodes/0009_command_keys.sql")),
    Migration::numbered("nodes", "0010_vm_consoles", include_str!("migrations/nodes/0010_vm_consoles.sql")),
    Migration::numbered("nodes", "0011_command_trace", include_str!("migrations/nodes/0011_command_trace.sql")),
    Migration::numbered("nodes", "0012_pool_health_circuits", include_str!("migrations/nodes/0012_pool_health_circuits.sql")),
    Migration::repeatable("nodes", "state_guards", include_str!("sql/state_guards.sql")),
    Migration::repeatable("nodes", "scope", include_str!("sql/scope.sql")),
    Migration::repeatable("nodes", "drain", include_str!("sql/drain.sql")),
    Migration::repeatable("nodes", "conditions", include_str!("sql/conditions.sql")),
    Migration::repeatable("nodes", "findings", include_str!("sql/findings.sql")),
    Migration::repeatable("nodes", "consoles", include_str!("sql/consoles.sql")),
    Migration::repeatable("nodes", "health", include_str!("sql/health.sql")),
];

/// The nodes module, for the registry.
pub struct NodesModule;

impl better_compute_runtime::Module for NodesModule {
    fn name(&self) -> &'static str {
        "nodes"
    }

    fn migrations(&self) -> &'static [Migration] {
        NODES_MIGRATIONS
    }

    fn permissions(&self) -> Vec<better_compute_runtime::authz::Permission> {
        use better_compute_runtime::authz::Permission;
        vec![
            Permission { name: "compute:nodes:read", description: "Read nodes, their desired state and their commands." },
            Permission { name: "compute:nodes:exec", description: "Run and cancel commands on nodes (commands.run, commands.cancel)." },
            Permission { name: "compute:nodes:write", description: "Cordon, uncordon, taint, untaint, drain, undrain, label and retire nodes; issue join tokens." },
            Permission { name: "compute:devices:write", description: "Quarantine GPUs and release them from quarantine." },
            Permission { name: "compute:sites:read", description: "Read sites." },
            Permission { name: "compute:sites:write", description: "Create sites, boot them and change their boot settings." },
            Permission { name: "compute:pools:read", description: "Read pools and the vps hosts' base image catalogue." },
            Permission { name: "compute:pools:write", description: "Create pools, change their disruption budgets, and keep the vps hosts' base image catalogue." },
        ]
    }

    fn workflows(&self) -> Vec<std::sync::Arc<dyn better_compute_runtime::workflow::WorkflowDefinition>> {
        workflows::definitions()
    }

    fn event_types(&self) -> Vec<better_compute_runtime::events::EventType> {
        use better_compute_runtime::events::EventType;
        const NODE: &[(&str, &str)] = &[];
        const DEVICE: &[(&str, &str)] = &[("nodeId", "the GPU's node")];
        const DRAIN: &[(&str, &str)] = &[("drainId", "the drain")];
        const FINDING: &[(&str, &str)] = &[("kind", "what is wrong"), ("poolId", "the pool"), ("nodeId", "the node, if about one"), ("item", "a GPU, token or certificate"), ("message", "what and what to do")];
        const HEALTH: &[(&str, &str)] = &[("nodeId", "the GPU's node"), ("reason", "why")];
        let node = |name, description| EventType { name, version: 1, audience: "fleet", description, data: NODE };
        const COMMAND: &[(&str, &str)] = &[("nodeId", "the command's node"), ("kind", "its kind"), ("reason", "why it ended so, if not a success")];
        // The tenant that ran it gets it; the system's own commands are fleet events.
        let command = |name, description| EventType { name, version: 1, audience: "tenant", description, data: COMMAND };
        vec![
            EventType { name: "node.registered", version: 1, audience: "fleet", description: "A node joined a pool.", data: &[("poolId", "its pool"), ("name", "its name")] },
            node("node.cordoned", "A node was cordoned: nothing new is placed there."),
            node("node.uncordoned", "A node was uncordoned."),
            EventType { name: "node.tainted", version: 1, audience: "fleet", description: "A node was tainted.", data: &[("key", "the taint's key"), ("value", "its value")] },
            EventType { name: "node.untainted", version: 1, audience: "fleet", description: "A node's taint was removed.", data: &[("key", "the taint's key")] },
            node("node.connected", "A node's daemon is connected."),
            node("node.disconnected", "A node's daemon went away (within its grace)."),
            node("node.unreachable", "A node is unreachable (the NodeUnreachable alert): nothing new is placed there; nothing is released."),
            node("node.lost", "A node of a provider or vps-host pool stayed unreachable past lostAfter."),
            EventType {
                name: "node.drainRequested",
                version: 1,
                audience: "fleet",
                description: "A drain was asked for: the node is cordoned and its drain queued for the pool's disruption budget.",
                data: &[("drainId", "the drain"), ("mode", "wait or evict"), ("reason", "why"), ("deadline", "when an evicting drain ends what holds the node")],
            },
            EventType { name: "node.drainAdmitted", version: 1, audience: "fleet", description: "The pool's disruption budget admitted a node's drain.", data: DRAIN },
            EventType { name: "node.drained", version: 1, audience: "fleet", description: "Nothing holds a draining node any more.", data: DRAIN },
            EventType { name: "node.undrained", version: 1, audience: "fleet", description: "A node's drain was ended; it is schedulable again unless cordoned otherwise.", data: DRAIN },
            EventType {
                name: "node.conditionChanged",
                version: 1,
                audience: "fleet",
                description: "One of a node's conditions (Unreachable, Draining, Unhealthy, …; not Ready or Converging) began to hold, changed its reason, or ended.",
                data: &[("type", "the condition"), ("reason", "its reason"), ("message", "what it means"), ("holds", "false when it ended")],
            },
            EventType { name: "node.labelsChanged", version: 1, audience: "fleet", description: "A node's labels changed.", data: &[("labels", "its labels now")] },
            EventType { name: "node.retired", version: 1, audience: "fleet", description: "A drained node left placement for ever; its certificates were revoked.", data: &[("certificatesRevoked", "how many")] },
            EventType { name: "device.healthy", version: 1, audience: "fleet", description: "A GPU is healthy again (after clean checks): it is back in placement.", data: HEALTH },
            EventType { name: "device.suspect", version: 1, audience: "fleet", description: "A GPU had a transient error: it leaves placement while diag.nvml checks it.", data: HEALTH },
            EventType { name: "device.recovering", version: 1, audience: "fleet", description: "A suspect GPU passed a check: it returns after enough clean checks in a row.", data: HEALTH },
            EventType { name: "device.unhealthy", version: 1, audience: "fleet", description: "A GPU had a fatal error, failed its check, or kept erring: it is quarantined. Reservations keep it.", data: HEALTH },
            EventType { name: "health.circuitOpen", version: 1, audience: "fleet", description: "Too many of a pool's GPUs left placement for health at once: automatic health actions stop for the pool until an operator closes the circuit.", data: &[("message", "what tripped it")] },
            EventType { name: "inventory.finding", version: 1, audience: "fleet", description: "The inventory jobs found something wrong (a GPU gone, unknown or changed, a certificate about to expire, …).", data: FINDING },
            EventType { name: "inventory.findingResolved", version: 1, audience: "fleet", description: "A finding is no longer seen.", data: FINDING },
            EventType { name: "site.bootStarted", version: 1, audience: "fleet", description: "A site boots (after a site-wide outage, or by sites.boot): its sessions are admitted at a pace and placement on it waits.", data: &[("reason", "why")] },
            EventType { name: "site.bootEnded", version: 1, audience: "fleet", description: "Enough of a booting site's nodes converged: placement on it resumes.", data: &[("converged", "nodes connected and converged"), ("joined", "nodes joined")] },
            EventType { name: "health.circuitClosed", version: 1, audience: "fleet", description: "An operator closed a pool's health circuit; the signals that waited were set aside.", data: &[("signalsSetAside", "how many")] },
            EventType { name: "device.quarantined", version: 1, audience: "fleet", description: "A GPU was quarantined.", data: &[("nodeId", "the GPU's node"), ("reason", "why")] },
            EventType { name: "device.released", version: 1, audience: "fleet", description: "A GPU was released from quarantine.", data: DEVICE },
            command("command.succeeded", "A command finished successfully."),
            command("command.failed", "A command failed (its reason says why: the daemon's error, timeout, journal-lost, …)."),
            command("command.expired", "A command's notAfter passed before it was sent; it never ran."),
            command("command.cancelled", "A command was cancelled."),
            EventType {
                name: "command.badSignature",
                version: 1,
                audience: "fleet",
                description: "A daemon refused a destructive command as not signed by the control plane's command-signing key (tampered with, or the daemon lost the key it pinned at join and must join again). The command failed with BAD_SIGNATURE.",
                data: &[("nodeId", "the command's node"), ("kind", "its kind")],
            },
        ]
    }

    fn command_kinds(&self) -> Vec<better_compute_runtime::commands::CommandKind> {
        commands::kinds::command_kinds()
    }

    fn reconcilers(&self) -> Vec<std::sync::Arc<dyn better_compute_runtime::Reconciler>> {
        use jobs::*;
        vec![
            std::sync::Arc::new(command_sweeper::CommandSweeper),
            std::sync::Arc::new(liveness::LivenessJob),
            std::sync::Arc::new(drain::DrainJob),
            std::sync::Arc::new(health::HealthJob),
            std::sync::Arc::new(inventory::InventoryJob),
            std::sync::Arc::new(inventory_hygiene::HygieneJob),
            std::sync::Arc::new(site_boot::SiteBootJob),
            std::sync::Arc::new(node::NodeJob),
        ]
    }

    fn subscribers(&self) -> Vec<std::sync::Arc<dyn better_compute_runtime::Sink>> {
        vec![std::sync::Arc::new(conditions::ConditionWaker)]
    }

    fn node_spec_parts(&self) -> Vec<std::sync::Arc<dyn better_compute_runtime::nodespec::NodeSpecPart>> {
        vec![std::sync::Arc::new(spec::SitePart), std::sync::Arc::new(spec::AgentPart), std::sync::Arc::new(spec::GpusPart)]
    }
}
