//! The foundation against a real PostgreSQL: migrations, the clock, leases and fencing, idempotency
//! keys.

use std::time::Duration;

use better_compute_core::ErrorCode;
use better_compute_db::idempotency::{self, Claim, IdempotencyScope};
use better_compute_db::launcher::{FileLock, LaunchError, PgBinaries};
use better_compute_db::lease::WORKER_LEASE_TTL;
use better_compute_db::testing::TestDb;
use better_compute_db::{clock, migrate, workers, Clock, DbError, Lease, Migration, FOUNDATION_MIGRATIONS};

/// Fails loudly instead of hanging when a lock is never released.
async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f).await.unwrap_or_else(|_| panic!("timed out: {what}"))
}

fn code(e: DbError) -> ErrorCode {
    better_compute_core::Error::from(e).code
}

#[tokio::test]
async fn migrations_apply_once_and_are_recorded() {
    let db = TestDb::core().await;
    let mut c = db.connect().await;
    let again = migrate(&mut c, FOUNDATION_MIGRATIONS).await.unwrap();
    assert!(again.applied.is_empty(), "{again:?}");
    assert_eq!(again.already_applied, 4);
    let names: Vec<String> = c
        .query("SELECT module || '/' || name FROM schema_migrations ORDER BY module, name", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(names, ["clock/0001_clock", "clock/clock", "core/0001_core", "core/idempotency"]);
}

#[tokio::test]
async fn a_new_module_migration_is_applied_after_core_and_an_edited_one_is_refused() {
    let db = TestDb::core().await;
    let mut c = db.connect().await;
    const EXTRA: &[Migration] = &[
        Migration::numbered("extra", "0002_b", "ALTER TABLE extra_t ADD COLUMN b int;"),
        Migration::numbered("extra", "0001_a", "CREATE TABLE extra_t (a int);"),
    ];
    let report = migrate(&mut c, &[FOUNDATION_MIGRATIONS, &[EXTRA]].concat()).await.unwrap();
    assert_eq!(report.applied, ["extra/0001_a", "extra/0002_b"]);
    const EDITED: &[Migration] = &[Migration::numbered("extra", "0001_a", "CREATE TABLE extra_t (z int);")];
    let err = migrate(&mut c, &[FOUNDATION_MIGRATIONS, &[EDITED]].concat()).await.unwrap_err();
    assert!(matches!(err, DbError::MigrationChanged { ref migration } if migration == "extra/0001_a"), "{err}");
}

#[tokio::test]
async fn a_migration_moved_to_another_module_is_not_applied_again_and_its_record_follows_it() {
    let db = TestDb::core().await;
    let mut c = db.connect().await;
    const SQL: &str = "CREATE TABLE moved_t (a int);";
    const BEFORE: &[Migration] = &[Migration::numbered("old", "0002_moved", SQL)];
    migrate(&mut c, &[FOUNDATION_MIGRATIONS, &[BEFORE]].concat()).await.unwrap();
    const AFTER: &[Migration] = &[Migration::numbered("new", "0001_moved", SQL).was("old", "0002_moved")];
    let sets = [FOUNDATION_MIGRATIONS, &[AFTER]].concat();
    assert!(better_compute_db::migrate::pending(&c, &sets).await.unwrap().is_empty(), "the old record counts");
    // Applying it again would fail: the table exists.
    let report = migrate(&mut c, &sets).await.unwrap();
    assert!(report.applied.is_empty(), "{report:?}");
    let names: Vec<String> =
        c.query("SELECT module || '/' || name FROM schema_migrations WHERE name LIKE '%moved'", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(names, ["new/0001_moved"]);
    // A fresh database applies it under its new name.
    let fresh = TestDb::core().await;
    let mut f = fresh.connect().await;
    assert_eq!(migrate(&mut f, &sets).await.unwrap().applied, ["new/0001_moved"]);
}

#[tokio::test]
async fn a_failing_migration_leaves_nothing_of_its_run_behind() {
    let db = TestDb::core().await;
    let mut c = db.connect().await;
    // A good migration and a repeatable file before the broken one: one run, one transaction.
    const BROKEN: &[Migration] = &[
        Migration::numbered("broken", "0001", "CREATE TABLE whole (a int);"),
        Migration::numbered("broken", "0002", "CREATE TABLE half (a int); SELECT no_such_function();"),
        Migration::repeatable("broken", "f", "CREATE OR REPLACE FUNCTION broken_f() RETURNS int LANGUAGE sql AS $$ SELECT 1 $$;"),
    ];
    let err = migrate(&mut c, &[FOUNDATION_MIGRATIONS, &[BROKEN]].concat()).await.unwrap_err();
    assert!(matches!(err, DbError::MigrationFailed { ref migration, .. } if migration == "broken/0002"), "{err}");
    let made: i64 = c
        .query_one("SELECT count(*) FROM pg_class WHERE relname IN ('whole', 'half')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(made, 0);
    let recorded: i64 =
        c.query_one("SELECT count(*) FROM schema_migrations WHERE module = 'broken'", &[]).await.unwrap().get(0);
    assert_eq!(recorded, 0);
}

#[tokio::test]
async fn a_repeatable_file_is_applied_after_its_modules_numbered_ones_and_again_only_when_it_changes() {
    let db = TestDb::core().await;
    let mut c = db.connect().await;
    // Listed before the table it reads: it still runs after every numbered migration of its module.
    const V1: &[Migration] = &[
        Migration::repeatable("extra", "answer", "CREATE OR REPLACE FUNCTION extra_answer() RETURNS bigint LANGUAGE sql AS $$ SELECT count(*) FROM extra_t $$;"),
        Migration::numbered("extra", "0001_t", "CREATE TABLE extra_t (a int); INSERT INTO extra_t VALUES (1), (2);"),
    ];
    async fn answer(c: &tokio_postgres::Client) -> i64 {
        c.query_one("SELECT extra_answer()", &[]).await.unwrap().get(0)
    }
    let report = migrate(&mut c, &[FOUNDATION_MIGRATIONS, &[V1]].concat()).await.unwrap();
    assert_eq!(report.applied, ["extra/0001_t", "extra/answer"]);
    assert_eq!(answer(&c).await, 2);
    let again = migrate(&mut c, &[FOUNDATION_MIGRATIONS, &[V1]].concat()).await.unwrap();
    assert!(again.applied.is_empty(), "{again:?}");
    const V2: &[Migration] = &[
        Migration::numbered("extra", "0001_t", "CREATE TABLE extra_t (a int); INSERT INTO extra_t VALUES (1), (2);"),
        Migration::repeatable("extra", "answer", "CREATE OR REPLACE FUNCTION extra_answer() RETURNS bigint LANGUAGE sql AS $$ SELECT sum(a) FROM extra_t $$;"),
    ];
    let changed = migrate(&mut c, &[FOUNDATION_MIGRATIONS, &[V2]].concat()).await.unwrap();
    assert_eq!(changed.applied, ["extra/answer"]);
    assert_eq!(answer(&c).await, 3);
    let recorded: i64 =
        c.query_one("SELECT count(*) FROM schema_migrations WHERE module = 'extra'", &[]).await.unwrap().get(0);
    assert_eq!(recorded, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrators_apply_each_migration_exactly_once() {
    let db = TestDb::core().await;
    const MORE: &[Migration] = &[Migration::numbered("more", "0001", "CREATE TABLE once_only (a int);")];
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let conn = db.connection_string().to_owned();
        tasks.push(tokio::spawn(async move {
            let mut c = better_compute_db::pool::connect(&conn).await.unwrap();
            migrate(&mut c, &[FOUNDATION_MIGRATIONS, &[MORE]].concat()).await.unwrap()
        }));
    }
    let mut applied = 0;
    for t in tasks {
        applied += within("migrator", t).await.unwrap().applied.len();
    }
    assert_eq!(applied, 1);
}

#[tokio::test]
async fn the_simulated_clock_is_on_by_default_and_moves_only_when_told() {
    let db = TestDb::core().await;
    assert_eq!(db.now().await, clock::sim_epoch());
    let later = db.advance(Duration::from_secs(90)).await;
    assert_eq!(later, clock::sim_epoch() + Duration::from_secs(90));
    assert_eq!(db.now().await, later);
    db.set_sim_clock(clock::sim_epoch()).await;
    assert_eq!(db.now().await, clock::sim_epoch());
}

#[tokio::test]
async fn use_real_clock_and_use_sim_clock_swap_the_function_body() {
    let db = TestDb::core().await;
    let c = db.client().await;
    clock::use_real_clock(&**c).await.unwrap();
    assert!(!clock::is_sim_clock(&**c).await.unwrap());
    let real = clock::db_now(&**c).await.unwrap();
    let wall = std::time::SystemTime::now();
    let diff = wall.duration_since(real).unwrap_or_else(|e| e.duration());
    assert!(diff < Duration::from_secs(60), "real clock {real:?} vs wall {wall:?}");
    clock::use_sim_clock(&**c, clock::sim_epoch()).await.unwrap();
    assert!(clock::is_sim_clock(&**c).await.unwrap());
    assert_eq!(clock::db_now(&**c).await.unwrap(), clock::sim_epoch());
}

#[tokio::test]
async fn the_business_clock_follows_simulated_time_at_each_sample() {
    let db = TestDb::core().await;
    let c = db.client().await;
    let clock = Clock::start(&**c).await.unwrap();
    assert_eq!(clock.now(), clock::sim_epoch());
    db.advance(Duration::from_secs(30)).await;
    assert_eq!(clock.now(), clock::sim_epoch(), "simulated time stands still between samples");
    // A lease renewal samples the clock.
    let lease = Lease::acquire(&**c, "singleton:clock", "w1", WORKER_LEASE_TTL, Some(&clock)).await.unwrap().unwrap();
    assert_eq!(clock.now(), clock::sim_epoch() + Duration::from_secs(30));
    db.advance(Duration::from_secs(5)).await;
    assert!(lease.renew(&**c, Some(&clock)).await.unwrap());
    assert_eq!(clock.now(), clock::sim_epoch() + Duration::from_secs(35));
    let check = &clock.self_check()[0];
    assert_eq!(check.name, "clock.skew");
    assert!(check.ok, "{check:?}");
}

#[tokio::test]
async fn renewal_by_the_owner_keeps_the_epoch_and_takeover_after_expiry_increments_it() {
    let db = TestDb::core().await;
    let c = db.client().await;
    let a = Lease::acquire(&**c, "shard:7", "worker-a", WORKER_LEASE_TTL, None).await.unwrap().unwrap();
    assert_eq!(a.epoch(), 1);
    // Held: B cannot take it.
    assert!(Lease::acquire(&**c, "shard:7", "worker-b", WORKER_LEASE_TTL, None).await.unwrap().is_none());
    // A renews within its TTL, repeatedly; the epoch stays.
    for _ in 0..3 {
        db.advance(Duration::from_secs(5)).await;
        assert!(a.renew(&**c, None).await.unwrap());
    }
    let again = Lease::acquire(&**c, "shard:7", "worker-a", WORKER_LEASE_TTL, None).await.unwrap().unwrap();
    assert_eq!(again.epoch(), 1);
    // Still held 14 s after the last renewal; gone after 15.
    db.advance(Duration::from_secs(14)).await;
    assert!(Lease::acquire(&**c, "shard:7", "worker-b", WORKER_LEASE_TTL, None).await.unwrap().is_none());
    db.advance(Duration::from_secs(2)).await;
    let b = Lease::acquire(&**c, "shard:7", "worker-b", WORKER_LEASE_TTL, None).await.unwrap().unwrap();
    assert_eq!(b.epoch(), 2);
    // A's renewal now fails: it lost the lease.
    assert!(!a.renew(&**c, None).await.unwrap());
    // A release lets the next holder in at once, with a new epoch.
    b.release(&**c).await.unwrap();
    let a2 = Lease::acquire(&**c, "shard:7", "worker-a", WORKER_LEASE_TTL, None).await.unwrap().unwrap();
    assert_eq!(a2.epoch(), 3);
    // A lease that lapsed is not renewed, even when nobody took it: its holder takes it again,
    // under a new epoch, so nothing fenced under the lapsed one commits.
    db.advance(Duration::from_secs(16)).await;
    assert!(!a2.renew(&**c, None).await.unwrap());
    let a3 = Lease::acquire(&**c, "shard:7", "worker-a", WORKER_LEASE_TTL, None).await.unwrap().unwrap();
    assert_eq!(a3.epoch(), 4);
    db.advance(Duration::from_secs(16)).await;
    let many = better_compute_db::lease::acquire_many(&**c, &["shard:7".to_owned()], "worker-a", WORKER_LEASE_TTL, None).await.unwrap();
    assert_eq!(many.held.iter().map(|l| l.epoch()).collect::<Vec<_>>(), vec![5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_waits_for_the_zombies_fenced_transaction_and_the_zombie_is_fenced_after() {
    let db = TestDb::core().await;
    db.client().await.batch_execute("CREATE TABLE effects (by text, epoch bigint)").await.unwrap();
    let mut zombie_conn = db.connect().await;
    let b_conn = db.connect().await;
    let b_pid: i32 = b_conn.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);

    let a = Lease::acquire(&zombie_conn, "singleton:sweeper", "worker-a", WORKER_LEASE_TTL, None).await.unwrap().unwrap();
    let tx = a.begin_fenced(&mut zombie_conn).await.unwrap();
    // The zombie pauses (a GC pause, a stalled VM) past its lease's expiry.
    db.advance(Duration::from_secs(16)).await;

    let takeover = tokio::spawn(async move {
        let lease = Lease::acquire(&b_conn, "singleton:sweeper", "worker-b", WORKER_LEASE_TTL, None).await.unwrap();
        (lease, b_conn)
    });
    // B's takeover blocks on the zombie's FOR SHARE row lock.
    let observer = db.client().await;
    within("B to wait on the lease row lock", async {
        loop {
            let waiting = observer
                .query_opt("SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'", &[&b_pid])
                .await
                .unwrap();
            if waiting.is_some() {
                break;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(!takeover.is_finished(), "the takeover must wait for the fenced transaction");

    // The zombie still sees its lease valid inside the transaction it fenced, and commits.
    tx.execute("INSERT INTO effects VALUES ('worker-a', $1)", &[&tx.epoch()]).await.unwrap();
    tx.commit().await.unwrap();

    let (b, _b_conn) = within("takeover", takeover).await.unwrap();
    let b = b.expect("B takes the expired lease");
    assert_eq!(b.epoch(), 2);

    // The zombie's next fenced transaction fails, and nothing it tries lands.
    match a.begin_fenced(&mut zombie_conn).await {
        Err(DbError::LeaseLost { name, epoch }) => {
            assert_eq!(name, "singleton:sweeper");
            assert_eq!(epoch, 1);
        }
        Err(e) => panic!("expected LeaseLost, got {e}"),
        Ok(_) => panic!("the zombie opened a fenced transaction after losing its lease"),
    }
    let effects: Vec<(String, i64)> = observer
        .query("SELECT by, epoch FROM effects", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(effects, [("worker-a".to_owned(), 1)]);
}

#[tokio::test]
async fn a_fence_on_an_expired_lease_fails_even_before_anyone_takes_over() {
    let db = TestDb::core().await;
    let mut c = db.connect().await;
    let a = Lease::acquire(&c, "pool:p1", "worker-a", WORKER_LEASE_TTL, None).await.unwrap().unwrap();
    db.advance(Duration::from_secs(15)).await;
    assert!(matches!(a.begin_fenced(&mut c).await, Err(DbError::LeaseLost { .. })));
}

#[tokio::test]
async fn workers_that_stop_heartbeating_drop_out_of_the_live_set() {
    let db = TestDb::core().await;
    let c = db.client().await;
    for id in ["wrk_a", "wrk_b"] {
        let info = workers::WorkerInfo {
            id: id.into(),
            hostname: "h".into(),
            pid: 1,
            roles: vec!["worker".into()],
            version: "test".into(),
        };
        workers::register(&**c, &info).await.unwrap();
    }
    assert_eq!(workers::live(&**c).await.unwrap(), ["wrk_a", "wrk_b"]);
    db.advance(Duration::from_secs(10)).await;
    assert!(workers::heartbeat(&**c, "wrk_a", &serde_json::json!([])).await.unwrap());
    db.advance(Duration::from_secs(10)).await;
    assert_eq!(workers::live(&**c).await.unwrap(), ["wrk_a"]);
    db.advance(Duration::from_secs(200)).await;
    assert_eq!(workers::prune_dead(&**c).await.unwrap(), 2);
    assert!(!workers::heartbeat(&**c, "wrk_a", &serde_json::json!([])).await.unwrap());
}

fn scope<'a>(identity: &'a str, key: &'a str) -> IdempotencyScope<'a> {
    IdempotencyScope { tenant_id: "ten_a", identity_id: identity, key }
}

/// A method that creates a widget, made idempotent.
async fn create_widget(
    client: &mut tokio_postgres::Client,
    identity: &str,
    key: &str,
    name: &str,
) -> Result<serde_json::Value, DbError> {
    let tx = client.transaction().await?;
    let request = serde_json::json!({ "name": name });
    let s = scope(identity, key);
    let response = match idempotency::claim(&tx, s, "widgets.create", &request).await? {
        Claim::Replay(r) => r,
        Claim::New => {
            let id: i32 = tx.query_one("INSERT INTO widgets (name) VALUES ($1) RETURNING id", &[&name]).await?.get(0);
            let r = serde_json::json!({ "widgetId": id });
            idempotency::complete(&tx, s, &r).await?;
            r
        }
    };
    tx.commit().await?;
    Ok(response)
}

async fn widgets_db() -> TestDb {
    let db = TestDb::core().await;
    db.client().await.batch_execute("CREATE TABLE widgets (id serial PRIMARY KEY, name text)").await.unwrap();
    db
}

async fn widget_count(db: &TestDb) -> i64 {
    db.client().await.query_one("SELECT count(*) FROM widgets", &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn the_same_key_twice_returns_the_first_result_and_acts_once() {
    let db = widgets_db().await;
    let mut c = db.connect().await;
    let first = create_widget(&mut c, "idn_1", "k1", "w").await.unwrap();
    let second = create_widget(&mut c, "idn_1", "k1", "w").await.unwrap();
    assert_eq!(first, second);
    assert_eq!(widget_count(&db).await, 1);
}

#[tokio::test]
async fn the_same_key_with_a_different_request_is_refused_and_changes_nothing() {
    let db = widgets_db().await;
    let mut c = db.connect().await;
    create_widget(&mut c, "idn_1", "k1", "w").await.unwrap();
    let err = create_widget(&mut c, "idn_1", "k1", "other").await.unwrap_err();
    let err = better_compute_core::Error::from(err);
    assert_eq!(err.code, ErrorCode::Conflict);
    assert_eq!(err.details["reason"], "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(widget_count(&db).await, 1);
}

#[tokio::test]
async fn another_identity_with_the_same_key_gets_its_own_result() {
    let db = widgets_db().await;
    let mut c = db.connect().await;
    let mine = create_widget(&mut c, "idn_1", "k1", "w").await.unwrap();
    let theirs = create_widget(&mut c, "idn_2", "k1", "w").await.unwrap();
    assert_ne!(mine, theirs);
    assert_eq!(widget_count(&db).await, 2);
    // Each replays its own.
    assert_eq!(create_widget(&mut c, "idn_2", "k1", "w").await.unwrap(), theirs);
}

#[tokio::test]
async fn an_expired_key_acts_again_and_a_failed_attempt_leaves_the_key_free() {
    let db = widgets_db().await;
    let mut c = db.connect().await;
    // A method that fails after claiming rolls back its claim.
    {
        let tx = c.transaction().await.unwrap();
        let claim = idempotency::claim(&tx, scope("idn_1", "k2"), "widgets.create", &serde_json::json!({"name": "w"}))
            .await
            .unwrap();
        assert_eq!(claim, Claim::New);
        tx.rollback().await.unwrap();
    }
    create_widget(&mut c, "idn_1", "k2", "w").await.unwrap();
    assert_eq!(widget_count(&db).await, 1);
    db.advance(idempotency::IDEMPOTENCY_KEY_TTL + Duration::from_secs(1)).await;
    create_widget(&mut c, "idn_1", "k2", "w").await.unwrap();
    assert_eq!(widget_count(&db).await, 2);
    assert!(idempotency::prune_expired(&c, 100).await.unwrap() == 0, "the renewed key is live");
}

#[tokio::test]
async fn a_malformed_key_is_an_invalid_argument() {
    let db = widgets_db().await;
    let mut c = db.connect().await;
    let err = create_widget(&mut c, "idn_1", "has space", "w").await.unwrap_err();
    assert_eq!(code(err), ErrorCode::InvalidArgument);
    assert_eq!(widget_count(&db).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_calls_with_one_key_create_exactly_one_result() {
    let db = widgets_db().await;
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let pool = db.pool.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = pool.get().await.unwrap();
            create_widget(&mut c, "idn_1", "burst", "w").await.unwrap()
        }));
    }
    let mut responses = Vec::new();
    for t in tasks {
        responses.push(within("idempotent call", t).await.unwrap());
    }
    assert!(responses.iter().all(|r| *r == responses[0]), "{responses:?}");
    assert_eq!(widget_count(&db).await, 1);
}

#[test]
fn missing_server_binaries_give_one_error_naming_the_package() {
    let empty = std::env::temp_dir().join(format!("bc-empty-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let err = PgBinaries::find_in(std::slice::from_ref(&empty)).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, LaunchError::BinariesNotFound { .. }));
    assert!(msg.contains("apt-get install postgresql") && msg.contains("BETTER_COMPUTE_PG_BIN"), "{msg}");
    std::fs::remove_dir_all(empty).unwrap();
}

#[test]
fn a_second_holder_of_a_data_folder_is_refused_with_the_first_ones_pid() {
    let dir = std::env::temp_dir().join(format!("bc-lock-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dev.lock");
    let first = FileLock::try_acquire(&path, &dir).unwrap();
    let err = FileLock::try_acquire(&path, &dir).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(&std::process::id().to_string()) && msg.contains("in use"), "{msg}");
    drop(first);
    FileLock::try_acquire(&path, &dir).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewing_many_leases_never_waits_on_a_fenced_transaction_and_a_busy_lease_stays_its_holders() {
    use better_compute_db::lease::acquire_many;
    let db = TestDb::core().await;
    let mut a_conn = db.connect().await;
    let maint = db.connect().await;
    let names = vec!["singleton:prune".to_owned(), "shard:7".to_owned()];
    let first = acquire_many(&maint, &names, "worker-a", WORKER_LEASE_TTL, None).await.unwrap();
    assert_eq!((first.held.len(), first.busy.len()), (2, 0));
    let prune = first.held.iter().find(|l| l.name() == "singleton:prune").unwrap().clone();
    // A long job of A's holds its fence on one lease…
    let long_job = prune.begin_fenced(&mut a_conn).await.unwrap();
    // …and A's renewal neither waits for it nor lets the other lease lapse.
    let again = within("A's renewal past its own long job", acquire_many(&maint, &names, "worker-a", WORKER_LEASE_TTL, None)).await.unwrap();
    assert_eq!(again.held.iter().map(|l| l.name()).collect::<Vec<_>>(), vec!["shard:7"]);
    assert_eq!(again.busy, vec![("singleton:prune".to_owned(), 1)]);
    // Both expire; B takes what is free at once and leaves the row A's job holds.
    db.advance(Duration::from_secs(16)).await;
    let b = db.connect().await;
    let taken = within("B's takeover past A's long job", acquire_many(&b, &names, "worker-b", WORKER_LEASE_TTL, None)).await.unwrap();
    assert_eq!(taken.held.iter().map(|l| (l.name(), l.epoch())).collect::<Vec<_>>(), vec![("shard:7", 2)]);
    assert!(taken.busy.is_empty());
    // A's job still commits under the epoch it fenced; then B takes that lease too, and A is fenced.
    long_job.execute("SELECT 1", &[]).await.unwrap();
    long_job.commit().await.unwrap();
    let later = acquire_many(&b, &names, "worker-b", WORKER_LEASE_TTL, None).await.unwrap();
    let mut got: Vec<(String, i64)> = later.held.iter().map(|l| (l.name().to_owned(), l.epoch())).collect();
    got.sort();
    assert_eq!(got, vec![("shard:7".to_owned(), 2), ("singleton:prune".to_owned(), 2)]);
    assert!(matches!(prune.begin_fenced(&mut a_conn).await, Err(DbError::LeaseLost { .. })));
}

#[tokio::test]
async fn a_fenced_transactions_statements_are_bounded_by_the_statement_timeout() {
    let db = TestDb::core().await;
    let mut c = db.connect().await;
    let lease = Lease::acquire(&c, "singleton:slow", "worker-a", WORKER_LEASE_TTL, None).await.unwrap().unwrap();
    let tx = lease.begin_fenced(&mut c).await.unwrap();
    let timeout: String = tx.query_one("SHOW statement_timeout", &[]).await.unwrap().get(0);
    assert_eq!(timeout, better_compute_db::lease::FENCED_STATEMENT_TIMEOUT);
    tx.rollback().await.unwrap();
    // Transaction-local: the connection's own setting is back after it.
    let after: String = c.query_one("SHOW statement_timeout", &[]).await.unwrap().get(0);
    assert_eq!(after, "0");
}

#[tokio::test]
async fn the_schema_snapshot_shows_every_kind_of_schema_change() {
    let db = TestDb::core().await;
    let c = db.connect().await;
    let before = better_compute_db::schema::snapshot(&c).await.unwrap();
    assert!(before.contains("CREATE TABLE workers (") && before.contains("FUNCTION compute_now() RETURNS"), "{before}");
    for (change, shows) in [
        ("ALTER TABLE workers ADD COLUMN zone text", "  zone text"),
        ("ALTER TABLE leases ADD CONSTRAINT leases_owner_short CHECK (length(owner) < 100)", "CONSTRAINT leases_owner_short CHECK"),
        ("CREATE INDEX workers_zone ON workers (zone)", "CREATE INDEX workers_zone ON"),
        ("ALTER TABLE leases SET (fillfactor = 70)", ") WITH (fillfactor=70);"),
        ("ALTER FUNCTION compute_now() SET work_mem = '1MB'", "STABLE SET work_mem=1MB;"),
        ("CREATE FUNCTION extra_f(a int) RETURNS int LANGUAGE sql AS $$ SELECT a $$", "FUNCTION extra_f(a integer) RETURNS integer"),
    ] {
        let was = better_compute_db::schema::snapshot(&c).await.unwrap();
        c.batch_execute(change).await.unwrap();
        let now = better_compute_db::schema::snapshot(&c).await.unwrap();
        assert_ne!(was, now, "the snapshot missed: {change}");
        assert!(now.contains(shows) && !was.contains(shows), "{change}: {now}");
    }
}

#[tokio::test]
async fn behind_pgbouncer_a_statement_outside_a_transaction_breaks_and_one_in_a_read_tx_does_not() {
    let db = TestDb::core().await;
    let pool = better_compute_db::pool::connect_pool(&db.pgbouncer_connection_string().await, 8).unwrap();
    // Two idle server connections: two transactions held at once, then ended. PgBouncer hands
    // out the one idle longest (`server_round_robin`), so a statement's prepare and its execution
    // go to different servers whenever they are two exchanges.
    {
        let (mut a, mut b) = (pool.get().await.unwrap(), pool.get().await.unwrap());
        let (ta, tb) = (a.transaction().await.unwrap(), b.transaction().await.unwrap());
        ta.batch_execute("SELECT 1").await.unwrap();
        tb.batch_execute("SELECT 1").await.unwrap();
        ta.commit().await.unwrap();
        tb.commit().await.unwrap();
    }
    let mut broken = 0;
    for _ in 0..10 {
        let c = pool.get().await.unwrap();
        if let Err(e) = c.query_one("SELECT $1::int8", &[&7i64]).await {
            assert_eq!(e.code(), Some(&tokio_postgres::error::SqlState::INVALID_SQL_STATEMENT_NAME), "{e:?}");
            broken += 1;
        }
    }
    assert!(broken > 0, "no statement outside a transaction landed on a server without its prepared statement");
    for i in 0..10i64 {
        let r = better_compute_db::pool::read_tx(&pool).await.unwrap();
        let v: i64 = within("a read", r.query_one("SELECT $1::int8", &[&i])).await.unwrap().get(0);
        assert_eq!(v, i);
    }
    // A write through a read is refused, not lost.
    let r = better_compute_db::pool::read_tx(&pool).await.unwrap();
    let e = r.execute("UPDATE compute_sim_clock SET ts = ts WHERE id = $1", &[&1i32]).await.unwrap_err();
    assert_eq!(e.code(), Some(&tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION));
    drop(r);
    // Its rollback ran before the connection went back: the next one is not in a failed transaction.
    let v: i64 = better_compute_db::pool::read_tx(&pool).await.unwrap().query_one("SELECT $1::int8", &[&3i64]).await.unwrap().get(0);
    assert_eq!(v, 3);
}

#[tokio::test]
async fn a_read_cancelled_while_its_begin_is_in_flight_never_returns_its_connection_inside_the_transaction() {
    let db = TestDb::core().await;
    // One connection, so the next checkout gets the very connection the cancelled read held.
    let pool = better_compute_db::pool::connect_pool(db.connection_string(), 1).unwrap();
    drop(pool.get().await.unwrap());
    for round in 0..20 {
        // The read is polled once: the checkout is ready, BEGIN is sent, the answer is not in yet,
        // and the future is dropped there, as a cut client's stream drops it.
        let mut read = Box::pin(better_compute_db::pool::read_tx(&pool));
        let pending = std::future::poll_fn(|cx| std::task::Poll::Ready(read.as_mut().poll(cx).is_pending())).await;
        assert!(pending, "round {round}: the read finished within its first poll");
        drop(read);
        let c = within("the next checkout", pool.get()).await.unwrap();
        let read_only: String = c.query_one("SELECT current_setting('transaction_read_only')", &[]).await.unwrap().get(0);
        assert_eq!(read_only, "off", "round {round}: the connection came back inside the cut read's transaction");
        c.execute("UPDATE compute_sim_clock SET ts = ts WHERE id = $1", &[&1i32]).await.unwrap();
    }
}

#[tokio::test]
async fn a_connection_the_server_ends_is_unavailable_and_an_unexpected_error_internal() {
    let db = TestDb::core().await;
    let c = db.connect().await;
    let e = c.query_one("SELECT pg_terminate_backend(pg_backend_pid())", &[]).await.unwrap_err();
    assert_eq!(code(e.into()), ErrorCode::Unavailable);
    let c = db.connect().await;
    let e = c.query_one("SELECT 1 / 0", &[]).await.unwrap_err();
    assert_eq!(code(e.into()), ErrorCode::Internal);
}
