//! The capacity invariants, checked against the database after the fact: the torture test and
//! `better-compute sim` both end with [`check`]. Each check is a query that lists the rows breaking
//! one rule, so a violation names what broke.

use std::collections::{HashMap, HashSet};
use std::time::SystemTime;

use better_compute_db::DbError;
use better_compute_core::gpu_mode::GpuMode;
use tokio_postgres::GenericClient;

/// What [`check`] found.
#[derive(Debug, Default, Clone)]
pub struct Report {
    /// One line per violation, naming the rule and the rows.
    pub violations: Vec<String>,
    /// Placements replayed against the eligibility of their moment.
    pub placements_checked: usize,
}

async fn rows_of(db: &impl GenericClient, sql: &str) -> Result<Vec<String>, DbError> {
    Ok(db.query(sql, &[]).await?.iter().map(|r| r.get::<_, String>(0)).collect())
}

/// The rules checked by one query each: a name, and a query listing the rows that break it.
const RULES: [(&str, &str); 9] = [
    (
        "two overlapping bookings on one atom",
        "SELECT a.device_id || ' ' || a.allocation_id || ' ' || b.allocation_id FROM device_bookings a
           JOIN device_bookings b ON a.device_id = b.device_id AND a.ctid < b.ctid AND a.during && b.during",
    ),
    (
        // What a tenant held stays its own: no later booking reaches back into it. Mode-change
        // windows are the GPU's, not a tenant's (the next rule leaves them out too).
        "a booking overlapping another reservation's ended booking on one atom",
        "WITH b AS (SELECT device_id, allocation_id, during FROM device_bookings
                    UNION ALL SELECT device_id, allocation_id, during FROM device_booking_history)
         SELECT h.device_id || ' ' || h.allocation_id || ' ' || b.allocation_id FROM device_booking_history h
           JOIN b ON b.device_id = h.device_id AND b.allocation_id <> h.allocation_id AND b.during && h.during
          WHERE h.allocation_id NOT LIKE 'change:%' AND b.allocation_id NOT LIKE 'change:%'",
    ),
    (
        // The history too: a GPU's mode changes only once nothing on it is booked from now on.
        "a parent and a child atom booked at once",
        "WITH b AS (SELECT device_id, allocation_id, during FROM device_bookings
                    UNION ALL SELECT device_id, allocation_id, during FROM device_booking_history)
         SELECT p.device_id || ' ' || c.device_id FROM b p
           JOIN devices d ON d.parent_id = p.device_id
           JOIN b c ON c.device_id = d.id AND c.during && p.during
          WHERE p.allocation_id NOT LIKE 'change:%' AND c.allocation_id NOT LIKE 'change:%'",
    ),
    (
        "an ended reservation still booked",
        "SELECT r.id || ' ' || r.state || ' ' || b.device_id FROM device_bookings b
           JOIN reservations r ON r.id = b.allocation_id WHERE r.state IN ('released', 'expired', 'failed')",
    ),
    (
        "scalars differ from the sum of live reservations, or exceed floor(allocatable * ratio)",
        "SELECT nr.node_id || ' ' || nr.vcpu_allocated || ' vs ' || coalesce(sum(r.vcpu), 0) FROM node_resources nr
           LEFT JOIN reservations r ON r.node_id = nr.node_id AND r.state IN ('placed', 'active')
          GROUP BY nr.node_id, nr.vcpu_allocated, nr.memory_mib_allocated, nr.disk_gib_allocated,
                   nr.vcpu_allocatable, nr.vcpu_ratio, nr.memory_mib_allocatable, nr.memory_ratio,
                   nr.disk_gib_allocatable, nr.disk_ratio
         HAVING nr.vcpu_allocated <> coalesce(sum(r.vcpu), 0)
             OR nr.memory_mib_allocated <> coalesce(sum(r.memory_mib), 0)
             OR nr.disk_gib_allocated <> coalesce(sum(r.disk_gib), 0)
             OR nr.vcpu_allocated > floor(nr.vcpu_allocatable * nr.vcpu_ratio)
             OR nr.memory_mib_allocated > floor(nr.memory_mib_allocatable * nr.memory_ratio)
             OR nr.disk_gib_allocated > floor(nr.disk_gib_allocatable * nr.disk_ratio)",
    ),
    (
        "allocatable is not the node's usable resources, held up only as far as its reservations need",
        "SELECT node_id || ' vcpu ' || vcpu_allocatable || '/' || vcpu_usable || ', memory ' || memory_mib_allocatable || '/' || memory_mib_usable
                || ', disk ' || disk_gib_allocatable || '/' || disk_gib_usable FROM node_resources
          WHERE vcpu_allocatable <> greatest(vcpu_usable, capacity_allocatable_floor(vcpu_allocated, vcpu_ratio))
             OR memory_mib_allocatable <> greatest(memory_mib_usable, capacity_allocatable_floor(memory_mib_allocated, memory_ratio))
             OR disk_gib_allocatable <> greatest(disk_gib_usable, capacity_allocatable_floor(disk_gib_allocated, disk_ratio))",
    ),
    (
        "quota used differs from the charges of non-terminal reservations, or exceeds max",
        "WITH live AS (SELECT * FROM reservations WHERE state IN ('pending', 'placed', 'active')),
              charges AS (
            SELECT tenant_id, CASE gpu_kind WHEN 'gpu' THEN 'gpus' WHEN 'mig' THEN 'mig_instances' ELSE 'gpu_slots' END AS resource,
                   gpu_count::bigint AS n FROM live
            UNION ALL SELECT tenant_id, 'vcpu', vcpu FROM live
            UNION ALL SELECT tenant_id, 'memory_mib', memory_mib FROM live
            UNION ALL SELECT tenant_id, 'disk_gib', disk_gib FROM live)
         SELECT q.tenant_id || ' ' || q.resource || ' ' || q.used || ' vs ' || coalesce(sum(c.n), 0)
           FROM quota_usage q LEFT JOIN charges c ON c.tenant_id = q.tenant_id AND c.resource = q.resource
          GROUP BY q.tenant_id, q.resource, q.used, q.max
         HAVING q.used <> coalesce(sum(c.n), 0) OR q.used > q.max",
    ),
    (
        "a live reservation neither fully booked nor pending with Unschedulable",
        "SELECT r.id || ' ' || r.state FROM reservations r
          WHERE (r.state = 'pending' AND (r.unschedulable IS NULL OR EXISTS (SELECT 1 FROM device_bookings b WHERE b.allocation_id = r.id)))
             OR (r.state IN ('placed', 'active') AND (
                  (SELECT count(DISTINCT device_id) FROM device_bookings b WHERE b.allocation_id = r.id) <> r.gpu_count
                  OR EXISTS (SELECT 1 FROM (SELECT device_id, range_agg(during) AS covered FROM device_bookings b
                                             WHERE b.allocation_id = r.id GROUP BY device_id) x
                              WHERE x.covered <> tstzmultirange(r.during))))",
    ),
    (
        // Once an ended reservation is metered to its end (unchanged since, and its last window
        // closed), its usage windows and adjustments sum exactly to its booked atom-seconds, and to
        // its vCPU, MiB of memory and GiB of disk times the time it held them: the union of its
        // bookings, or, with no GPUs, from its start to its end or the instant it ended.
        "an ended, metered reservation whose usage windows do not sum to its booked atom-, vCPU-, memory- or disk-seconds",
        "WITH ended AS (
           SELECT r.* FROM reservations r
            WHERE r.state IN ('released', 'expired', 'failed') AND r.usage_version = r.version
              AND r.usage_closed_until >= least(upper(r.during), r.updated_at)),
         spans AS (
           SELECT allocation_id, during FROM device_bookings WHERE allocation_id IN (SELECT id FROM ended)
           UNION ALL SELECT allocation_id, during FROM device_booking_history WHERE allocation_id IN (SELECT id FROM ended)),
         booked AS (
           SELECT e.id, e.vcpu, e.memory_mib, e.disk_gib,
                  coalesce((SELECT sum(extract(epoch FROM upper(s.during) - lower(s.during))) FROM spans s WHERE s.allocation_id = e.id), 0) AS atom_s,
                  CASE WHEN e.gpu_count > 0
                       THEN coalesce((SELECT sum(extract(epoch FROM upper(x) - lower(x)))
                                        FROM unnest((SELECT range_agg(s.during) FROM spans s WHERE s.allocation_id = e.id)) x), 0)
                       WHEN e.node_id IS NULL THEN 0
                       ELSE greatest(0, extract(epoch FROM least(upper(e.during), e.updated_at) - lower(e.during))) END AS held_s
             FROM ended e),
         metered AS (
           SELECT b.*, coalesce(sum(w.atom_seconds), 0) AS w_atom, coalesce(sum(w.vcpu_seconds), 0) AS w_vcpu,
                  coalesce(sum(w.memory_mib_seconds), 0) AS w_memory, coalesce(sum(w.disk_gib_seconds), 0) AS w_disk
             FROM booked b LEFT JOIN usage_windows w ON w.allocation_id = b.id
            GROUP BY b.id, b.vcpu, b.memory_mib, b.disk_gib, b.atom_s, b.held_s)
         SELECT m.id || ' atom-s ' || m.w_atom || '/' || m.atom_s || ', vcpu-s ' || m.w_vcpu || '/' || m.vcpu * m.held_s
                || ', memory-s ' || m.w_memory || '/' || m.memory_mib * m.held_s || ', disk-s ' || m.w_disk || '/' || m.disk_gib * m.held_s
           FROM metered m
          WHERE m.w_atom <> m.atom_s OR m.w_vcpu <> m.vcpu * m.held_s OR m.w_memory <> m.memory_mib * m.held_s
             OR m.w_disk <> m.disk_gib * m.held_s",
    ),
];

/// The atom-count rows whose open flag (src/sql/counts.sql) disagrees with their node, as
/// "node kind open". Not one of the invariants: the flag is a hint that a refresh racing a change
/// of its node may leave stale until `capacity.rollup` runs, so this holds once the jobs have run
/// after the last change, not at every moment.
pub async fn stale_open_flags(db: &impl GenericClient) -> Result<Vec<String>, DbError> {
    rows_of(
        db,
        "SELECT c.node_id || ' ' || c.kind || ' ' || c.open FROM node_atom_counts c JOIN nodes n ON n.id = c.node_id
          WHERE c.open IS DISTINCT FROM capacity_node_open(n.observed_generation, n.no_schedule_reasons, n.taints)",
    )
    .await
}

/// Checks every capacity invariant: no two overlapping bookings on an atom, live or ended (a
/// reservation's ended bookings are its own: mode-change windows aside); never a parent and a
/// child atom booked at once (live or in the history); no ended reservation still booked; scalars
/// equal the sum of live reservations and stay within `floor(allocatable * ratio)`; quota used
/// equals the charges of non-terminal reservations and stays within max; every non-terminal
/// reservation fully booked or `pending` with `Unschedulable`; every ended reservation metered to
/// its end has usage windows summing to its booked atom-, vCPU-, memory- and disk-seconds; and, replaying the outbox in commit order (it needs `track_commit_timestamp`),
/// no booking placed on a node or GPU that was ineligible when it committed.
///
/// `initial_modes` are the GPUs' modes before any `device.mode_changed` event; a GPU missing from
/// it has its atoms checked only after its first mode change.
pub async fn check(db: &impl GenericClient, initial_modes: &HashMap<String, GpuMode>) -> Result<Report, DbError> {
    let mut report = Report::default();
    for (rule, sql) in RULES {
        for row in rows_of(db, sql).await? {
            report.violations.push(format!("{rule}: {row}"));
        }
    }
    // Events that change eligibility or place, in commit order.
    let events = db
        .query(
            "SELECT type, subject, data, pg_xact_commit_timestamp(xmin) FROM outbox
              WHERE type IN ('reservation.placed', 'node.cordoned', 'node.uncordoned', 'node.tainted', 'node.untainted',
                             'device.quarantined', 'device.released', 'device.unhealthy', 'device.suspect', 'device.healthy', 'device.mode_changed')
              ORDER BY 4, txid, seq",
            &[],
        )
        .await?;
    let mut cordoned: HashSet<String> = HashSet::new();
    let mut tainted: HashSet<String> = HashSet::new();
    let mut quarantined: HashSet<String> = HashSet::new();
    let mut unhealthy: HashSet<String> = HashSet::new();
    let mut modes = initial_modes.clone();
    let mut i = 0;
    while i < events.len() {
        // Events that committed at the same instant are not ordered among themselves: apply the
        // state changes of that instant only after checking its placements against the state before.
        let ts: Option<SystemTime> = events[i].get(3);
        let mut j = i;
        while j < events.len() && events[j].get::<_, Option<SystemTime>>(3) == ts {
            j += 1;
        }
        for e in &events[i..j] {
            if e.get::<_, String>(0) != "reservation.placed" {
                continue;
            }
            report.placements_checked += 1;
            let reservation: String = e.get(1);
            let data: serde_json::Value = e.get(2);
            let node = data["nodeId"].as_str().unwrap_or_default().to_owned();
            if cordoned.contains(&node) || tainted.contains(&node) {
                report.violations.push(format!("a placement on an ineligible node: {reservation} placed on {node} while it was cordoned or tainted"));
            }
            for atom in data["atoms"].as_array().into_iter().flatten().filter_map(|a| a.as_str()) {
                let gpu = atom.split('/').next().unwrap_or(atom).to_owned();
                if quarantined.contains(&gpu) || unhealthy.contains(&gpu) {
                    report.violations.push(format!("a booking on an ineligible GPU: {reservation} booked {atom} while its GPU was quarantined or unhealthy"));
                }
                let Some(m) = modes.get(&gpu) else { continue };
                let active = if atom == gpu { *m == GpuMode::Exclusive } else { m.child_atoms(&gpu, 0).iter().any(|c| c.id == atom) };
                if !active {
                    report.violations.push(format!("a booking of an atom its GPU does not have: {reservation} booked {atom} while the GPU's mode was {m:?}"));
                }
            }
        }
        for e in &events[i..j] {
            let (t, subject): (String, String) = (e.get(0), e.get(1));
            match t.as_str() {
                "node.cordoned" => cordoned.insert(subject),
                "node.uncordoned" => cordoned.remove(&subject),
                "node.tainted" => tainted.insert(subject),
                "node.untainted" => tainted.remove(&subject),
                "device.quarantined" => quarantined.insert(subject),
                "device.released" => quarantined.remove(&subject),
                // Suspect, recovering and unhealthy GPUs are all out of placement until healthy.
                "device.unhealthy" | "device.suspect" => unhealthy.insert(subject),
                "device.healthy" => unhealthy.remove(&subject),
                "device.mode_changed" => {
                    let data: serde_json::Value = e.get(2);
                    match serde_json::from_value(data["mode"].clone()) {
                        Ok(m) => modes.insert(subject, m).is_some(),
                        Err(_) => modes.remove(&subject).is_some(),
                    }
                }
                _ => false,
            };
        }
        i = j;
    }
    Ok(report)
}
