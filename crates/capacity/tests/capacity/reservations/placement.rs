//! Placement: eligibility, the count rows it reads and their repair, what fits and when, MIG and shared atoms, the rollup, desired state, lock order, and the plans its searches run on.

use super::*;

#[tokio::test]
async fn ineligible_nodes_and_gpus_are_skipped() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(4), 2).await;
    let mut c = h.db().connect().await;
    {
        let tx = c.transaction().await.unwrap();
        actions::cordon(&tx, &f.nodes[0]).await.unwrap();
        actions::taint(&tx, &f.nodes[1], "dedicated", "team-x").await.unwrap();
        actions::quarantine(&tx, &f.gpus[2][0], "xid 79").await.unwrap();
        actions::set_gpu_health(&tx, &f.gpus[2][1], false).await.unwrap();
        tx.commit().await.unwrap();
    }
    // Node 3 has not converged yet.
    c.execute("UPDATE nodes SET observed_generation = 0 WHERE id = $1", &[&f.nodes[3]]).await.unwrap();
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    assert_eq!(r.state, "pending", "{r:?}");
    assert_eq!(r.conditions[0]["type"], "Unschedulable");
    // Tolerating the taint opens node 1.
    let mut tolerant = whole(&f.pool_id, 2);
    tolerant.tolerations = vec![Toleration { key: "dedicated".into(), value: Some("team-x".into()) }];
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &tolerant).await.unwrap();
    assert_eq!(r.node_id.as_deref(), Some(f.nodes[1].as_str()));
    // A node selector that no node matches.
    let mut picky = whole(&f.pool_id, 1);
    picky.node_selector.insert("rack".into(), serde_json::json!("r9"));
    assert_eq!(reservations::create(&mut c, &TEST_ACTOR, ME, &picky).await.unwrap().state, "pending");
}

#[tokio::test]
async fn a_nodes_counts_close_in_the_transaction_that_makes_it_ineligible_and_reopen_with_it() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 2).await;
    let mut c = h.db().connect().await;
    let node = f.nodes[0].clone();
    assert!(counts_open(&h, &node).await);
    {
        let tx = c.transaction().await.unwrap();
        actions::cordon(&tx, &node).await.unwrap();
        // Closed before the cordon commits, in its transaction: nothing can see one without the other.
        let o: bool = tx.query_one("SELECT bool_or(open) FROM node_atom_counts WHERE node_id = $1", &[&node]).await.unwrap().get(0);
        assert!(!o);
        tx.commit().await.unwrap();
    }
    assert!(!counts_open(&h, &node).await);
    {
        let tx = c.transaction().await.unwrap();
        actions::uncordon(&tx, &node).await.unwrap();
        tx.commit().await.unwrap();
    }
    assert!(counts_open(&h, &node).await);
    {
        let tx = c.transaction().await.unwrap();
        actions::taint(&tx, &node, "dedicated", "team-x").await.unwrap();
        tx.commit().await.unwrap();
    }
    assert!(!counts_open(&h, &node).await);
    {
        let tx = c.transaction().await.unwrap();
        actions::untaint(&tx, &node, "dedicated").await.unwrap();
        tx.commit().await.unwrap();
    }
    assert!(counts_open(&h, &node).await);
    c.execute("UPDATE nodes SET observed_generation = 0 WHERE id = $1", &[&node]).await.unwrap();
    assert!(!counts_open(&h, &node).await);
    c.execute("UPDATE nodes SET observed_generation = 3 WHERE id = $1", &[&node]).await.unwrap();
    assert!(counts_open(&h, &node).await);
}

#[tokio::test]
async fn a_stale_open_flag_costs_a_replan_never_a_placement_and_the_rollup_puts_it_right() {
    // A flag left open on a cordoned node, as a refresh racing the cordon can leave it.
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 4).await;
    let mut c = h.db().connect().await;
    for node in &f.nodes {
        let tx = c.transaction().await.unwrap();
        actions::cordon(&tx, node).await.unwrap();
        tx.commit().await.unwrap();
    }
    c.execute("UPDATE node_atom_counts SET open = true, idle = 1 WHERE node_id = $1", &[&f.nodes[0]]).await.unwrap();
    // The only candidate: tried, and turned away by the recheck under the node's lock, which the
    // placer's replan counter shows (the recorder is this test process's own).
    better_compute_runtime::metrics::install(&[]);
    let before = replans("conflict");
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    assert_eq!(r.state, "pending", "{r:?}");
    let why = r.conditions[0]["message"].as_str().unwrap_or_default().to_owned();
    assert!(why.contains(&format!("{}: became ineligible", f.nodes[0])), "{why}");
    assert_eq!((replans("conflict") - before, replans("stale")), (1, 0));
    // With the other node open again, placements go there, best fit trying the stale node first.
    {
        let tx = c.transaction().await.unwrap();
        actions::uncordon(&tx, &f.nodes[1]).await.unwrap();
        tx.commit().await.unwrap();
    }
    for _ in 0..3 {
        let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
        assert_eq!(r.node_id.as_deref(), Some(f.nodes[1].as_str()), "{r:?}");
    }
    // The pool's rollup, as after any inventory change, closes it again.
    let pools = std::slice::from_ref(&f.pool_id);
    better_compute_runtime::work_queue::enqueue_many(&**h.db().client().await, &better_compute_capacity::ROLLUP_KIND, pools).await.unwrap();
    h.job("capacity.rollup").drain(5).await;
    let stale = better_compute_capacity::invariants::stale_open_flags(&**h.db().client().await).await.unwrap();
    assert!(stale.is_empty(), "{stale:?}");
    assert_eq!(count(&h, &format!("SELECT count(*) FROM node_atom_counts WHERE node_id = '{}' AND open", f.nodes[0])).await, 0);
}

#[tokio::test]
async fn a_stale_idle_count_costs_a_replan_that_the_replan_counter_shows() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 4).await;
    let mut c = h.db().connect().await;
    let full = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 4)).await.unwrap();
    let full_node = full.node_id.clone().unwrap();
    // The full node's count says one GPU is idle: best fit tries it first, and the atoms' own
    // bookings turn it away under the lock.
    c.execute("UPDATE node_atom_counts SET idle = 1 WHERE node_id = $1", &[&full_node]).await.unwrap();
    better_compute_runtime::metrics::install(&[]);
    let (conflict, stale) = (replans("conflict"), replans("stale"));
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    assert_eq!(r.state, "placed", "{r:?}");
    assert_ne!(r.node_id.as_deref(), Some(full_node.as_str()));
    assert_eq!((replans("conflict") - conflict, replans("stale") - stale), (0, 1));
}

#[tokio::test]
async fn what_fits_and_when_counts_one_nodes_free_atoms_and_finds_the_end_of_a_booking() {
    use better_compute_capacity::availability;
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 4).await;
    let mut c = h.db().connect().await;
    let gpu = |count| GpuRequest { kind: "gpu".into(), model: MODEL.into(), profile: None, count };
    // Node A full for an hour, node B with one GPU left for two.
    let a = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 4)).await.unwrap();
    let b = reservations::create(&mut c, &TEST_ACTOR, ME, &reservations::CreateReservation { duration_s: Some(7200), ..whole(&f.pool_id, 3) }).await.unwrap();
    assert_ne!(a.node_id, b.node_id);
    let two = availability::of(&c, &f.pool_id, &gpu(2), 1800).await.unwrap();
    assert_eq!((two.placeable_atoms, two.most_free_on_one_node_now, two.fits_now), (8, 1, false), "{two:?}");
    // The earliest start is A's end; a reservation made for then is placed.
    let at = |s: &str| better_compute_core::time::parse_rfc3339(s).unwrap();
    assert_eq!(two.earliest_start.as_deref().map(at), Some(at(&a.ends_at)), "{two:?} {a:?}");
    let later = reservations::create(&mut c, &TEST_ACTOR, ME, &whole_between(&f.pool_id, 2, &a.ends_at, &b.ends_at)).await.unwrap();
    assert_eq!((later.state.as_str(), later.node_id.as_deref()), ("placed", a.node_id.as_deref()), "{later:?}");
    // One fits now; more than a node has never does; a quarantined GPU is not placeable.
    let one = availability::of(&c, &f.pool_id, &gpu(1), 1800).await.unwrap();
    assert_eq!((one.fits_now, one.earliest_start.is_some()), (true, true), "{one:?}");
    let five = availability::of(&c, &f.pool_id, &gpu(5), 1800).await.unwrap();
    assert_eq!((five.fits_now, five.earliest_start), (false, None));
    c.execute("UPDATE devices SET quarantined = true, quarantine_reason = 'test' WHERE id = $1", &[&f.gpus[0][0]]).await.unwrap();
    assert_eq!(availability::of(&c, &f.pool_id, &gpu(1), 1800).await.unwrap().placeable_atoms, 7);
    // Bad input changes nothing and says what is wrong.
    let e = better_compute_core::Error::from(availability::of(&c, &f.pool_id, &gpu(1), 0).await.unwrap_err());
    assert_eq!(e.code, ErrorCode::InvalidArgument);
    let e = better_compute_core::Error::from(availability::of(&c, "pool_nope", &gpu(1), 60).await.unwrap_err());
    assert_eq!(e.code, ErrorCode::NotFound);
    // The class is checked as a create checks it: a kind, a profile only for MIG.
    for (kind, profile) in [("tpu", None), ("gpu", Some("3g.40gb")), ("mig", None), ("mig", Some("huge"))] {
        let bad = GpuRequest { kind: kind.into(), profile: profile.map(String::from), ..gpu(1) };
        let e = better_compute_core::Error::from(availability::of(&c, &f.pool_id, &bad, 60).await.unwrap_err());
        assert_eq!(e.code, ErrorCode::InvalidArgument, "{kind} {profile:?}: {e}");
    }
}

#[tokio::test]
async fn mig_instances_and_slots_are_atoms_and_their_parent_never_is() {
    let h = harness().await;
    let modes = [GpuMode::Mig { layout: vec!["3g.40gb".into(), "3g.40gb".into()] }, GpuMode::TimeSlice { slots: 4 }];
    let f = fleet(&h, &modes, 1).await;
    let mut c = h.db().connect().await;
    let mut mig = whole(&f.pool_id, 2);
    mig.gpu = GpuRequest { kind: "mig".into(), model: MODEL.into(), profile: Some("3g.40gb".into()), count: 2 };
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &mig).await.unwrap();
    assert_eq!(r.atoms, [format!("{}/mig0", f.gpus[0][0]), format!("{}/mig1", f.gpus[0][0])]);
    let mut slots = whole(&f.pool_id, 3);
    slots.gpu = GpuRequest { kind: "slot".into(), model: MODEL.into(), profile: None, count: 3 };
    let s = reservations::create(&mut c, &TEST_ACTOR, ME, &slots).await.unwrap();
    assert_eq!(s.atoms.len(), 3);
    assert!(s.atoms.iter().all(|a| a.starts_with(&format!("{}/s", f.gpus[1][0]))));
    // No whole GPU is bookable: both are shared.
    assert_eq!(
        reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap_err().code,
        ErrorCode::InvalidArgument
    );
    let q = quota::get(&c, TENANT).await.unwrap();
    assert_eq!(q.iter().find(|x| x.resource == "mig_instances").unwrap().used, 2);
    assert_eq!(q.iter().find(|x| x.resource == "gpu_slots").unwrap().used, 3);
}

#[tokio::test]
async fn the_rollup_counts_a_pools_atoms_nodes_and_free_scalars() {
    let h = harness().await;
    let modes = [GpuMode::Exclusive, GpuMode::Exclusive, GpuMode::TimeSlice { slots: 4 }];
    let f = fleet(&h, &modes, 2).await;
    let mut c = h.db().connect().await;
    reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 2)).await.unwrap();
    {
        let tx = c.transaction().await.unwrap();
        actions::cordon(&tx, &f.nodes[1]).await.unwrap();
        tx.commit().await.unwrap();
    }
    settle_outbox(&h).await;
    h.job("event-subscribers").drain(5).await;
    h.job("capacity.rollup").drain(5).await;
    let row = c
        .query_one("SELECT atoms, nodes, schedulable_nodes, vcpu_free FROM pool_capacity_rollup WHERE pool_id = $1", &[&f.pool_id])
        .await
        .unwrap();
    let atoms: serde_json::Value = row.get(0);
    assert_eq!(
        atoms,
        serde_json::json!([
            {"kind": "gpu", "model": MODEL, "profile": "", "total": 4, "idle": 2},
            {"kind": "slot", "model": MODEL, "profile": "", "total": 8, "idle": 8},
        ])
    );
    assert_eq!((row.get::<_, i32>(1), row.get::<_, i32>(2), row.get::<_, i64>(3)), (3, 2, 3 * 128 - 8));
}

#[tokio::test]
async fn a_nodes_desired_state_follows_its_reservations_and_gpu_modes() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let node = f.nodes[0].clone();
    let mut c = h.db().connect().await;
    async fn spec_of(c: &tokio_postgres::Client, node: &str) -> (i64, i64, serde_json::Value) {
        let r = c.query_one("SELECT generation, observed_generation, spec FROM nodes WHERE id = $1", &[&node]).await.unwrap();
        (r.get(0), r.get(1), r.get(2))
    }
    // Adoption enqueued nodespec work: the first spec is generation 1.
    h.job("nodespec").drain(5).await;
    let (generation, observed, s) = spec_of(&c, &node).await;
    assert_eq!((generation, observed), (1, 1));
    assert_eq!(s["site"]["poolName"], "pool-a");
    assert_eq!(s["gpus"]["gpus"].as_array().unwrap().len(), 2);
    assert_eq!(s["agent"]["lanes"][0]["name"], "default");
    assert!(s["allocations"].get("allocations").is_none(), "{s}");
    // A reservation exposes its atoms to its allocation: one new generation.
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    h.job("nodespec").drain(5).await;
    let (generation, _, s) = spec_of(&c, &node).await;
    assert_eq!(generation, 2);
    assert_eq!(s["allocations"]["allocations"][0]["allocationId"], r.id.as_str());
    assert_eq!(s["allocations"]["allocations"][0]["atoms"], serde_json::json!(r.atoms));
    // Released: gone from the spec, one more generation.
    reservations::release(&mut c, &TEST_ACTOR, ME, &r.id).await.unwrap();
    h.job("nodespec").drain(5).await;
    assert_eq!(spec_of(&c, &node).await.0, 3);
    // A daemon's reports only move observedGeneration up.
    assert_eq!(better_compute_nodes::inventory::report_observed_generation(&c, &node, 3).await.unwrap(), 3);
    assert_eq!(better_compute_nodes::inventory::report_observed_generation(&c, &node, 2).await.unwrap(), 3);
    let v = better_compute_nodes::inventory::get_node(&c, &node).await.unwrap();
    assert_eq!((v.generation, v.observed_generation), (3, 3));
    // A mode change changes the gpus section.
    mode::change_gpu_mode(&mut c, &TEST_ACTOR, &f.gpus[0][1], &GpuMode::TimeSlice { slots: 2 }).await.unwrap();
    h.job("nodespec").drain(5).await;
    let (generation, _, s) = spec_of(&c, &node).await;
    assert_eq!(generation, 4);
    assert_eq!(s["gpus"]["gpus"][1]["mode"], "GPU_MODE_TIME_SLICE");
}

#[tokio::test]
async fn a_taint_and_a_refresh_lock_a_nodes_count_rows_in_the_same_order() {
    // A taint (or cordon) updates the node's row and, by trigger, the open flag of every count row
    // of the node; a refresh (the inventory subscriber's, a mode change's) upserts them in key
    // order. The trigger took them in its plan's order, which for a sequential scan is the heap's:
    // a node with two classes could have them locked in opposite orders, and the torture test met
    // the deadlock about once per 400 seeds. Here a transaction stands in for the refresh.
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let node = f.nodes[0].clone();
    let mut c = h.db().connect().await;
    mode::change_gpu_mode(&mut c, &TEST_ACTOR, &f.gpus[0][1], &GpuMode::Mig { layout: vec!["3g.40gb".into(), "3g.40gb".into()] }).await.unwrap();
    settle_outbox(&h).await;
    h.job("event-subscribers").drain(20).await;
    // A new version of the gpu row: in the heap it now comes after the mig row, though before it in
    // key order ('gpu' < 'mig').
    c.execute("UPDATE node_atom_counts SET idle = idle WHERE node_id = $1 AND kind = 'gpu'", &[&node]).await.unwrap();
    assert_eq!(count(&h, &format!("SELECT count(*) FROM node_atom_counts WHERE node_id = '{node}' AND open")).await, 2);
    let mut z = h.db().connect().await;
    let refresh = z.transaction().await.unwrap();
    refresh.execute("UPDATE node_atom_counts SET idle = idle WHERE node_id = $1 AND kind = 'gpu'", &[&node]).await.unwrap();
    let mut t = h.db().connect().await;
    // The trigger's statement planned as a sequential scan, in heap order.
    t.batch_execute("SET enable_indexscan = off; SET enable_bitmapscan = off").await.unwrap();
    let taint_tx = t.transaction().await.unwrap();
    let taint = async {
        actions::taint(&taint_tx, &node, "maint", "yes").await.expect("the taint must not deadlock with the refresh");
        taint_tx.commit().await.unwrap();
    };
    let standin = async {
        waits_for_a_lock(&h, "UPDATE nodes SET taints", "the taint never waited for the refresh's first row").await;
        refresh
            .execute("UPDATE node_atom_counts SET idle = idle WHERE node_id = $1 AND kind = 'mig'", &[&node])
            .await
            .expect("the refresh's second row must not deadlock with the taint");
        refresh.commit().await.unwrap();
    };
    tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(taint, standin) }).await.expect("hung");
    assert_eq!(count(&h, &format!("SELECT count(*) FROM node_atom_counts WHERE node_id = '{node}' AND open")).await, 0);
}

#[tokio::test]
async fn an_atoms_bookings_are_looked_up_through_the_btree_whatever_the_statistics() {
    // The exclusion constraint's GiST also indexes device_id, but an equality on text reads most of
    // it; and plans made from a nearly empty table's statistics scanned every live booking for each
    // atom. The lookups compare device_id in the "C" collation, which only device_bookings_atom_end
    // has, and the functions that run them allow no index-only scan, which is how the GiST served
    // them as a full scan once the table was analyzed empty (capacity 0011). Checked on generic
    // plans over a table analyzed after its bookings were moved out, the worst case for the
    // planner's estimates, under the settings of those functions.
    let h = harness().await;
    let _fleet = fleet(&h, &exclusive(1), 2).await;
    let c = h.db().connect().await;
    // Indexes of some size, on a table with nothing live left in it.
    c.batch_execute(
        "INSERT INTO device_bookings (device_id, allocation_id, during)
           SELECT d.id, 'res_' || k, tstzrange(compute_now() + make_interval(hours => k), compute_now() + make_interval(hours => k + 1))
             FROM devices d, generate_series(1, 500) k;
         DELETE FROM device_bookings;
         ANALYZE device_bookings;",
    )
    .await
    .unwrap();
    assert_eq!(count(&h, "SELECT reltuples::bigint FROM pg_class WHERE relname = 'device_bookings'").await, 0);
    for function in ["capacity_place", "capacity_end", "capacity_upsert_node_counts"] {
        let config = format!("SELECT count(*) FROM pg_proc WHERE proname = '{function}' AND 'enable_indexonlyscan=off' = ANY(proconfig)");
        assert_eq!(count(&h, &config).await, 1, "{function} allows index-only scans");
    }
    c.batch_execute(
        "SET enable_seqscan = off; SET enable_indexonlyscan = off; SET plan_cache_mode = force_generic_plan;
         PREPARE latest_end(text) AS
           SELECT max(upper(o.during)) FROM device_bookings o WHERE o.device_id COLLATE \"C\" = $1;
         PREPARE free_atoms(text, tstzrange) AS
           SELECT a.id FROM devices a
            WHERE a.node_id = $1
              AND coalesce((SELECT max(upper(b.during)) FROM device_bookings b
                             WHERE b.device_id COLLATE \"C\" = a.id AND lower(b.during) < upper($2)),
                           '-infinity') <= lower($2);
         PREPARE busy(text[]) AS
           SELECT b.allocation_id FROM device_bookings b
            WHERE b.device_id COLLATE \"C\" = ANY($1) AND upper(b.during) > compute_now()
            ORDER BY upper(b.during) DESC LIMIT 1;",
    )
    .await
    .unwrap();
    for q in [
        "EXPLAIN EXECUTE latest_end('GPU-0')",
        "EXPLAIN EXECUTE free_atoms('node_0', tstzrange(compute_now(), compute_now() + interval '1 hour'))",
        "EXPLAIN EXECUTE busy(ARRAY['GPU-0'])",
    ] {
        let plan: Vec<String> = c.query(q, &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
        let plan = plan.join("\n");
        assert!(plan.contains("device_bookings_atom_end"), "{q}:\n{plan}");
        assert!(!plan.contains("device_bookings_device_id_during_excl"), "{q}:\n{plan}");
        // The atom's id is part of the index condition, not a filter applied to every live booking.
        let cond = plan.lines().skip_while(|l| !l.contains("device_bookings_atom_end")).nth(1).unwrap_or_default();
        assert!(cond.contains("Index Cond") && cond.contains("device_id"), "{q}:\n{plan}");
    }
}

#[tokio::test]
async fn the_candidate_searches_run_on_generic_plans_that_walk_the_class_in_index_order() {
    // capacity_candidates forces generic plans: under load the plan cache kept planning its searches
    // again at most calls, which cost more than running them. Its generic plans must then be the
    // ones the searches are written for: the class's counts in index order, within the window.
    let h = harness().await;
    let c = h.db().connect().await;
    let config: Option<Vec<String>> = c
        .query_one("SELECT proconfig FROM pg_proc WHERE proname = 'capacity_candidates'", &[])
        .await
        .unwrap()
        .get(0);
    assert!(config.unwrap_or_default().contains(&"plan_cache_mode=force_generic_plan".to_owned()));
    c.batch_execute(
        "SET plan_cache_mode = force_generic_plan;
         PREPARE best_fit(text, text, text, text, int, jsonb, text[], bigint) AS
           SELECT array_agg(s.node_id ORDER BY s.idle, s.r)
             FROM (SELECT c.node_id, c.idle, random() AS r
                     FROM ((SELECT a.node_id, a.idle FROM node_atom_counts a
                             WHERE a.pool_id = $1 AND a.kind = $2 AND a.model = $3 AND a.profile = $4 AND a.open AND a.idle >= $5
                             ORDER BY a.idle, a.node_id LIMIT $8)
                           UNION ALL
                           (SELECT t.node_id, t.idle
                              FROM (SELECT a.node_id, a.idle FROM node_atom_counts a
                                     WHERE $6 <> '[]'::jsonb AND a.pool_id = $1 AND a.kind = $2 AND a.model = $3
                                       AND a.profile = $4 AND NOT a.open AND a.idle >= $5
                                     ORDER BY a.idle, a.node_id LIMIT $8) t
                              JOIN nodes n ON n.id = t.node_id
                             WHERE capacity_node_takes(n.observed_generation, n.no_schedule_reasons, n.taints, $6))) c
                    WHERE NOT (c.node_id = ANY($7))
                    ORDER BY c.idle, r LIMIT 32) s;
         PREPARE worst_fit(text, text, text, text, int, jsonb, text[], bigint) AS
           SELECT array_agg(s.node_id ORDER BY s.idle DESC, s.r)
             FROM (SELECT c.node_id, c.idle, random() AS r
                     FROM ((SELECT a.node_id, a.idle FROM node_atom_counts a
                             WHERE a.pool_id = $1 AND a.kind = $2 AND a.model = $3 AND a.profile = $4 AND a.open AND a.total >= $5
                             ORDER BY a.idle DESC, a.node_id DESC LIMIT $8)
                           UNION ALL
                           (SELECT t.node_id, t.idle
                              FROM (SELECT a.node_id, a.idle FROM node_atom_counts a
                                     WHERE $6 <> '[]'::jsonb AND a.pool_id = $1 AND a.kind = $2 AND a.model = $3
                                       AND a.profile = $4 AND NOT a.open AND a.total >= $5
                                     ORDER BY a.idle DESC, a.node_id DESC LIMIT $8) t
                              JOIN nodes n ON n.id = t.node_id
                             WHERE capacity_node_takes(n.observed_generation, n.no_schedule_reasons, n.taints, $6))) c
                    WHERE NOT (c.node_id = ANY($7))
                    ORDER BY c.idle DESC, r LIMIT 32) s;",
    )
    .await
    .unwrap();
    for q in [
        "EXPLAIN EXECUTE best_fit('pool_a', 'gpu', 'H100', '', 1, '[]', '{}', 64)",
        "EXPLAIN EXECUTE worst_fit('pool_a', 'gpu', 'H100', '', 1, '[]', '{}', 64)",
    ] {
        let plan: Vec<String> = c.query(q, &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
        let plan = plan.join("\n");
        // The window's LIMIT sits right on the walk of node_atom_counts_fit, with the class in the
        // index condition: the search reads the window, not the class.
        // Both parts (the open counts; the closed ones, for tolerations) walk it so; the closed
        // part's walk runs under its one-time filter, itself under the LIMIT.
        let lines: Vec<&str> = plan.lines().collect();
        let walks: Vec<usize> = (0..lines.len()).filter(|&i| lines[i].contains("node_atom_counts_fit")).collect();
        assert_eq!(walks.len(), 2, "{q}:\n{plan}");
        for walk in walks {
            let limited = lines[walk - 1].contains("Limit") || (lines[walk - 1].contains("One-Time Filter") && lines[walk - 3].contains("Limit"));
            assert!(limited, "{q}:\n{plan}");
            let cond = lines[walk + 1];
            assert!(cond.contains("Index Cond") && cond.contains("pool_id") && cond.contains("open"), "{q}:\n{plan}");
        }
        // The nodes are joined only in the part that a request without tolerations skips.
        assert!(plan.contains("One-Time Filter"), "{q}:\n{plan}");
        assert_eq!(plan.matches("nodes_pkey").count(), 1, "{q}:\n{plan}");
    }
}

#[tokio::test]
async fn a_quarantined_or_unhealthy_gpu_leaves_a_request_pending_and_only_the_hardware_refuses_one_cpu_only_too() {
    let h = harness().await;
    // One node of 8 whole GPUs, one of 8 GPUs each in MIG mode (two 3g.40gb instances).
    let modes = vec![GpuMode::Exclusive, GpuMode::Mig { layout: vec!["3g.40gb".into(), "3g.40gb".into()] }];
    let f = fleet(&h, &modes, 8).await;
    let mut c = h.db().connect().await;
    {
        let tx = c.transaction().await.unwrap();
        actions::quarantine(&tx, &f.gpus[0][0], "flaky fan").await.unwrap();
        actions::set_gpu_health(&tx, &f.gpus[0][1], false).await.unwrap();
        for g in &f.gpus[1] {
            actions::quarantine(&tx, g, "firmware update").await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    settle_outbox(&h).await;
    h.job("event-subscribers").drain(20).await;
    // The node has 8 GPUs, two out for now: 8 waits instead of being refused as too many.
    let eight = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 8)).await.unwrap();
    assert_eq!(eight.state, "pending", "{eight:?}");
    // Every MIG parent is quarantined: a MIG instance waits too, the pool has them.
    let mut mig = whole(&f.pool_id, 1);
    mig.gpu = GpuRequest { kind: "mig".into(), model: MODEL.into(), profile: Some("3g.40gb".into()), count: 1 };
    let instance = reservations::create(&mut c, &TEST_ACTOR, ME, &mig).await.unwrap();
    assert_eq!(instance.state, "pending", "{instance:?}");
    // What the hardware can never hold is still refused, at once.
    let err = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 9)).await.unwrap_err();
    assert_eq!((err.code, err.message.contains("most on one node is 8")), (ErrorCode::FailedPrecondition, true), "{err:?}");
    mig.gpu.profile = Some("1g.10gb".into());
    let err = reservations::create(&mut c, &TEST_ACTOR, ME, &mig).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::InvalidArgument, "{err:?}");
    // A CPU-only request names the GPU model of the nodes it may land on: one the pool lacks can
    // never be placed, and neither can more vCPU, memory or disk than any node has when empty.
    let mut cpu_only = whole(&f.pool_id, 0);
    cpu_only.gpu.model = "A100-40GB".into();
    let err = reservations::create(&mut c, &TEST_ACTOR, ME, &cpu_only).await.unwrap_err();
    assert_eq!((err.code, err.message.contains("has no gpu A100-40GB atoms")), (ErrorCode::InvalidArgument, true), "{err:?}");
    for (vcpu, memory_mib, disk_gib) in [(129, 1024, 1), (1, 1_048_577, 1), (1, 1024, 8_001)] {
        for gpus in [0, 1] {
            let req = reservations::CreateReservation { vcpu, memory_mib, disk_gib, ..whole(&f.pool_id, gpus) };
            let err = reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap_err();
            assert_eq!(
                (err.code, err.message.contains("128 vCPU, 1048576 MiB memory and 8000 GiB disk")),
                (ErrorCode::FailedPrecondition, true),
                "{vcpu} vCPU, {memory_mib} MiB, {disk_gib} GiB with {gpus} GPUs: {err:?}"
            );
        }
    }
    // Exactly a whole node's scalars still fits (the quarantines do not matter to a CPU-only one).
    let full = reservations::CreateReservation { vcpu: 128, memory_mib: 1_048_576, disk_gib: 8_000, ..whole(&f.pool_id, 0) };
    let v = reservations::create(&mut c, &TEST_ACTOR, ME, &full).await.unwrap();
    assert_eq!(v.state, "placed", "{v:?}");
    assert_eq!(count(&h, "SELECT count(*) FROM reservations").await, 3);
}
