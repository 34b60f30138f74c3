//! The placer: chooses a node and atoms for a demand and books them, or says why it cannot.
//!
//! Candidates come from `node_atom_counts` by index (idle atoms of the class, fewest first, so
//! reservations pack onto busy nodes and leave whole nodes free), never from a scan of the pool.
//! Each attempt runs under a savepoint: it locks the node row and the chosen atoms (and their
//! GPUs) `FOR SHARE` with the eligibility rules in the `WHERE`, inserts the bookings with
//! `ON CONFLICT DO NOTHING`, and takes the scalars with a guarded update. A node, atom or counter
//! conflict rolls back to the savepoint and replans without that node, at most three times.

use better_compute_db::DbError;
use serde_json::Value;
use tokio_postgres::Transaction;

/// Replans after the first attempt.
pub const MAX_REPLANS: usize = 3;
/// Candidates read per plan.
const CANDIDATES: i64 = 8;

/// What a reservation needs from one node.
#[derive(Debug, Clone)]
pub struct Demand {
    /// The pool.
    pub pool_id: String,
    /// `gpu`, `mig` or `slot`.
    pub kind: String,
    /// The GPU model.
    pub model: String,
    /// The MIG profile, or empty.
    pub profile: String,
    /// Atoms wanted.
    pub count: i32,
    /// vCPUs.
    pub vcpu: i32,
    /// Memory.
    pub memory_mib: i64,
    /// Disk.
    pub disk_gib: i64,
    /// Labels the node must have (a JSON object).
    pub node_selector: Value,
    /// Taints tolerated (a JSON array of `{key, value?}`).
    pub tolerations: Value,
}

/// The outcome of placing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Booked.
    Placed {
        /// The node.
        node_id: String,
        /// The atoms booked.
        atoms: Vec<String>,
    },
    /// Not now; the reservation waits as `pending`.
    Unschedulable {
        /// A stable reason: `NoCandidates` or `Conflicts`.
        reason: &'static str,
        /// What an operator or tenant can act on.
        message: String,
    },
}

/// The node eligibility rules, in SQL over `n`: converged at least once, nothing in
/// `noScheduleReasons` (cordoned, unreachable, lost, …), labels selected, every taint tolerated.
/// `$sel` and `$tol` are the parameter numbers of the selector and tolerations.
fn eligible(sel: usize, tol: usize) -> String {
    format!(
        "n.observed_generation >= 1 AND cardinality(n.no_schedule_reasons) = 0 AND n.labels @> ${sel}::jsonb
         AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(n.taints) t
                          WHERE NOT EXISTS (SELECT 1 FROM jsonb_array_elements(${tol}::jsonb) o
                                             WHERE o->>'key' = t->>'key'
                                               AND (o->>'value' IS NULL OR o->>'value' = t->>'value')))"
    )
}

fn pick(n: usize) -> usize {
    let mut b = [0u8; 2];
    let _ = getrandom::fill(&mut b);
    u16::from_le_bytes(b) as usize % n
}

/// A candidate node and its idle atoms of the class.
struct Candidate {
    node_id: String,
    idle: i32,
}

/// How many `node_atom_counts` rows one candidate read looks at, widening when too few of them
/// are eligible: the cost of a plan is bounded by the window, not by the pool's size.
const WINDOWS: [i64; 3] = [64, 1024, i64::MAX];

async fn candidates(tx: &Transaction<'_>, d: &Demand, excluded: &[String], best_fit: bool) -> Result<Vec<Candidate>, DbError> {
    // Best fit: nodes with enough atoms free now and later, fewest first, to pack. Otherwise: nodes
    // with enough atoms at all, most idle first (room under contention, and ranges in the future).
    let (filter, order) = if best_fit { ("idle >= $5", "idle, node_id") } else { ("total >= $5", "idle DESC, node_id DESC") };
    let selective = d.node_selector.as_object().is_some_and(|m| !m.is_empty());
    let sql = if selective {
        // A node selector: start from the nodes that carry the labels (GIN index), then their counts.
        format!(
            "SELECT c.node_id, c.idle FROM nodes n JOIN node_atom_counts c ON c.node_id = n.id
              WHERE n.pool_id = $1 AND c.kind = $2 AND c.model = $3 AND c.profile = $4 AND c.{filter}
                AND NOT (n.id = ANY($8)) AND {}
              ORDER BY c.{} LIMIT {CANDIDATES}",
            eligible(6, 7),
            order.replace(", node_id", ", c.node_id")
        )
    } else {
        // Otherwise walk the class's counts in order, a bounded window at a time.
        format!(
            "SELECT c.node_id, c.idle FROM (
                 SELECT node_id, idle FROM node_atom_counts
                  WHERE pool_id = $1 AND kind = $2 AND model = $3 AND profile = $4 AND {filter}
                  ORDER BY {order} LIMIT $9) c
               JOIN nodes n ON n.id = c.node_id
              WHERE NOT (c.node_id = ANY($8)) AND {}
              ORDER BY {} LIMIT {CANDIDATES}",
            eligible(6, 7),
            order.replace("idle", "c.idle").replace("node_id", "c.node_id")
        )
    };
    for window in WINDOWS {
        let base: [&(dyn tokio_postgres::types::ToSql + Sync); 8] =
            [&d.pool_id, &d.kind, &d.model, &d.profile, &d.count, &d.node_selector, &d.tolerations, &excluded];
        let rows = if selective {
            tx.query(&sql, &base).await?
        } else {
            let mut params = base.to_vec();
            params.push(&window);
            tx.query(&sql, &params).await?
        };
        if rows.len() as i64 == CANDIDATES || selective || window == i64::MAX {
            return Ok(rows.iter().map(|r| Candidate { node_id: r.get(0), idle: r.get(1) }).collect());
        }
        // Too few eligible in the window: are there more rows to look at?
        let more: i64 = tx
            .query_one(
                &format!("SELECT count(*) FROM (SELECT 1 FROM node_atom_counts WHERE pool_id = $1 AND kind = $2 AND model = $3
                            AND profile = $4 AND {filter} LIMIT $6) x"),
                &[&d.pool_id, &d.kind, &d.model, &d.profile, &d.count, &(window + 1)],
            )
            .await?
            .get(0);
        if more <= window {
            return Ok(rows.iter().map(|r| Candidate { node_id: r.get(0), idle: r.get(1) }).collect());
        }
    }
    unreachable!("the last window is unbounded")
}

enum Attempt {
    Placed(Vec<String>),
    /// The node changed under us (cordoned, tainted, …): skip it.
    NodeConflict,
    /// It has too few free atoms for the range.
    NoRoom,
    /// A concurrent placement took its atoms first.
    AtomConflict,
    /// Its vCPU, memory or disk did not fit.
    CounterConflict,
}

async fn attempt(sp: &Transaction<'_>, d: &Demand, node_id: &str, allocation_id: &str, during: &str) -> Result<Attempt, DbError> {
    // Lock order: nodes, devices, node_resources. Eligibility is rechecked under the row lock, so a
    // cordon that committed first is seen, and one that comes later waits for us.
    let lock_node = format!("SELECT 1 FROM nodes n WHERE n.id = $1 AND {} FOR SHARE", eligible(2, 3));
    if sp.query_opt(&lock_node, &[&node_id, &d.node_selector, &d.tolerations]).await?.is_none() {
        return Ok(Attempt::NodeConflict);
    }
    // For MIG instances and slots, first their GPUs, FOR SHARE and in id order (placements on sibling
    // atoms share them; a mode change locks a GPU and then its atoms, so we take them in that order
    // too), and only those still healthy and not quarantined under the lock.
    let parents: Vec<String> = if d.kind == "gpu" {
        Vec::new()
    } else {
        sp.query(
            "SELECT g.id FROM devices g
              WHERE g.node_id = $1 AND g.parent_id IS NULL AND g.model = $2 AND g.healthy AND NOT g.quarantined
                AND EXISTS (SELECT 1 FROM devices a WHERE a.parent_id = g.id AND a.bookable AND a.kind = $3)
              ORDER BY g.id FOR SHARE",
            &[&node_id, &d.model, &d.kind],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect()
    };
    // Then the atoms, FOR NO KEY UPDATE SKIP LOCKED: a stronger lock than FOR SHARE, so quarantine,
    // health and mode changes (updates of these rows) are ordered with us as with FOR SHARE, and
    // concurrent placements on the node skip each other's atoms instead of colliding on them.
    // Whole GPUs are taken in random order to spread placements; MIG instances and slots in order,
    // to fill one GPU before the next.
    let atoms: Vec<String> = sp
        .query(
            "SELECT a.id FROM devices a JOIN devices g ON g.id = coalesce(a.parent_id, a.id)
              WHERE a.node_id = $1 AND a.bookable AND a.kind = $2 AND a.model = $3 AND coalesce(a.profile, '') = $4
                AND g.healthy AND NOT g.quarantined AND (a.parent_id IS NULL OR a.parent_id = ANY($7))
                -- Rechecked on the locked row itself: when a concurrent update commits while we wait,
                -- PostgreSQL re-evaluates the conditions on the new version of the locked row (a), but
                -- not on the other side of the join (g), which for a whole GPU is the same row.
                AND (a.parent_id IS NOT NULL OR (a.healthy AND NOT a.quarantined))
                AND NOT EXISTS (SELECT 1 FROM device_bookings b WHERE b.device_id = a.id AND b.during && $6::text::tstzrange)
              ORDER BY CASE WHEN $2 = 'gpu' THEN random() ELSE 0 END, g.index, a.index
              LIMIT $5
                FOR NO KEY UPDATE OF a SKIP LOCKED",
            &[&node_id, &d.kind, &d.model, &d.profile, &(d.count as i64), &during, &parents],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if atoms.len() < d.count as usize {
        return Ok(Attempt::NoRoom);
    }
    // The exclusion constraint is the truth: a concurrent booking of the same atom makes this
    // insert wait for it and then skip the row, which shows as fewer rows than atoms.
    let booked = sp
        .execute(
            "INSERT INTO device_bookings (device_id, allocation_id, during)
             SELECT a, $2, $3::text::tstzrange FROM unnest($1::text[]) a
             -- in atom order, so two placements can never wait on each other's bookings in a cycle
             ORDER BY a
             ON CONFLICT DO NOTHING",
            &[&atoms, &allocation_id, &during],
        )
        .await?;
    if booked < atoms.len() as u64 {
        return Ok(Attempt::AtomConflict);
    }
    // Guarded scalars: only if they fit under floor(allocatable * ratio).
    let fits = sp
        .execute(
            "UPDATE node_resources
                SET vcpu_allocated = vcpu_allocated + $2, memory_mib_allocated = memory_mib_allocated + $3,
                    disk_gib_allocated = disk_gib_allocated + $4
              WHERE node_id = $1
                AND vcpu_allocated + $2 <= floor(vcpu_allocatable * vcpu_ratio)
                AND memory_mib_allocated + $3 <= floor(memory_mib_allocatable * memory_ratio)
                AND disk_gib_allocated + $4 <= floor(disk_gib_allocatable * disk_ratio)",
            &[&node_id, &d.vcpu, &d.memory_mib, &d.disk_gib],
        )
        .await?;
    if fits == 0 {
        return Ok(Attempt::CounterConflict);
    }
    // The atoms that had nothing else booked from now on are no longer idle. A hint: concurrent
    // bookings of one atom's different futures can both count it, so it is floored at 0, and a full
    // refresh (inventory changes) makes it exact again.
    sp.execute(
        "UPDATE node_atom_counts SET idle = GREATEST(0, idle - (
            SELECT count(*) FROM unnest($2::text[]) a
             WHERE NOT EXISTS (SELECT 1 FROM device_bookings b
                                WHERE b.device_id = a AND b.allocation_id <> $3 AND upper(b.during) > compute_now())))
          WHERE node_id = $1 AND kind = $4 AND model = $5 AND profile = $6",
        &[&node_id, &atoms, &allocation_id, &d.kind, &d.model, &d.profile],
    )
    .await?;
    Ok(Attempt::Placed(atoms))
}

/// Places `d` for `allocation_id` over `during` (a `tstzrange` literal) inside `tx`: at most one
/// first plan and [`MAX_REPLANS`] replans, each under its own savepoint.
pub async fn place(tx: &mut Transaction<'_>, d: &Demand, allocation_id: &str, during: &str) -> Result<Placement, DbError> {
    let mut excluded: Vec<String> = Vec::new();
    let mut tried: Vec<String> = Vec::new();
    let mut raced = false;
    for attempt_no in 0..=MAX_REPLANS {
        // The first plan packs: best fit. A replan means others are working the full nodes right
        // now, so it spreads: the last replans go to the emptiest nodes, where there is room.
        let packing = attempt_no < 2;
        let mut found = candidates(tx, d, &excluded, packing).await?;
        if found.is_empty() {
            found = candidates(tx, d, &excluded, !packing).await?;
        }
        if found.is_empty() {
            break;
        }
        // Among nodes nearly as good as the best (within the request's size), chance spreads
        // concurrent placements instead of queueing them all on one node's counters.
        let near = found.iter().take_while(|c| (c.idle - found[0].idle).abs() <= d.count.max(1)).count();
        let node_id = found[pick(if attempt_no == 1 { found.len() } else { near })].node_id.clone();
        let sp = tx.savepoint("placement").await?;
        match attempt(&sp, d, &node_id, allocation_id, during).await? {
            Attempt::Placed(atoms) => {
                sp.commit().await?;
                return Ok(Placement::Placed { node_id, atoms });
            }
            outcome => {
                sp.rollback().await?;
                raced |= matches!(outcome, Attempt::NodeConflict | Attempt::AtomConflict);
                tried.push(format!(
                    "{node_id}: {}",
                    match outcome {
                        Attempt::NodeConflict => "became ineligible",
                        Attempt::AtomConflict => "atoms taken by a concurrent placement",
                        Attempt::NoRoom => "atoms booked in that range",
                        _ => "not enough vCPU, memory or disk",
                    }
                ));
                excluded.push(node_id);
            }
        }
    }
    let what = format!(
        "{} {}{} atom{} of {}",
        d.count,
        d.kind,
        if d.profile.is_empty() { String::new() } else { format!(" {}", d.profile) },
        if d.count == 1 { "" } else { "s" },
        d.model
    );
    let tried = if tried.is_empty() { String::new() } else { format!(" (tried {})", tried.join("; ")) };
    Ok(if raced {
        Placement::Unschedulable {
            reason: "Conflicts",
            message: format!("concurrent placements took the nodes that fit {what}{tried}; retrying every 30 s"),
        }
    } else {
        Placement::Unschedulable {
            reason: "NoCandidates",
            message: format!("no eligible node in the pool has {what} and the vCPU, memory and disk free for the range{tried}; retrying every 30 s"),
        }
    })
}
