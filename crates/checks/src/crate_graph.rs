//! The crate graph: every dependency of one workspace crate on another (normal and build
//! dependencies, optional ones included; dev-dependencies are test support and left out), each with
//! why it exists. The `crate_graph` test reads `cargo metadata` and fails on an edge missing from
//! [`EDGES`] or listed there but gone, and keeps the diagram in docs/architecture.md equal to
//! [`diagram`]. A new edge is a design decision: add it here with its reason.

/// (crate, the crate it depends on, why), crate names without the `better-compute-` prefix; the
/// binary is `cli`.
pub const EDGES: &[(&str, &str, &str)] = &[
    ("db", "core", "error codes, ids and the state tables its guards follow"),
    ("db", "tls", "the one TLS set-up (TLS to PostgreSQL)"),
    ("client", "tls", "the one TLS set-up for its HTTP client"),
    ("runtime", "core", "errors, ids, state tables"),
    ("runtime", "db", "the work queue, leases and outbox live in PostgreSQL"),
    ("runtime", "proto", "the NodeSpec contract modules contribute to"),
    ("audit", "core", "errors and ids"),
    ("audit", "db", "its log is a table"),
    ("audit", "runtime", "a module: its jobs"),
    ("workflows", "core", "errors, ids, the workflow state tables"),
    ("workflows", "db", "workflows and their steps are tables"),
    ("workflows", "runtime", "a module: the workflow contract it runs, its job and subscriber"),
    ("workflows", "audit", "a workflow's decisions are entered in the audit log as its job's"),
    ("iam", "core", "errors, ids"),
    ("iam", "db", "identities, tokens and bindings are tables"),
    ("iam", "runtime", "a module"),
    ("events", "core", "errors, ids"),
    ("events", "db", "subscriptions and deliveries are tables"),
    ("events", "runtime", "a module: the outbox it delivers from"),
    ("events", "tls", "the one TLS set-up for outgoing HTTP (webhook delivery)"),
    ("nodes", "core", "errors, ids, state tables"),
    ("nodes", "db", "the inventory and commands are tables"),
    ("nodes", "runtime", "a module: its jobs, command kinds and NodeSpec part"),
    ("nodes", "trace", "a command row carries its request's trace context"),
    ("nodes", "proto", "the agent protocol's messages it stores and signs"),
    ("nodes", "audit", "operator actions are entered in the audit log"),
    ("nodes", "workflows", "the health job starts node.recover"),
    ("capacity", "core", "errors, ids, state tables"),
    ("capacity", "db", "bookings and quotas are tables"),
    ("capacity", "runtime", "a module"),
    ("capacity", "proto", "its part of the NodeSpec"),
    ("capacity", "nodes", "the inventory it books from (devices, GPU modes)"),
    ("capacity", "audit", "quota changes are entered in the audit log"),
    ("vps", "core", "errors, ids"),
    ("vps", "db", "instances and images are tables"),
    ("vps", "runtime", "a module"),
    ("vps", "proto", "its part of the NodeSpec"),
    ("vps", "nodes", "the hosts' inventory, actions and consoles"),
    ("vps", "capacity", "the reservations its instances run on"),
    ("vps", "audit", "instance actions are entered in the audit log"),
    ("gateway", "core", "errors, ids"),
    ("gateway", "db", "sessions and dispatch read and write PostgreSQL"),
    ("gateway", "runtime", "the work queue and NodeSpec it serves"),
    ("gateway", "proto", "the gRPC service it serves to daemons"),
    ("gateway", "nodes", "a skin over nodes: sessions, reports, commands"),
    ("daemon", "core", "ids and errors"),
    ("daemon", "proto", "the gRPC client of the agent protocol"),
    ("daemon", "tls", "the one TLS set-up for outgoing HTTP (base images)"),
    ("daemon", "trace", "a command runs in the span its request started"),
    ("api", "core", "errors and their codes"),
    ("api", "tls", "the one TLS set-up (its server certificate)"),
    ("api", "trace", "a request follows its caller's traceparent"),
    ("api", "db", "a connection pool per request"),
    ("api", "runtime", "the registry it serves every module's methods from"),
    ("api", "audit", "the audit methods and each change's entry"),
    ("api", "iam", "authentication and authorization"),
    ("api", "events", "the watch stream and webhook methods"),
    ("api", "nodes", "the inventory, drain and command methods"),
    ("api", "capacity", "the reservation and quota methods"),
    ("api", "vps", "the instance and image methods"),
    ("api", "workflows", "the workflow methods"),
    ("server", "core", "errors"),
    ("server", "db", "migrations and pools at start"),
    ("server", "runtime", "the registry and workers it starts"),
    ("server", "api", "the api role"),
    ("server", "gateway", "the gateway role"),
    ("server", "audit", "a module of the registry"),
    ("server", "iam", "a module of the registry"),
    ("server", "events", "a module of the registry"),
    ("server", "nodes", "a module of the registry"),
    ("server", "capacity", "a module of the registry"),
    ("server", "vps", "a module of the registry"),
    ("server", "workflows", "a module of the registry"),
    ("sim", "core", "errors, ids"),
    ("sim", "db", "the throwaway cluster it crashes and the clock it jumps"),
    ("sim", "runtime", "work-queue and lease checks"),
    ("sim", "server", "starts real gateway and worker processes"),
    ("sim", "daemon", "real daemons with fake GPUs, in process"),
    ("sim", "gateway", "the gateways' CA for the daemons' certificates"),
    ("sim", "nodes", "seeds the fleet and checks commands ran once"),
    ("sim", "capacity", "the workload's reservations and the capacity invariants"),
    ("sim", "vps", "the instance invariants"),
    ("sim", "audit", "checks every accepted request has its entry"),
    ("sim", "workflows", "the workload's maintenance workflows, cancelled at the heal"),
    ("sim", "testing", "the workload's reservations, made with the tests' constructor"),
    ("testing", "core", "GPU modes and callers of the fleets it builds"),
    ("testing", "runtime", "the test Harness its fleets live in"),
    ("testing", "nodes", "builds fleets through the inventory's functions"),
    ("testing", "capacity", "quotas, reservation constructors and the invariant check"),
    ("testing", "audit", "a module of its harness"),
    ("testing", "workflows", "a module of its harness"),
    ("bench", "core", "errors, ids"),
    ("bench", "db", "the throwaway cluster and pgbench baseline"),
    ("bench", "runtime", "the runtime and events benchmarks"),
    ("bench", "server", "starts the processes it measures"),
    ("bench", "api", "the API benchmark's in-process baseline"),
    ("bench", "client", "the API benchmark's HTTP client"),
    ("bench", "daemon", "simulated daemon sessions for the gateway benchmark"),
    ("bench", "gateway", "the gateway benchmark"),
    ("bench", "nodes", "seeds fleets and commands"),
    ("bench", "capacity", "the capacity benchmark"),
    ("bench", "audit", "a module the benchmarked servers run"),
    ("bench", "testing", "the capacity benchmark's reservations, made with the tests' constructor"),
    ("cli", "core", "errors and exit codes"),
    ("cli", "db", "migrate, the dev cluster"),
    ("cli", "runtime", "operator commands over the work queue, workflows and metrics"),
    ("cli", "server", "the api, gateway and worker roles"),
    ("cli", "client", "API calls and --wait"),
    ("cli", "tls", "the process's default TLS provider (the OTLP exporter)"),
    ("cli", "api", "the OpenAPI document and method list for docs and completions"),
    ("cli", "gateway", "the CA's default directory"),
    ("cli", "daemon", "the daemon role"),
    ("cli", "nodes", "operator commands on the inventory and command keys"),
    ("cli", "capacity", "usage export"),
    ("cli", "iam", "bootstrap tokens"),
    ("cli", "audit", "audit export, verify and prune"),
    ("cli", "sim", "the sim command"),
    ("cli", "bench", "the bench command"),
];

/// The Markdown the docs hold between the markers: a Mermaid graph of [`EDGES`] and a table of
/// their reasons, in the order listed.
pub fn diagram(edges: &[(&str, &str, &str)]) -> String {
    let mut out = String::from("```mermaid\ngraph BT\n");
    for (from, to, _) in edges {
        out.push_str(&format!("  {from} --> {to}\n"));
    }
    out.push_str("```\n\n| crate | depends on | why |\n|---|---|---|\n");
    for (from, to, why) in edges {
        out.push_str(&format!("| `{from}` | `{to}` | {why} |\n"));
    }
    out
}

/// The line before the generated diagram in docs/architecture.md.
pub const BEGIN_MARKER: &str = "<!-- crate graph: generated from crates/checks/src/crate_graph.rs by its test (UPDATE_CRATE_GRAPH=1 rewrites it) -->";
/// The line after it.
pub const END_MARKER: &str = "<!-- end of crate graph -->";
