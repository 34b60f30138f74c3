//! The capacity torture test: 1,000 concurrent operations over many connections on a fleet of 50
//! nodes with 8 GPUs each (some MIG, some time-sliced) — reserve, extend, release, cordon, taint,
//! health flips, quarantine, mode changes, nodes going unreachable, lost and back, clock jumps —
//! while the capacity jobs run; then every
//! invariant is checked against the database. Seeded: the operations of a seed are the same every
//! run (their interleaving is the machine's). CI runs a few seeds; for many:
//! `TORTURE_SEEDS=1-50 cargo nextest run -p better-compute-capacity --run-ignored only torture_seeds_from_env`
//! (add `TORTURE_PGBOUNCER=1` to send the operations through PgBouncer).
//! Two mutation tests break a guard (the exclusion constraint, the placer's `FOR SHARE`) and show
//! the checks catch it.


use better_compute_audit::Actor;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use better_compute_core::seeded::Rng;
use better_compute_capacity::batch::{BatchPlacer, BatchSettings};
use better_compute_capacity::reservations;
use better_compute_capacity::{invariants, mode, quota, Caller};
use better_compute_core::time::{parse_rfc3339, rfc3339};
use better_compute_core::ErrorCode;
use better_compute_nodes::actions;
use better_compute_core::gpu_mode::GpuMode;
use better_compute_runtime::harness::Harness;
use better_compute_testing::*;

/// Who makes the changes these tests make.
static TEST_ACTOR: Actor = Actor::job("test");

const NODES: usize = 50;
const GPUS: usize = 8;
const CONNECTIONS: usize = 16;
const TENANTS: [&str; 3] = ["ten_a", "ten_b", "ten_c"];
/// Seeds a mutation test may run before the checks must have caught the mutation.
const MUTATION_SEEDS: u64 = 6;


fn node_mode(i: usize) -> GpuMode {
    match i {
        i if i >= NODES - 5 => GpuMode::TimeSlice { slots: 4 },
        i if i >= NODES - 10 => GpuMode::Mig { layout: vec!["3g.40gb".into(), "3g.40gb".into()] },
        _ => GpuMode::Exclusive,
    }
}

#[derive(Default)]
struct Tally {
    ok: AtomicUsize,
    refused: Mutex<BTreeMap<String, usize>>,
}

#[allow(clippy::too_many_lines, reason = "a test's operation table: one arm per kind of operation, each short")]
async fn one_op(
    h: &Harness,
    c: &mut tokio_postgres::Client,
    placer: &BatchPlacer,
    f: &Fleet,
    rng: &mut Rng,
    live: &Mutex<Vec<(usize, String)>>,
) -> Result<&'static str, better_compute_core::Error> {
    let pick_node = |rng: &mut Rng| rng.below(NODES as u64) as usize;
    let roll = rng.below(100);
    match roll {
        0..=39 => {
            let t = rng.below(TENANTS.len() as u64) as usize;
            let caller = Caller { tenant_id: TENANTS[t], identity_id: "idn_torture" };
            let (kind, profile, count) = match rng.below(10) {
                0..=6 => ("gpu", None, 1 + rng.below(4) as i32),
                7 | 8 => ("mig", Some("3g.40gb".to_owned()), 1 + rng.below(2) as i32),
                _ => ("slot", None, 1 + rng.below(3) as i32),
            };
            // Half start now, which the batch placer takes (whole GPUs), half within two hours.
            let start_min = if rng.below(2) == 0 { 0 } else { rng.below(120) };
            let (vcpu, memory_mib, disk_gib) = (1 + rng.below(24) as i32, 1024 * (1 + rng.below(128) as i64), rng.below(500) as i64);
            let mut req = reservation(&f.pool_id, atoms(kind, profile, count), vcpu, memory_mib, disk_gib, 600 + rng.below(4 * 3600) as i64);
            if start_min > 0 {
                let now = h.db().now().await;
                let start = now + Duration::from_secs(start_min * 60);
                req.starts_at = Some(rfc3339(start));
            }
            let r = if rng.below(2) == 0 {
                reservations::create_batched(placer, c, &TEST_ACTOR, caller, &req).await?
            } else {
                reservations::create(c, &TEST_ACTOR, caller, &req).await?
            };
            live.lock().unwrap().push((t, r.id));
            Ok("reserve")
        }
        40..=49 => {
            let Some((t, id)) = pick_live(live, rng) else { return Ok("noop") };
            let caller = Caller { tenant_id: TENANTS[t], identity_id: "idn_torture" };
            // In a transaction, as every statement: behind PgBouncer an autocommit statement's
            // Parse and Bind may reach different server connections.
            let tx = c.transaction().await.map_err(db)?;
            let cur = reservations::get(&tx, caller, &id).await?;
            tx.commit().await.map_err(db)?;
            let end = parse_rfc3339(&cur.ends_at).expect("the API writes RFC 3339") + Duration::from_secs(600 + rng.below(7200));
            reservations::extend(c, &TEST_ACTOR, caller, &id, &rfc3339(end), None).await?;
            Ok("extend")
        }
        50..=64 => {
            let Some((t, id)) = pick_live(live, rng) else { return Ok("noop") };
            let caller = Caller { tenant_id: TENANTS[t], identity_id: "idn_torture" };
            if rng.below(2) == 0 {
                reservations::release_batched(placer, c, &TEST_ACTOR, caller, &id).await?;
            } else {
                reservations::release(c, &TEST_ACTOR, caller, &id).await?;
            }
            Ok("release")
        }
        65..=72 => {
            let n = &f.nodes[pick_node(rng)];
            let tx = c.transaction().await.map_err(db)?;
            if rng.below(2) == 0 { actions::cordon(&tx, n).await } else { actions::uncordon(&tx, n).await }.map_err(Into::<better_compute_core::Error>::into)?;
            tx.commit().await.map_err(db)?;
            Ok("cordon")
        }
        73..=79 => {
            let n = &f.nodes[pick_node(rng)];
            let tx = c.transaction().await.map_err(db)?;
            if rng.below(2) == 0 { actions::taint(&tx, n, "maint", "yes").await } else { actions::untaint(&tx, n, "maint").await }
                .map_err(Into::<better_compute_core::Error>::into)?;
            tx.commit().await.map_err(db)?;
            Ok("taint")
        }
        80..=87 => {
            let n = pick_node(rng);
            let g = &f.gpus[n][rng.below(GPUS as u64) as usize];
            let tx = c.transaction().await.map_err(db)?;
            actions::set_gpu_health(&tx, g, rng.below(3) != 0).await.map_err(Into::<better_compute_core::Error>::into)?;
            tx.commit().await.map_err(db)?;
            Ok("health")
        }
        88..=93 => {
            let n = pick_node(rng);
            let g = &f.gpus[n][rng.below(GPUS as u64) as usize];
            let tx = c.transaction().await.map_err(db)?;
            if rng.below(2) == 0 { actions::quarantine(&tx, g, "torture").await } else { actions::release_quarantine(&tx, g).await }
                .map_err(Into::<better_compute_core::Error>::into)?;
            tx.commit().await.map_err(db)?;
            Ok("quarantine")
        }
        94..=97 => {
            let n = pick_node(rng);
            let g = &f.gpus[n][rng.below(GPUS as u64) as usize];
            let m = match rng.below(3) {
                0 => GpuMode::Exclusive,
                1 => GpuMode::Mig { layout: vec!["3g.40gb".into(), "3g.40gb".into()] },
                _ => GpuMode::TimeSlice { slots: 4 },
            };
            mode::change_gpu_mode(c, &TEST_ACTOR, g, &m).await?;
            Ok("mode")
        }
        98 => {
            // The liveness job's transitions: a node goes unreachable (it leaves placement, keeps
            // its bookings), is lost, or comes back.
            let n = &f.nodes[pick_node(rng)];
            let to = ["unreachable", "lost", "connected"][rng.below(3) as usize];
            let tx = c.transaction().await.map_err(db)?;
            actions::set_liveness(&tx, n, to).await.map_err(Into::<better_compute_core::Error>::into)?;
            tx.commit().await.map_err(db)?;
            Ok("liveness")
        }
        _ => {
            h.db().advance(Duration::from_secs(60 * (1 + rng.below(10)))).await;
            Ok("clock")
        }
    }
}

fn db(e: tokio_postgres::Error) -> better_compute_core::Error {
    better_compute_db::DbError::from(e).into()
}

fn pick_live(live: &Mutex<Vec<(usize, String)>>, rng: &mut Rng) -> Option<(usize, String)> {
    let l = live.lock().unwrap();
    (!l.is_empty()).then(|| l[rng.below(l.len() as u64) as usize].clone())
}

/// Where the operations' connections go.
#[derive(Clone, Copy, PartialEq)]
enum Route {
    Direct,
    /// Through PgBouncer in transaction pooling mode, with fewer server connections than clients.
    PgBouncer,
}

/// What the checks found after a run: operations that failed unexpectedly, and broken invariants.
struct Outcome {
    failures: Vec<String>,
    violations: Vec<String>,
}

async fn torture(seed: u64, ops: usize, route: Route) {
    let out = torture_run(seed, ops, route, None).await;
    assert!(out.failures.is_empty(), "seed {seed}: operations failed unexpectedly:\n{}", out.failures.join("\n"));
    assert!(out.violations.is_empty(), "seed {seed}: invariants broken:\n{}", out.violations.join("\n"));
}

/// A deliberate break of the database's guards, to show the torture test catches it.
#[derive(Clone, Copy, Debug)]
enum Mutation {
    /// `device_bookings`' exclusion constraint dropped: only the placer's locks stand between two
    /// overlapping bookings of an atom.
    NoExclusionConstraint,
    /// Every `FOR SHARE` taken out of the placement functions (the node, the GPUs of MIG instances
    /// and slots, the pool): a concurrent cordon, quarantine, mode change or whole-GPU booking no
    /// longer waits for a placement that read the old state.
    NoForShare,
}

async fn mutate(h: &Harness, m: Mutation) {
    let c = h.db().client().await;
    match m {
        Mutation::NoExclusionConstraint => {
            let names: Vec<String> = c
                .query("SELECT conname FROM pg_constraint WHERE conrelid = 'device_bookings'::regclass AND contype = 'x'", &[])
                .await
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            assert_eq!(names.len(), 1, "device_bookings should have one exclusion constraint: {names:?}");
            c.batch_execute(&format!("ALTER TABLE device_bookings DROP CONSTRAINT {}", names[0])).await.unwrap();
        }
        Mutation::NoForShare => {
            let defs: Vec<String> = c
                .query(
                    "SELECT regexp_replace(pg_get_functiondef(oid), 'FOR SHARE( OF \\w+)?', '', 'g') FROM pg_proc
                      WHERE proname IN ('capacity_place', 'capacity_reserve', 'capacity_reserve_batch') AND prosrc LIKE '%FOR SHARE%'",
                    &[],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            assert!(defs.len() >= 2, "the placement functions should take FOR SHARE locks: {} found", defs.len());
            for d in defs {
                c.batch_execute(&d).await.unwrap();
            }
        }
    }
}

async fn torture_run(seed: u64, ops: usize, route: Route, mutation: Option<Mutation>) -> Outcome {
    let h = harness().await;
    let modes: Vec<GpuMode> = (0..NODES).map(node_mode).collect();
    let f = fleet(&h, &modes, GPUS).await;
    if let Some(m) = mutation {
        mutate(&h, m).await;
    }
    {
        let c = h.db().client().await;
        for t in TENANTS {
            for (r, max) in [("gpus", 120), ("mig_instances", 40), ("gpu_slots", 40), ("vcpu", 2_000), ("memory_mib", 4_000_000), ("disk_gib", 40_000)] {
                quota::set(&**c, t, r, max).await.unwrap();
            }
        }
    }
    let next = Arc::new(AtomicUsize::new(0));
    let live = Arc::new(Mutex::new(Vec::new()));
    let tally = Arc::new(Tally::default());
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let done = Arc::new(AtomicBool::new(false));
    let h = Arc::new(h);
    let f = Arc::new(f);
    // Half the creates and releases go through the batch placer: two batchers on two shares of the
    // nodes, with their own connections (through PgBouncer too on that route).
    let batch_pool = match route {
        Route::Direct => better_compute_db::pool::connect_pool(h.db().connection_string(), 4).unwrap(),
        Route::PgBouncer => better_compute_db::pool::connect_pool(&h.db().pgbouncer_connection_string().await, 4).unwrap(),
    };
    let placer = BatchPlacer::start(batch_pool, BatchSettings { batchers: 2, max_batch: 16, queue_len: 64, retries: 1 });
    let mut tasks = Vec::new();
    for _ in 0..CONNECTIONS {
        let (h, f, next, live, tally, failures) = (h.clone(), f.clone(), next.clone(), live.clone(), tally.clone(), failures.clone());
        let placer = placer.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = match route {
                Route::Direct => h.db().connect().await,
                Route::PgBouncer => h.db().connect_through_pgbouncer().await,
            };
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= ops {
                    break;
                }
                let mut rng = Rng(seed.wrapping_mul(1_000_003).wrapping_add(i as u64));
                match one_op(&h, &mut c, &placer, &f, &mut rng, &live).await {
                    Ok(_) => {
                        tally.ok.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(e) if matches!(e.code, ErrorCode::Internal | ErrorCode::Unavailable) || e.message.contains("interfered") => {
                        failures.lock().unwrap().push(format!("op {i}: {}: {}", e.code, e.message));
                    }
                    Err(e) => {
                        *tally.refused.lock().unwrap().entry(e.code.to_string()).or_default() += 1;
                    }
                }
            }
        }));
    }
    // The capacity jobs run alongside: retries, starts, ends, counts, rollups.
    let jobs = {
        let (h, done) = (h.clone(), done.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::SeqCst) {
                for job in ["event-subscribers", "capacity.reservations", "capacity.rollup"] {
                    h.job(job).tick().await;
                }
            }
        })
    };
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(600), t).await.expect("torture ops hung").unwrap();
    }
    done.store(true, Ordering::SeqCst);
    jobs.await.unwrap();
    settle_outbox(&h).await;
    for job in ["event-subscribers", "capacity.reservations", "capacity.rollup"] {
        h.job(job).drain(100).await;
    }
    let failures = failures.lock().unwrap().clone();
    let refused = tally.refused.lock().unwrap().clone();
    let batched = placer.counters().done.load(Ordering::SeqCst);
    eprintln!("seed {seed}: {} ok, refused {refused:?}, {batched} done in batches", tally.ok.load(Ordering::SeqCst));
    assert!(batched > 20, "seed {seed}: only {batched} requests done in batches; the test did not exercise the batch placer");
    Outcome { failures, violations: check_invariants(&h, seed, &f).await }
}

async fn check_invariants(h: &Harness, seed: u64, f: &Fleet) -> Vec<String> {
    let initial: HashMap<String, GpuMode> =
        f.gpus.iter().enumerate().flat_map(|(i, gs)| gs.iter().map(move |g| (g.clone(), node_mode(i)))).collect();
    let report = invariants::check(&**h.db().client().await, &initial).await.unwrap();
    assert!(report.placements_checked > 50, "seed {seed}: only {} placements; the test did not exercise the placer", report.placements_checked);
    // The counts' open flags, kept by a trigger and put right by the rollup, agree with their
    // nodes once the jobs have run after the last change.
    let stale = invariants::stale_open_flags(&**h.db().client().await).await.unwrap();
    let mut violations = report.violations;
    violations.extend(stale.into_iter().map(|s| format!("open flag disagrees with its node: {s:?}")));
    violations
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_torture_seed_1() {
    torture(1, 1000, Route::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_torture_seed_2() {
    torture(2, 1000, Route::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_torture_seed_3() {
    torture(3, 1000, Route::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_torture_passes_behind_pgbouncer_in_transaction_mode() {
    torture(4, 1000, Route::PgBouncer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs the seeds in TORTURE_SEEDS (like 1-50)"]
async fn torture_seeds_from_env() {
    let spec = std::env::var("TORTURE_SEEDS").expect("set TORTURE_SEEDS, like 1-50");
    let (a, b) = spec.split_once('-').unwrap_or((&spec, &spec));
    for seed in a.parse::<u64>().unwrap()..=b.parse::<u64>().unwrap() {
        torture(seed, 1000, if std::env::var_os("TORTURE_PGBOUNCER").is_some() { Route::PgBouncer } else { Route::Direct }).await;
    }
}

/// Runs seeds with `m` applied until the checks catch it (at most `seeds`), and answers what they
/// caught.
async fn caught(m: Mutation, seeds: std::ops::RangeInclusive<u64>) -> Vec<String> {
    for seed in seeds {
        let out = torture_run(seed, 1000, Route::Direct, Some(m)).await;
        if !out.violations.is_empty() {
            eprintln!("{m:?}: seed {seed} caught: {}", out.violations[0]);
            return out.violations;
        }
    }
    Vec::new()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_torture_test_catches_the_exclusion_constraint_removed() {
    let v = caught(Mutation::NoExclusionConstraint, 1..=MUTATION_SEEDS).await;
    assert!(v.iter().any(|v| v.contains("overlap")), "no seed caught the missing exclusion constraint: {v:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_torture_test_catches_the_placers_for_share_removed() {
    let v = caught(Mutation::NoForShare, 1..=MUTATION_SEEDS).await;
    assert!(!v.is_empty(), "no seed caught the placer without FOR SHARE");
}
