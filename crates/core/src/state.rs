//! State tables: each aggregate's legal transitions, declared once.
//!
//! Code never writes a `state` column directly: it asks the aggregate's table whether `from -> to` is
//! legal, and the database layer applies the change with a version-guarded `UPDATE`. So the rules of
//! every lifecycle live here, in one place, and can be printed for the docs.

use crate::error::Error;

/// A state of some aggregate: a closed enum with stable wire names.
pub trait State: Copy + Eq + std::fmt::Debug + Send + Sync + 'static {
    /// Every state, in declaration order.
    const ALL: &'static [Self];
    /// The stored and wire name, e.g. `pending`.
    fn as_str(self) -> &'static str;
    /// Parses a stored name.
    fn parse(s: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|st| st.as_str() == s)
    }
}

/// One legal move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition<S> {
    /// The state before.
    pub from: S,
    /// The state after.
    pub to: S,
}

/// The legal transitions of one aggregate.
#[derive(Debug)]
pub struct StateTable<S: 'static> {
    /// The aggregate's name in messages, e.g. `reservation`.
    pub aggregate: &'static str,
    /// States a new record may start in.
    pub initial: &'static [S],
    /// States no transition leaves.
    pub terminal: &'static [S],
    /// Every legal transition.
    pub transitions: &'static [Transition<S>],
}

impl<S: State> StateTable<S> {
    /// Whether `from -> to` is legal.
    pub fn allows(&self, from: S, to: S) -> bool {
        self.transitions.iter().any(|t| t.from == from && t.to == to)
    }

    /// `Ok` when `from -> to` is legal, else `FAILED_PRECONDITION` naming both states.
    pub fn check(&self, from: S, to: S) -> Result<(), Error> {
        if self.allows(from, to) {
            Ok(())
        } else {
            Err(Error::failed_precondition(format!(
                "a {} in state {} cannot become {}",
                self.aggregate,
                from.as_str(),
                to.as_str()
            ))
            .with_details(serde_json::json!({
                "reason": "ILLEGAL_TRANSITION",
                "from": from.as_str(),
                "to": to.as_str(),
            })))
        }
    }

    /// The database's guard of this table on `table.column`: `<table>_<column>_may_become(from, to)`
    /// and a trigger that refuses any update of the column along an edge the table does not
    /// declare, with the error [`Self::check`] gives (SQLSTATE BCFPC: `FAILED_PRECONDITION`, reason
    /// `ILLEGAL_TRANSITION`). A new row may start anywhere (inserts are the owner's to check); only
    /// edges are guarded.
    pub fn sql_guard(&self, table: &str, column: &str) -> String {
        let edges: Vec<String> = self.transitions.iter().map(|t| format!("('{}', '{}')", t.from.as_str(), t.to.as_str())).collect();
        let name = format!("{table}_{column}");
        let trigger = if column == "state" { format!("{table}_state_guard") } else { format!("{name}_guard") };
        format!(
            "-- {aggregate}: no statement moves {table}.{column} along an edge the state table does not declare.
CREATE OR REPLACE FUNCTION {name}_may_become(p_from text, p_to text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
  SELECT (p_from, p_to) IN ({edges})
$$;

CREATE OR REPLACE FUNCTION {name}_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF NOT {name}_may_become(OLD.{column}, NEW.{column}) THEN
    RAISE EXCEPTION USING ERRCODE = 'BCFPC',
      MESSAGE = format('a {aggregate} in state %s cannot become %s', OLD.{column}, NEW.{column}),
      DETAIL = jsonb_build_object('reason', 'ILLEGAL_TRANSITION', 'from', OLD.{column}, 'to', NEW.{column})::text;
  END IF;
  RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER {trigger} BEFORE UPDATE OF {column} ON {table}
  FOR EACH ROW WHEN (OLD.{column} IS DISTINCT FROM NEW.{column}) EXECUTE FUNCTION {name}_guard();
",
            aggregate = self.aggregate,
            edges = edges.join(", "),
        )
    }

    /// Whether `s` is terminal.
    pub fn is_terminal(&self, s: S) -> bool {
        self.terminal.contains(&s)
    }

    /// Checks the table's own consistency: terminal states have no way out, every state is reachable
    /// from an initial one. Used by tests of every table.
    pub fn validate(&self) -> Result<(), String> {
        for t in self.transitions {
            if self.is_terminal(t.from) {
                return Err(format!("{}: terminal state {:?} has a way out", self.aggregate, t.from));
            }
        }
        let mut reached: Vec<S> = self.initial.to_vec();
        let mut i = 0;
        while i < reached.len() {
            let s = reached[i];
            for t in self.transitions.iter().filter(|t| t.from == s) {
                if !reached.contains(&t.to) {
                    reached.push(t.to);
                }
            }
            i += 1;
        }
        for s in S::ALL {
            if !reached.contains(s) {
                return Err(format!("{}: state {:?} is unreachable", self.aggregate, s));
            }
        }
        Ok(())
    }
}

/// Declares a state enum with its wire names.
#[macro_export]
macro_rules! states {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident = $text:literal,)* }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name { $($(#[$vdoc])* $variant,)* }
        impl $crate::state::State for $name {
            const ALL: &'static [Self] = &[$($name::$variant,)*];
            fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text,)* }
            }
        }
        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str($crate::state::State::as_str(*self))
            }
        }
        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                <$name as $crate::state::State>::parse(&s)
                    .ok_or_else(|| serde::de::Error::custom(format!("unknown state {s:?}")))
            }
        }
    };
}

const fn t<S>(from: S, to: S) -> Transition<S> {
    Transition { from, to }
}

states! {
    /// The lifecycle of a reservation.
    ReservationState {
        /// Accepted and charged to quota, waiting for capacity (`Unschedulable`, retried).
        Pending = "pending",
        /// Devices and scalars booked for its range; the range has not started.
        Placed = "placed",
        /// Inside its range, on its devices.
        Active = "active",
        /// Released by the tenant or an operator; bookings and quota returned.
        Released = "released",
        /// Its range ended.
        Expired = "expired",
        /// Could not be honoured (for example the node was retired).
        Failed = "failed",
    }
}

/// Legal reservation transitions.
pub static RESERVATION_STATE_TABLE: StateTable<ReservationState> = {
    use ReservationState::*;
    StateTable {
        aggregate: "reservation",
        initial: &[Pending, Placed],
        terminal: &[Released, Expired, Failed],
        transitions: &[
            t(Pending, Placed),
            t(Pending, Released),
            t(Pending, Expired),
            t(Pending, Failed),
            t(Placed, Active),
            t(Placed, Released),
            t(Placed, Expired),
            t(Placed, Failed),
            t(Active, Released),
            t(Active, Expired),
            t(Active, Failed),
        ],
    }
};

states! {
    /// The lifecycle of a command to a node.
    CommandState {
        /// Queued, not yet delivered (or sent back after `BUSY`).
        Pending = "pending",
        /// Delivered to the node's session; no answer yet.
        Sent = "sent",
        /// Acknowledged by the daemon, running.
        Running = "running",
        /// Finished successfully.
        Succeeded = "succeeded",
        /// Finished unsuccessfully, rejected, timed out or lost with the journal.
        Failed = "failed",
        /// Past `not_after` before it ran.
        Expired = "expired",
        /// Cancelled before it finished.
        Cancelled = "cancelled",
    }
}

/// Legal command transitions.
pub static COMMAND_STATE_TABLE: StateTable<CommandState> = {
    use CommandState::*;
    StateTable {
        aggregate: "command",
        initial: &[Pending],
        terminal: &[Succeeded, Failed, Expired, Cancelled],
        transitions: &[
            t(Pending, Sent),
            t(Pending, Expired),
            t(Pending, Cancelled),
            t(Sent, Pending),
            t(Sent, Running),
            t(Sent, Succeeded),
            t(Sent, Failed),
            t(Sent, Expired),
            t(Sent, Cancelled),
            t(Running, Succeeded),
            t(Running, Failed),
            t(Running, Cancelled),
        ],
    }
};

states! {
    /// The lifecycle of provisioning a machine (bare metal or a VPS).
    ProvisionState {
        /// Asked for, nothing done yet.
        Requested = "requested",
        /// Being installed.
        Provisioning = "provisioning",
        /// Installed and usable.
        Ready = "ready",
        /// Being torn down.
        Deprovisioning = "deprovisioning",
        /// Torn down.
        Deprovisioned = "deprovisioned",
        /// Provisioning or teardown failed; an operator decides.
        Failed = "failed",
    }
}

/// Legal provisioning transitions.
pub static PROVISION_STATE_TABLE: StateTable<ProvisionState> = {
    use ProvisionState::*;
    StateTable {
        aggregate: "provision",
        initial: &[Requested],
        terminal: &[Deprovisioned],
        transitions: &[
            t(Requested, Provisioning),
            t(Requested, Deprovisioned),
            t(Provisioning, Ready),
            t(Provisioning, Failed),
            t(Ready, Deprovisioning),
            t(Failed, Provisioning),
            t(Failed, Deprovisioning),
            t(Deprovisioning, Deprovisioned),
            t(Deprovisioning, Failed),
        ],
    }
};

states! {
    /// The lifecycle of a node's drain.
    DrainState {
        /// Asked for; the node is cordoned, and the drain waits for its pool's disruption budget.
        Queued = "queued",
        /// Admitted within the budget: waiting for the node's reservations to end, or ending them
        /// at the deadline (mode `evict`).
        Draining = "draining",
        /// Nothing holds the node any more.
        Drained = "drained",
        /// Undrained: the node is schedulable again (unless cordoned by other reasons).
        Cancelled = "cancelled",
        /// The node was retired: out of placement forever.
        Retired = "retired",
    }
}

/// Legal drain transitions.
pub static DRAIN_STATE_TABLE: StateTable<DrainState> = {
    use DrainState::*;
    StateTable {
        aggregate: "drain",
        initial: &[Queued],
        terminal: &[Cancelled, Retired],
        transitions: &[
            t(Queued, Draining),
            t(Queued, Cancelled),
            t(Draining, Drained),
            t(Draining, Cancelled),
            t(Drained, Cancelled),
            t(Drained, Retired),
        ],
    }
};

states! {
    /// A GPU's health, as the `health` job moves it.
    GpuHealthState {
        /// In placement.
        Healthy = "healthy",
        /// A transient error: out of placement until `diag.nvml` checks it.
        Suspect = "suspect",
        /// Hardware, a failed check, or transient errors repeating: quarantined until an operator
        /// decides.
        Unhealthy = "unhealthy",
        /// A check passed: out of placement until enough clean checks in a row.
        Recovering = "recovering",
    }
}

/// Legal GPU health transitions.
pub static GPU_HEALTH_STATE_TABLE: StateTable<GpuHealthState> = {
    use GpuHealthState::*;
    StateTable {
        aggregate: "GPU health",
        initial: &[Healthy],
        terminal: &[],
        transitions: &[
            t(Healthy, Suspect),
            t(Healthy, Unhealthy),
            t(Suspect, Recovering),
            t(Suspect, Unhealthy),
            t(Recovering, Healthy),
            t(Recovering, Suspect),
            t(Recovering, Unhealthy),
            t(Unhealthy, Recovering),
        ],
    }
};

states! {
    /// The lifecycle of a workflow.
    WorkflowState {
        /// Its current step is advancing.
        Running = "running",
        /// Stopped for an operator (a step failed with `hold`, or a fleet-wide run paused on a
        /// node's failure): `workflows.resume` goes on, `workflows.cancel` ends it.
        Held = "held",
        /// A cancel was asked for: the job stops the current step's command, then ends it.
        Cancelling = "cancelling",
        /// Every step succeeded.
        Succeeded = "succeeded",
        /// A step failed with `fail`, after its compensation.
        Failed = "failed",
        /// Cancelled.
        Cancelled = "cancelled",
    }
}

/// Legal workflow transitions.
pub static WORKFLOW_STATE_TABLE: StateTable<WorkflowState> = {
    use WorkflowState::*;
    StateTable {
        aggregate: "workflow",
        initial: &[Running],
        terminal: &[Succeeded, Failed, Cancelled],
        transitions: &[
            t(Running, Held),
            t(Running, Cancelling),
            t(Running, Succeeded),
            t(Running, Failed),
            t(Held, Running),
            t(Held, Cancelling),
            t(Cancelling, Cancelled),
        ],
    }
};

states! {
    /// The lifecycle of an instance (a VM on a reservation's atoms). Its desired power and its
    /// presence are sections of the node's desired state; the state says how far the host is.
    InstanceState {
        /// Accepted; its reservation is not placed yet, or its host has not been told.
        Requested = "requested",
        /// In the host's desired state, running; the host has not reported it running yet.
        Provisioning = "provisioning",
        /// The host reports the VM running.
        Running = "running",
        /// Asked to stop; the host has not reported it stopped yet.
        Stopping = "stopping",
        /// The host reports the VM stopped (its disk kept).
        Stopped = "stopped",
        /// Asked to go (by the tenant, or because its reservation ended); the host has not
        /// reported the VM and its disk gone yet.
        Deleting = "deleting",
        /// Gone from the host.
        Deleted = "deleted",
        /// The host could not run it (the reason says why); delete it.
        Failed = "failed",
    }
}

/// Legal instance transitions.
pub static INSTANCE_STATE_TABLE: StateTable<InstanceState> = {
    use InstanceState::*;
    StateTable {
        aggregate: "instance",
        initial: &[Requested],
        terminal: &[Deleted],
        transitions: &[
            t(Requested, Provisioning),
            t(Requested, Deleting),
            // Never placed: nothing is on any host.
            t(Requested, Deleted),
            t(Provisioning, Running),
            t(Provisioning, Stopping),
            t(Provisioning, Deleting),
            t(Provisioning, Failed),
            t(Running, Stopping),
            t(Running, Deleting),
            t(Running, Failed),
            t(Stopping, Stopped),
            t(Stopping, Deleting),
            t(Stopped, Provisioning),
            t(Stopped, Deleting),
            t(Failed, Deleting),
            t(Deleting, Deleted),
        ],
    }
};

states! {
    /// The lifecycle of one step of a workflow.
    WorkflowStepState {
        /// Not reached yet.
        Pending = "pending",
        /// Current: its action started, or it waits on its condition.
        Running = "running",
        /// An attempt failed; the next waits for its back-off.
        Retrying = "retrying",
        /// Done.
        Succeeded = "succeeded",
        /// Out of attempts (the workflow holds or fails).
        Failed = "failed",
        /// Skipped: a resume went on past it, or a compensation jumped over it.
        Skipped = "skipped",
        /// Stopped by a cancel.
        Cancelled = "cancelled",
    }
}

/// Legal step transitions. A resume sends the steps it runs again back to pending.
pub static WORKFLOW_STEP_STATE_TABLE: StateTable<WorkflowStepState> = {
    use WorkflowStepState::*;
    StateTable {
        aggregate: "workflow step",
        initial: &[Pending],
        terminal: &[Cancelled],
        transitions: &[
            t(Pending, Running),
            t(Pending, Skipped),
            t(Pending, Cancelled),
            t(Running, Retrying),
            t(Running, Succeeded),
            t(Running, Failed),
            t(Running, Cancelled),
            t(Retrying, Running),
            t(Retrying, Cancelled),
            t(Failed, Pending),
            t(Failed, Skipped),
            t(Failed, Cancelled),
            t(Succeeded, Pending),
            t(Skipped, Pending),
        ],
    }
};

/// A state table seen through its states' names, so tables of different state types sit in one
/// list ([`GUARDED_COLUMNS`]).
pub trait NamedStateTable: Sync {
    /// Every state's name.
    fn state_names(&self) -> Vec<&'static str>;
    /// Whether `from -> to` is legal, by name (an unknown name: no).
    fn allows_names(&self, from: &str, to: &str) -> bool;
    /// [`StateTable::sql_guard`].
    fn sql_guard_of(&self, table: &str, column: &str) -> String;
}

impl<S: State> NamedStateTable for StateTable<S> {
    fn state_names(&self) -> Vec<&'static str> {
        S::ALL.iter().map(|s| s.as_str()).collect()
    }
    fn allows_names(&self, from: &str, to: &str) -> bool {
        matches!((S::parse(from), S::parse(to)), (Some(f), Some(t)) if self.allows(f, t))
    }
    fn sql_guard_of(&self, table: &str, column: &str) -> String {
        self.sql_guard(table, column)
    }
}

/// A column a state table guards in the database: its owning module, table and column.
#[derive(Clone, Copy)]
pub struct GuardedColumn {
    /// The module that owns the table; its `src/sql/state_guards.sql` holds the guard.
    pub module: &'static str,
    /// The table.
    pub table: &'static str,
    /// The state column.
    pub column: &'static str,
    /// Its state table.
    pub states: &'static dyn NamedStateTable,
}

/// Every stateful table's guard. (`PROVISION_STATE_TABLE` has no table yet.)
pub static GUARDED_COLUMNS: &[GuardedColumn] = &[
    GuardedColumn { module: "capacity", table: "reservations", column: "state", states: &RESERVATION_STATE_TABLE },
    GuardedColumn { module: "nodes", table: "commands", column: "state", states: &COMMAND_STATE_TABLE },
    GuardedColumn { module: "nodes", table: "devices", column: "health_state", states: &GPU_HEALTH_STATE_TABLE },
    GuardedColumn { module: "nodes", table: "node_drains", column: "state", states: &DRAIN_STATE_TABLE },
    GuardedColumn { module: "workflows", table: "workflows", column: "state", states: &WORKFLOW_STATE_TABLE },
    GuardedColumn { module: "workflows", table: "workflow_steps", column: "state", states: &WORKFLOW_STEP_STATE_TABLE },
    GuardedColumn { module: "vps", table: "instances", column: "state", states: &INSTANCE_STATE_TABLE },
];

/// The generated `src/sql/state_guards.sql` of `module`: the guards of its tables.
pub fn state_guards_sql(module: &str) -> String {
    let mut out = String::from(
        "-- Generated from better_compute_core::state (GUARDED_COLUMNS); do not edit. The state tables'\n\
         -- guards for this module's tables: the database refuses an illegal edge whoever writes it.\n\
         -- Rewrite with: UPDATE_STATE_GUARDS=1 cargo nextest run -p better-compute-core\n",
    );
    for g in GUARDED_COLUMNS.iter().filter(|g| g.module == module) {
        out.push('\n');
        out.push_str(&g.states.sql_guard_of(g.table, g.column));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::Path;

    use super::*;

    /// Every module's `src/sql/state_guards.sql` is generated from the state tables, and the module
    /// applies it.
    #[test]
    fn every_modules_state_guards_are_generated_from_the_state_tables_and_applied() {
        let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let modules: BTreeSet<&str> = GUARDED_COLUMNS.iter().map(|g| g.module).collect();
        assert_eq!(modules.len(), 4, "{modules:?}");
        for module in modules {
            let file = crates.join(module).join("src/sql/state_guards.sql");
            let want = state_guards_sql(module);
            if std::env::var_os("UPDATE_STATE_GUARDS").is_some() {
                std::fs::write(&file, &want).unwrap();
            }
            let on_disk = std::fs::read_to_string(&file).unwrap_or_default();
            assert_eq!(on_disk, want, "{} drifted from the state tables; rewrite it: UPDATE_STATE_GUARDS=1 cargo nextest run -p better-compute-core", file.display());
            let lib = std::fs::read_to_string(crates.join(module).join("src/lib.rs")).unwrap();
            assert!(lib.contains("include_str!(\"sql/state_guards.sql\")"), "{module} does not apply its state guards");
        }
    }

    #[test]
    fn every_declared_table_is_consistent() {
        RESERVATION_STATE_TABLE.validate().unwrap();
        COMMAND_STATE_TABLE.validate().unwrap();
        PROVISION_STATE_TABLE.validate().unwrap();
        DRAIN_STATE_TABLE.validate().unwrap();
        GPU_HEALTH_STATE_TABLE.validate().unwrap();
        WORKFLOW_STATE_TABLE.validate().unwrap();
        WORKFLOW_STEP_STATE_TABLE.validate().unwrap();
        INSTANCE_STATE_TABLE.validate().unwrap();
    }

    #[test]
    fn an_illegal_transition_is_a_failed_precondition_naming_both_states() {
        let err = RESERVATION_STATE_TABLE
            .check(ReservationState::Released, ReservationState::Active)
            .unwrap_err();
        assert_eq!(err.code, crate::ErrorCode::FailedPrecondition);
        assert_eq!(err.details["from"], "released");
        assert_eq!(err.details["to"], "active");
        assert!(RESERVATION_STATE_TABLE.check(ReservationState::Pending, ReservationState::Placed).is_ok());
    }

    #[test]
    fn validate_catches_a_way_out_of_a_terminal_state_and_an_unreachable_state() {
        static BAD_EXIT: StateTable<CommandState> = StateTable {
            aggregate: "bad",
            initial: &[CommandState::Pending],
            terminal: &[CommandState::Failed],
            transitions: &[t(CommandState::Failed, CommandState::Pending)],
        };
        assert!(BAD_EXIT.validate().unwrap_err().contains("terminal"));
        static UNREACHABLE: StateTable<CommandState> = StateTable {
            aggregate: "bad",
            initial: &[CommandState::Pending],
            terminal: &[],
            transitions: &[t(CommandState::Pending, CommandState::Sent)],
        };
        assert!(UNREACHABLE.validate().unwrap_err().contains("unreachable"));
    }

    #[test]
    fn states_parse_their_wire_names_only() {
        assert_eq!(CommandState::parse("running"), Some(CommandState::Running));
        assert_eq!(CommandState::parse("Running"), None);
        assert_eq!(serde_json::to_string(&ProvisionState::Ready).unwrap(), "\"ready\"");
    }
}
