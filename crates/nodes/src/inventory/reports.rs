//! Daemons' reports applied in groups: a gateway gathers what many of its sessions said and applies
//! it in one transaction, one statement per kind of report, under every session's fence. A group
//! of one is the same code, so a group that fails can be applied again session by session.
//!
//! Lock order, as everywhere in this module: nodes (in id order), node_sessions (in node order),
//! commands.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use better_compute_core::state::{CommandState, State, COMMAND_STATE_TABLE};
use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_runtime::nodespec::StatusWatch;
use better_compute_proto::v1::{Health, Inventory, SpecStatus};
use tokio_postgres::GenericClient;

use crate::commands::{self, Rejection};
use crate::sessions;

/// One thing a daemon reported.
#[derive(Debug, Clone)]
pub enum Report {
    /// It accepted a command and runs it.
    Ack {
        /// The command.
        command_id: String,
    },
    /// It refused a command.
    Reject {
        /// The command.
        command_id: String,
        /// Why.
        why: Rejection,
    },
    /// It finished a command.
    Result {
        /// The command.
        command_id: String,
        /// Whether it succeeded.
        succeeded: bool,
        /// Why not.
        reason: Option<String>,
        /// The kind's report.
        result: serde_json::Value,
    },
    /// What it has applied of its desired state.
    SpecStatus(SpecStatus),
    /// Its hardware.
    Inventory(Inventory),
    /// Its GPUs' health.
    Health(Health),
    /// What a VM on it wrote to its serial console.
    Console {
        /// The instance the VM is.
        instance_id: String,
        /// Where `data` starts in the console.
        offset: u64,
        /// The bytes.
        data: Vec<u8>,
    },
}

impl Report {
    /// Whether it writes the node's own row (which is then locked before the session's).
    fn writes_node(&self) -> bool {
        matches!(self, Report::SpecStatus(_) | Report::Inventory(_) | Report::Health(_))
    }
}

/// What one session said since its last report, in order.
#[derive(Debug, Clone)]
pub struct SessionReports {
    /// The node.
    pub node_id: String,
    /// The epoch of the session that heard it: the fence.
    pub epoch: i64,
    /// The reports.
    pub reports: Vec<Report>,
}

/// What applying a group did.
#[derive(Debug, Clone, Default)]
pub struct Applied {
    /// The nodes whose session still held, so their reports were applied. For every other session
    /// that was not deferred nothing was written: it was superseded or closed, and the gateway
    /// ends it.
    pub held: HashSet<String>,
    /// Held nodes where a result or a BUSY freed a lane credit: dispatch them again.
    pub freed: BTreeSet<String>,
    /// Commands that reached an end.
    pub settled: u64,
    /// Sessions left out because another transaction held their node's row
    /// ([`NodeLocks::SkipBusy`]): nothing of theirs was written; apply them again.
    pub deferred: Vec<String>,
}

/// How a group treats a node row that another transaction holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeLocks {
    /// Wait for it: a session applied alone.
    Wait,
    /// Leave that session out of the group ([`Applied::deferred`]), so one busy node (a session
    /// opening, a liveness pass) never holds up the reports of every other session in the group.
    SkipBusy,
}

/// Applies the reports of many sessions in the caller's transaction. Every write is fenced by its
/// session's epoch, and each keeps the guard it has alone: the state table's edges for commands,
/// `observedGeneration` only moving up. Delivery is at least once, so a report that no longer fits
/// (a repeat, an ack of a command that ended, another node's command) changes nothing.
pub async fn apply(
    tx: &impl GenericClient,
    gateway_id: &str,
    sessions: &[&SessionReports],
    locks: NodeLocks,
    watches: &[StatusWatch],
) -> Result<Applied, DbError> {
    for s in sessions {
        for r in &s.reports {
            check(r)?;
        }
    }
    // Lock order: the nodes whose own row is written, in id order, then the sessions.
    let writes_node: BTreeSet<&str> =
        sessions.iter().filter(|s| s.reports.iter().any(Report::writes_node)).map(|s| s.node_id.as_str()).collect();
    let mut deferred = Vec::new();
    if !writes_node.is_empty() {
        let ids: Vec<&str> = writes_node.iter().copied().collect();
        let sql = match locks {
            NodeLocks::Wait => "SELECT id FROM nodes WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE",
            NodeLocks::SkipBusy => "SELECT id FROM nodes WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE SKIP LOCKED",
        };
        let locked: HashSet<String> = tx.query(sql, &[&ids]).await?.iter().map(|r| r.get(0)).collect();
        deferred = writes_node.iter().filter(|n| !locked.contains(**n)).map(|n| (*n).to_owned()).collect();
    }
    let sessions: Vec<&SessionReports> = sessions.iter().copied().filter(|s| !deferred.contains(&s.node_id)).collect();
    let nodes: Vec<&str> = sessions.iter().map(|s| s.node_id.as_str()).collect();
    let epochs: Vec<i64> = sessions.iter().map(|s| s.epoch).collect();
    let held = sessions::fence(tx, gateway_id, &nodes, &epochs).await?;
    let mut applied = Applied { held, deferred, ..Applied::default() };
    let live = sessions.iter().filter(|s| applied.held.contains(&s.node_id));

    let (mut acks, mut results, mut rejects) = (Vec::new(), Vec::new(), Vec::new());
    // The last spec status and inventory of each node: the newest says all.
    let (mut specs, mut inventories) = (BTreeMap::new(), BTreeMap::new());
    let (mut health, mut consoles) = (Vec::new(), Vec::new());
    for s in live {
        let node = s.node_id.as_str();
        for r in &s.reports {
            match r {
                Report::Ack { command_id } => acks.push((node, command_id.as_str())),
                Report::Result { command_id, succeeded, reason, result } => results.push((node, command_id.as_str(), *succeeded, reason.as_deref(), result)),
                Report::Reject { command_id, why } => rejects.push((node, command_id.as_str(), *why)),
                Report::SpecStatus(st) => {
                    specs.insert(node, st);
                }
                Report::Inventory(inv) => {
                    inventories.insert(node, inv);
                }
                Report::Health(h) => health.push((node, h)),
                Report::Console { instance_id, offset, data } => consoles.push((node, instance_id.as_str(), *offset, data.as_slice())),
            }
        }
    }
    acknowledge(tx, &acks).await?;
    let ended = finish(tx, &results).await?;
    applied.settled += ended.len() as u64;
    applied.freed.extend(ended);
    for (node, id, why) in rejects {
        if sessions::report_reject(tx, node, id, why).await? {
            if why == Rejection::Busy {
                applied.freed.insert(node.to_owned());
            } else {
                applied.settled += 1;
            }
        }
    }
    spec_statuses(tx, &specs, watches).await?;
    for (node, inv) in inventories {
        sessions::report_inventory(tx, node, inv).await?;
    }
    for (node, h) in health {
        crate::health::record(tx, node, h).await?;
    }
    crate::sessions::consoles::append(tx, &consoles).await?;
    Ok(applied)
}

fn check(r: &Report) -> Result<(), Error> {
    match r {
        Report::SpecStatus(st) if st.observed_generation < 0 || st.generation < 0 => Err(Error::invalid_argument("generations are not negative")),
        Report::Ack { command_id } | Report::Reject { command_id, .. } | Report::Result { command_id, .. } if command_id.len() > 64 => {
            Err(Error::invalid_argument("a command id is at most 64 characters"))
        }
        Report::Console { instance_id, offset, data } => crate::sessions::consoles::check(instance_id, *offset, data),
        _ => Ok(()),
    }
}

/// sent → running, one statement: the WHERE is the state table's edge, so a repeat or a report
/// about another node's command matches no row.
async fn acknowledge(tx: &impl GenericClient, acks: &[(&str, &str)]) -> Result<(), DbError> {
    if acks.is_empty() {
        return Ok(());
    }
    debug_assert!(COMMAND_STATE_TABLE.check(CommandState::Sent, CommandState::Running).is_ok());
    let (nodes, ids): (Vec<&str>, Vec<&str>) = acks.iter().copied().unzip();
    tx.execute(
        "UPDATE commands c SET state = 'running', version = c.version + 1
           FROM unnest($1::text[], $2::text[]) AS u(node_id, id)
          WHERE c.id = u.id AND c.node_id = u.node_id AND c.state = 'sent'",
        &[&nodes, &ids],
    )
    .await?;
    Ok(())
}

/// sent or running → succeeded or failed, one statement guarded by the state table's edges; the
/// commands that ended are settled (owners woken, events written). Returns the nodes of those
/// that ended.
async fn finish(tx: &impl GenericClient, results: &[(&str, &str, bool, Option<&str>, &serde_json::Value)]) -> Result<BTreeSet<String>, DbError> {
    if results.is_empty() {
        return Ok(BTreeSet::new());
    }
    debug_assert!(COMMAND_STATE_TABLE.check(CommandState::Running, CommandState::Succeeded).is_ok());
    debug_assert!(COMMAND_STATE_TABLE.check(CommandState::Running, CommandState::Failed).is_ok());
    let nodes: Vec<&str> = results.iter().map(|r| r.0).collect();
    let ids: Vec<&str> = results.iter().map(|r| r.1).collect();
    let states: Vec<&str> = results.iter().map(|r| if r.2 { CommandState::Succeeded.as_str() } else { CommandState::Failed.as_str() }).collect();
    // A failure always says why.
    let reasons: Vec<Option<&str>> = results.iter().map(|r| if r.2 { None } else { Some(r.3.filter(|x| !x.is_empty()).unwrap_or("failed")) }).collect();
    let values: Vec<&serde_json::Value> = results.iter().map(|r| r.4).collect();
    let rows = tx
        .query(
            "UPDATE commands c SET state = u.state, reason = coalesce(u.reason, c.reason), result = u.result,
                    finished_at = compute_now(), version = c.version + 1
               FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::jsonb[]) AS u(node_id, id, state, reason, result)
              WHERE c.id = u.id AND c.node_id = u.node_id AND c.state IN ('sent', 'running')
             RETURNING c.id, c.node_id",
            &[&nodes, &ids, &states, &reasons, &values],
        )
        .await?;
    let ended: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    commands::settled(tx, &ended).await?;
    Ok(rows.iter().map(|r| r.get(1)).collect())
}

/// Each node's spec status, and the generation it has applied, which only moves up: one statement.
/// Each watch's job is woken for the nodes of its pool kind whose report of its section changed, or
/// that applied a newer generation ([`StatusWatch`]); a node whose VMs read differently forgets the
/// consoles of VMs it no longer reports.
async fn spec_statuses(tx: &impl GenericClient, specs: &BTreeMap<&str, &SpecStatus>, watches: &[StatusWatch]) -> Result<(), DbError> {
    if specs.is_empty() {
        return Ok(());
    }
    let nodes: Vec<&str> = specs.keys().copied().collect();
    let json = specs.values().map(serde_json::to_value).collect::<Result<Vec<_>, _>>().map_err(|e| Error::internal(e.to_string()))?;
    let observed: Vec<i64> = specs.values().map(|s| s.observed_generation).collect();
    let sections: Vec<&str> = watches.iter().map(|w| w.section).collect();
    let pool_kinds: Vec<&str> = watches.iter().map(|w| w.pool_kind).collect();
    let rows = tx
        .query(
            "WITH old AS (SELECT id, spec_status, observed_generation FROM nodes WHERE id = ANY($1))
             UPDATE nodes n SET spec_status = u.status, observed_generation = GREATEST(n.observed_generation, u.observed),
                    version = n.version + CASE WHEN n.observed_generation < u.observed THEN 1 ELSE 0 END
               FROM unnest($1::text[], $2::jsonb[], $3::int8[]) AS u(id, status, observed), old
              WHERE n.id = u.id AND old.id = u.id
             RETURNING n.id, old.spec_status->'instances' IS DISTINCT FROM u.status->'instances',
                       ARRAY(SELECT (old.spec_status->w.section IS DISTINCT FROM u.status->w.section
                                     OR coalesce(old.observed_generation, -1) < u.observed)
                                    AND EXISTS (SELECT 1 FROM pools p WHERE p.id = n.pool_id AND p.kind = w.pool_kind)
                               FROM unnest($4::text[], $5::text[]) WITH ORDINALITY AS w(section, pool_kind, i) ORDER BY w.i)",
            &[&nodes, &json, &observed, &sections, &pool_kinds],
        )
        .await?;
    let vms_changed: Vec<&str> = rows.iter().filter(|r| r.get::<_, bool>(1)).map(|r| r.get(0)).collect();
    if !vms_changed.is_empty() {
        crate::sessions::consoles::forget_unreported(tx, &vms_changed).await?;
    }
    for (i, watch) in watches.iter().enumerate() {
        let woken: Vec<String> = rows.iter().filter(|r| r.get::<_, Vec<bool>>(2)[i]).map(|r| r.get(0)).collect();
        if !woken.is_empty() {
            better_compute_runtime::work_queue::enqueue_many(tx, &watch.kind, &woken).await?;
        }
    }
    Ok(())
}
