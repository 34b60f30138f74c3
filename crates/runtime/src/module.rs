//! The module contract. A module (capacity, nodes, events, …) registers everything it owns in one
//! place; the server is assembled from a list of modules, and registration order is merge order.

use std::collections::HashSet;
use std::sync::Arc;

use better_compute_db::Migration;

use crate::jobs::nodespec::NodeSpecController;
use crate::nodespec::NodeSpecPart;
use crate::outbox::Sink;
use crate::reconciler::Reconciler;

/// What a module contributes. Every method has an empty default, so a module names only what it has.
pub trait Module: Send + Sync + 'static {
    /// The module's name, e.g. `capacity`; also the name its migrations are recorded under.
    fn name(&self) -> &'static str;

    /// Its migrations, ordered by name.
    fn migrations(&self) -> &'static [Migration] {
        &[]
    }

    /// The metrics this module writes, for the catalogue (`docs/metrics.md`) and their `# HELP`.
    fn metrics(&self) -> &'static [crate::metrics::Metric] {
        &[]
    }

    /// Its reconcilers; each becomes a job of the same name.
    fn reconcilers(&self) -> Vec<Arc<dyn Reconciler>> {
        Vec::new()
    }

    /// In-process subscribers to the outbox, delivered by the `event-subscribers` job.
    fn subscribers(&self) -> Vec<Arc<dyn Sink>> {
        Vec::new()
    }

    /// Other outbox sinks (the webhook fan-out, say), delivered by the `outbox-dispatch` job.
    fn outbox_sinks(&self) -> Vec<Arc<dyn Sink>> {
        Vec::new()
    }

    /// Its parts of every node's desired state, merged in registration order by `nodespec`.
    fn node_spec_parts(&self) -> Vec<Arc<dyn NodeSpecPart>> {
        Vec::new()
    }

    /// The sections of nodes' reported status its jobs follow ([`crate::nodespec::StatusWatch`]).
    fn status_watches(&self) -> Vec<crate::nodespec::StatusWatch> {
        Vec::new()
    }

    /// Its things that hold nodes (for drains), in registration order.
    fn node_occupants(&self) -> Vec<Arc<dyn crate::occupancy::NodeOccupant>> {
        Vec::new()
    }

    /// The command kinds it defines.
    fn command_kinds(&self) -> Vec<crate::commands::CommandKind> {
        Vec::new()
    }

    /// The permissions its methods check, for the catalog.
    fn permissions(&self) -> Vec<crate::authz::Permission> {
        Vec::new()
    }

    /// The event types it writes to the outbox, for the catalogue.
    fn event_types(&self) -> Vec<crate::events::EventType> {
        Vec::new()
    }

    /// Its workflow definitions, which the workflow engine runs (a module whose
    /// [`Module::runs_workflows`] is true; the registry refuses definitions without one).
    fn workflows(&self) -> Vec<Arc<dyn crate::workflow::WorkflowDefinition>> {
        Vec::new()
    }

    /// Whether it is the workflow engine (the `workflows` module), which stores and advances the
    /// other modules' workflows.
    fn runs_workflows(&self) -> bool {
        false
    }
}

/// Why a set of modules cannot be assembled.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegistryError {
    /// Two modules share a name.
    #[error("module {0} is registered twice")]
    DuplicateModule(String),
    /// Two reconcilers (or a reconciler and a built-in job) share a job name.
    #[error("job {0} is registered twice")]
    DuplicateJob(String),
    /// Two command kinds share a name.
    #[error("command kind {0} is registered twice")]
    DuplicateCommandKind(String),
    /// Two modules declare the same event type.
    #[error("event type {0} is declared twice")]
    DuplicateEventType(String),
    /// Two workflow definitions share a name.
    #[error("workflow definition {0} is registered twice")]
    DuplicateWorkflow(String),
    /// Two sinks share a name.
    #[error("outbox sink {0} is registered twice")]
    DuplicateSink(String),
    /// A module defines workflows but no module runs them.
    #[error("module {0} defines workflows, but no registered module runs them (register the workflows module)")]
    WorkflowsWithoutEngine(String),
    /// A module's migration is recorded under another module's name.
    #[error("module {module} contributes migration {migration} of another module")]
    ForeignMigration {
        /// The contributing module.
        module: String,
        /// `module/name` of the migration.
        migration: String,
    },
}

/// The built-in job that delivers in-process subscribers.
pub const EVENT_SUBSCRIBERS_JOB: &str = "event-subscribers";
/// The built-in job that delivers the other outbox sinks.
pub const OUTBOX_DISPATCH_JOB: &str = "outbox-dispatch";

/// The assembled modules.
pub struct Registry {
    modules: Vec<Arc<dyn Module>>,
    reconcilers: Vec<Arc<dyn Reconciler>>,
    subscribers: Vec<Arc<dyn Sink>>,
    outbox_sinks: Vec<Arc<dyn Sink>>,
    command_kinds: Vec<crate::commands::CommandKind>,
    occupants: Arc<[Arc<dyn crate::occupancy::NodeOccupant>]>,
    command_signer: std::sync::OnceLock<Arc<crate::signing::CommandSigner>>,
    workflows: Vec<Arc<dyn crate::workflow::WorkflowDefinition>>,
}

impl Registry {
    /// Gives this process's registry the command-signing key, so destructive commands enqueued
    /// through it are signed. Once: a second key is refused (false).
    pub fn install_command_signer(&self, signer: Arc<crate::signing::CommandSigner>) -> bool {
        self.command_signer.set(signer).is_ok()
    }

    /// The command-signing key, if this process loaded one.
    pub fn command_signer(&self) -> Option<&crate::signing::CommandSigner> {
        self.command_signer.get().map(|s| &**s)
    }

    /// Assembles modules in order, refusing duplicate names.
    pub fn new(modules: Vec<Arc<dyn Module>>) -> Result<Registry, RegistryError> {
        let mut names = HashSet::new();
        let mut jobs: HashSet<String> =
            [EVENT_SUBSCRIBERS_JOB, OUTBOX_DISPATCH_JOB, crate::jobs::housekeeping::HOUSEKEEPING.name].map(String::from).into();
        let mut sinks = HashSet::new();
        let (mut reconcilers, mut subscribers, mut outbox_sinks) = (Vec::new(), Vec::new(), Vec::new());
        let mut parts: Vec<Arc<dyn NodeSpecPart>> = Vec::new();
        let mut command_kinds: Vec<crate::commands::CommandKind> = Vec::new();
        let mut workflows: Vec<Arc<dyn crate::workflow::WorkflowDefinition>> = Vec::new();
        // The first module that defines a workflow, which needs a module that runs them.
        let mut definer: Option<&'static str> = None;
        for m in &modules {
            if !names.insert(m.name()) {
                return Err(RegistryError::DuplicateModule(m.name().to_owned()));
            }
            if let Some(foreign) = m.migrations().iter().find(|mig| mig.module != m.name()) {
                return Err(RegistryError::ForeignMigration {
                    module: m.name().to_owned(),
                    migration: format!("{}/{}", foreign.module, foreign.name),
                });
            }
            for r in m.reconcilers() {
                if !jobs.insert(r.kind().name.to_owned()) {
                    return Err(RegistryError::DuplicateJob(r.kind().name.to_owned()));
                }
                reconcilers.push(r);
            }
            parts.extend(m.node_spec_parts());
            for w in m.workflows() {
                definer.get_or_insert(m.name());
                if workflows.iter().any(|d| d.name() == w.name()) {
                    return Err(RegistryError::DuplicateWorkflow(w.name().to_owned()));
                }
                workflows.push(w);
            }
            for k in m.command_kinds() {
                if command_kinds.iter().any(|c| c.name == k.name) {
                    return Err(RegistryError::DuplicateCommandKind(k.name.to_owned()));
                }
                command_kinds.push(k);
            }
            for (list, out) in [(m.subscribers(), &mut subscribers), (m.outbox_sinks(), &mut outbox_sinks)] {
                for s in list {
                    if !sinks.insert(s.name().to_owned()) {
                        return Err(RegistryError::DuplicateSink(s.name().to_owned()));
                    }
                    out.push(s);
                }
            }
        }
        let mut event_types = HashSet::new();
        if let Some(dup) = modules.iter().flat_map(|m| m.event_types()).find(|t| !event_types.insert(t.name)) {
            return Err(RegistryError::DuplicateEventType(dup.name.to_owned()));
        }
        // The NodeSpec controller runs once some module contributes desired state.
        if !parts.is_empty() {
            if !jobs.insert(crate::desired::NODESPEC.name.to_owned()) {
                return Err(RegistryError::DuplicateJob(crate::desired::NODESPEC.name.to_owned()));
            }
            reconcilers.push(Arc::new(NodeSpecController { parts }));
        }
        if let Some(m) = definer
            && !modules.iter().any(|m| m.runs_workflows())
        {
            return Err(RegistryError::WorkflowsWithoutEngine(m.to_owned()));
        }
        reconcilers.push(Arc::new(crate::jobs::housekeeping::Housekeeping));
        let occupants = modules.iter().flat_map(|m| m.node_occupants()).collect();
        Ok(Registry { modules, reconcilers, subscribers, outbox_sinks, command_kinds, occupants, command_signer: std::sync::OnceLock::new(), workflows })
    }

    /// Every migration set: the clock, core, the runtime, then each module's in registration order.
    pub fn migrations(&self) -> Vec<&'static [Migration]> {
        let mut sets = better_compute_db::FOUNDATION_MIGRATIONS.to_vec();
        sets.push(crate::RUNTIME_MIGRATIONS);
        sets.extend(self.modules.iter().map(|m| m.migrations()).filter(|s| !s.is_empty()));
        sets
    }

    /// The modules, in registration order.
    pub fn modules(&self) -> &[Arc<dyn Module>] {
        &self.modules
    }

    /// Every metric the runtime and the modules write, the runtime's first, then each module's in
    /// registration order.
    pub fn metrics(&self) -> Vec<crate::metrics::Metric> {
        let mut all = crate::metrics::RUNTIME_METRICS.to_vec();
        all.extend(self.modules.iter().flat_map(|m| m.metrics().iter().copied()));
        all
    }

    /// Every reconciler, in registration order.
    pub fn reconcilers(&self) -> &[Arc<dyn Reconciler>] {
        &self.reconcilers
    }

    /// In-process subscribers.
    pub fn subscribers(&self) -> &[Arc<dyn Sink>] {
        &self.subscribers
    }

    /// Other outbox sinks.
    pub fn outbox_sinks(&self) -> &[Arc<dyn Sink>] {
        &self.outbox_sinks
    }

    /// Every module's things that hold nodes, in registration order.
    pub fn node_occupants(&self) -> &Arc<[Arc<dyn crate::occupancy::NodeOccupant>]> {
        &self.occupants
    }

    /// Every module's watches of nodes' reported status, in registration order; the gateway's
    /// report path wakes their jobs.
    pub fn status_watches(&self) -> Vec<crate::nodespec::StatusWatch> {
        self.modules.iter().flat_map(|m| m.status_watches()).collect()
    }

    /// Every command kind, in registration order.
    pub fn command_kinds(&self) -> &[crate::commands::CommandKind] {
        &self.command_kinds
    }

    /// The event catalogue: every module's event types, in registration order.
    pub fn event_types(&self) -> Vec<crate::events::EventType> {
        self.modules.iter().flat_map(|m| m.event_types()).collect()
    }

    /// The permission catalog: every module's permissions, in registration order, then the
    /// runtime's own (the jobs' state).
    pub fn permissions(&self) -> Vec<crate::authz::Permission> {
        let mut perms: Vec<_> = self.modules.iter().flat_map(|m| m.permissions()).collect();
        perms.extend(crate::status::permissions());
        perms
    }

    /// Every workflow definition, in registration order.
    pub fn workflows(&self) -> &[Arc<dyn crate::workflow::WorkflowDefinition>] {
        &self.workflows
    }

    /// A workflow definition by name.
    pub fn workflow(&self, name: &str) -> Option<&Arc<dyn crate::workflow::WorkflowDefinition>> {
        self.workflows.iter().find(|w| w.name() == name)
    }

    /// A command kind by name.
    pub fn command_kind(&self, name: &str) -> Option<&crate::commands::CommandKind> {
        self.command_kinds.iter().find(|k| k.name == name)
    }

    /// Every job name: the reconcilers', the outbox sinks' (each a job of its own, run by
    /// `outbox-dispatch`), then the built-in ones.
    pub fn job_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.reconcilers.iter().map(|r| r.kind().name).collect();
        names.extend(self.outbox_sinks.iter().map(|s| s.name()));
        names.push(EVENT_SUBSCRIBERS_JOB);
        names.push(OUTBOX_DISPATCH_JOB);
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::EventType;

    struct Declares(&'static str, &'static str);

    impl Module for Declares {
        fn name(&self) -> &'static str {
            self.0
        }

        fn event_types(&self) -> Vec<EventType> {
            vec![EventType { name: self.1, version: 1, audience: "tenant", description: "", data: &[] }]
        }
    }

    #[test]
    fn modules_assemble_in_order_and_refuse_duplicates() {
        let r = Registry::new(vec![Arc::new(Declares("a", "x.one")), Arc::new(Declares("b", "x.two"))]).unwrap();
        assert_eq!(r.event_types().iter().map(|t| t.name).collect::<Vec<_>>(), ["x.one", "x.two"]);
        let dup = Registry::new(vec![Arc::new(Declares("a", "x.one")), Arc::new(Declares("b", "x.one"))]).err();
        assert_eq!(dup, Some(RegistryError::DuplicateEventType("x.one".into())));
        let dup = Registry::new(vec![Arc::new(Declares("a", "x.one")), Arc::new(Declares("a", "x.two"))]).err();
        assert_eq!(dup, Some(RegistryError::DuplicateModule("a".into())));
    }

    struct Defines(bool);

    struct NoSteps;

    #[async_trait::async_trait]
    impl crate::workflow::WorkflowDefinition for NoSteps {
        fn name(&self) -> &'static str {
            "x.nothing"
        }
        fn summary(&self) -> &'static str {
            ""
        }
        fn steps(&self) -> &[crate::workflow::StepDef] {
            &[]
        }
        fn check_params(&self, _: &serde_json::Value) -> Result<(), better_compute_core::Error> {
            Ok(())
        }
        async fn node_pool(&self, _: &tokio_postgres::Transaction<'_>, _: &str) -> Result<String, better_compute_db::DbError> {
            Ok(String::new())
        }
        async fn expand(&self, _: &tokio_postgres::Transaction<'_>, _: &crate::workflow::Target) -> Result<Vec<String>, better_compute_db::DbError> {
            Ok(Vec::new())
        }
    }

    impl Module for Defines {
        fn name(&self) -> &'static str {
            if self.0 { "engine" } else { "definer" }
        }
        fn workflows(&self) -> Vec<Arc<dyn crate::workflow::WorkflowDefinition>> {
            if self.0 { Vec::new() } else { vec![Arc::new(NoSteps)] }
        }
        fn runs_workflows(&self) -> bool {
            self.0
        }
    }

    #[test]
    fn workflow_definitions_need_a_registered_engine() {
        let alone = Registry::new(vec![Arc::new(Defines(false))]).err();
        assert_eq!(alone, Some(RegistryError::WorkflowsWithoutEngine("definer".into())));
        let r = Registry::new(vec![Arc::new(Defines(false)), Arc::new(Defines(true))]).unwrap();
        assert_eq!(r.workflows().len(), 1);
    }
}
