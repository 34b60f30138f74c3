//! Events: webhooks per tenant, signed by the Standard Webhooks scheme, fanned out from the outbox
//! (`events.fanout`), sent with retries, `Retry-After`, 410 handling and dead letters
//! (`events.deliver`), only to public addresses unless the operator says otherwise, and pruned
//! (`events.prune`). The watch stream is served by the API from the same outbox.

pub mod jobs;
pub mod signing;
pub mod ssrf;
pub mod webhooks;

use std::sync::Arc;
use std::time::Duration;

use better_compute_db::Migration;
use better_compute_runtime::authz::Permission;
use better_compute_runtime::events::EventType;
use better_compute_runtime::{Reconciler, Sink};

pub use ssrf::EgressPolicy;

/// The events module's migrations.
pub const EVENTS_MIGRATIONS: &[Migration] =
    &[Migration::numbered("events", "0001_events", include_str!("migrations/events/0001_events.sql"))];

pub use jobs::deliver::DELIVER;

/// `compute:webhooks:read` (tenant).
pub const WEBHOOKS_READ: &str = "compute:webhooks:read";
/// `compute:webhooks:write` (tenant).
pub const WEBHOOKS_WRITE: &str = "compute:webhooks:write";

/// The module's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EventsConfig {
    /// Where webhooks may go.
    pub policy: EgressPolicy,
    /// Per delivery request (10 s): well inside the delivery's claim.
    pub timeout: Duration,
    /// How long one endpoint's run starts new sends (20 s); the rest of its claim goes back to due.
    pub endpoint_budget: Duration,
    /// How long events and finished deliveries are kept (7 days).
    pub retention: Duration,
}

impl Default for EventsConfig {
    fn default() -> Self {
        EventsConfig {
            policy: EgressPolicy::default(),
            timeout: Duration::from_secs(10),
            endpoint_budget: jobs::deliver::ENDPOINT_BUDGET,
            retention: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

impl EventsConfig {
    /// The defaults, with the egress policy and `BETTER_COMPUTE_EVENTS_RETENTION_S` from the environment.
    pub fn from_env() -> EventsConfig {
        let mut c = EventsConfig { policy: EgressPolicy::from_env(), ..EventsConfig::default() };
        if let Some(s) = std::env::var("BETTER_COMPUTE_EVENTS_RETENTION_S").ok().and_then(|v| v.parse().ok()) {
            c.retention = Duration::from_secs(s);
        }
        c
    }
}

/// The events module, for the registry.
#[derive(Default)]
pub struct EventsModule {
    /// Its settings.
    pub config: EventsConfig,
}

impl better_compute_runtime::Module for EventsModule {
    fn name(&self) -> &'static str {
        "events"
    }

    fn migrations(&self) -> &'static [Migration] {
        EVENTS_MIGRATIONS
    }

    fn metrics(&self) -> &'static [better_compute_runtime::metrics::Metric] {
        use better_compute_runtime::metrics::{m, MetricKind::Counter};
        const METRICS: &[better_compute_runtime::metrics::Metric] = &[
            m("better_compute_webhook_deliveries_total", Counter, &["outcome"], "worker", "Webhook delivery attempts by outcome: delivered, failed (retried later, or dead after the last attempt), gone (410: the endpoint is disabled), deferred (not sent within the run's budget)."),
        ];
        METRICS
    }

    fn reconcilers(&self) -> Vec<Arc<dyn Reconciler>> {
        vec![
            Arc::new(jobs::deliver::Deliverer { policy: self.config.policy, timeout: self.config.timeout, budget: self.config.endpoint_budget }),
            Arc::new(jobs::prune::Pruner { retention: self.config.retention }),
        ]
    }

    fn outbox_sinks(&self) -> Vec<Arc<dyn Sink>> {
        vec![Arc::new(jobs::fanout::Fanout)]
    }

    fn permissions(&self) -> Vec<Permission> {
        vec![
            Permission { name: WEBHOOKS_READ, description: "Read the tenant's webhooks and dead letters." },
            Permission { name: WEBHOOKS_WRITE, description: "Create, change, test and delete webhooks; rotate secrets; replay dead letters." },
        ]
    }

    fn event_types(&self) -> Vec<EventType> {
        vec![EventType {
            name: webhooks::TEST_EVENT,
            version: 1,
            audience: "tenant",
            description: "Sent by webhooks.test to one endpoint only.",
            data: &[],
        }]
    }
}
