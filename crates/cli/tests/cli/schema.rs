//! The checked-in schema snapshot cannot drift from what the migrations make; the binary exports
//! and verifies the audit log of a migrated database.

use std::process::Command;

use better_compute_db::testing::TestDb;

const BIN: &str = env!("CARGO_BIN_EXE_better-compute");

fn run(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(out.status.success(), "better-compute {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migrated_schema_matches_the_checked_in_snapshot() {
    // The foundation from the test support; the binary migrates the rest, as an operator would.
    let db = TestDb::core().await;
    let url = db.connection_string().to_owned();
    let migrated = tokio::task::spawn_blocking(move || {
        let report = run(&["migrate", "--database-url", &url]);
        assert!(report.contains("applied capacity/0001_capacity") && report.contains("applied capacity/placer"), "{report}");
        run(&["schema", "--database-url", &url])
    })
    .await
    .unwrap();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../schema/snapshot.sql");
    if std::env::var_os("UPDATE_SCHEMA_SNAPSHOT").is_some() {
        std::fs::write(&path, &migrated).unwrap();
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(migrated.contains("CREATE TABLE reservations (") && migrated.contains("FUNCTION capacity_place("));
    assert_eq!(
        on_disk, migrated,
        "schema/snapshot.sql differs from a freshly migrated database: if the migration is meant, rewrite it with \
         UPDATE_SCHEMA_SNAPSHOT=1 cargo nextest run -p better-compute the_migrated_schema and commit the diff"
    );
}

/// Runs the binary; its success, stdout and stderr.
fn try_run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_audit_export_verifies_offline_and_a_changed_entry_is_named() {
    let db = TestDb::core().await;
    let url = db.connection_string().to_owned();
    let u = url.clone();
    tokio::task::spawn_blocking(move || run(&["migrate", "--database-url", &u])).await.unwrap();
    // Twelve entries, placed and checkpointed with a key of the test's.
    let signer = better_compute_runtime::signing::CommandSigner::generate();
    let mut c = db.client().await;
    for i in 0..12 {
        let tx = c.transaction().await.unwrap();
        let target = format!("node_{i}");
        let e = better_compute_audit::entry::NewEntry {
            actor: better_compute_audit::entry::EntryActor::Job("health"),
            tenant_id: None,
            action: "health.quarantine",
            target: &target,
            request_id: None,
            source: None,
            outcome: better_compute_audit::entry::Outcome::Ok,
            request_digest: None,
        };
        better_compute_audit::entry::record(&*tx, &e).await.unwrap();
        tx.commit().await.unwrap();
    }
    let tx = c.transaction().await.unwrap();
    let placed = better_compute_audit::checkpoint::place(&*tx, 1000, Some(&signer)).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(placed.tree_size, 12);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("audit.jsonl");
    let key = hex::encode(signer.public_key());
    let (f, k, u) = (file.to_str().unwrap().to_owned(), key.clone(), url.clone());
    let (exported, verified, wrong_key) = tokio::task::spawn_blocking(move || {
        (try_run(&["audit", "export", "--database-url", &u, "--out", &f]), try_run(&["audit", "verify", &f, "--public-key", &k]), try_run(&["audit", "verify", &f, "--public-key", &"00".repeat(32)]))
    })
    .await
    .unwrap();
    assert!(exported.0 && exported.2.contains("exported 12 entries"), "{exported:?}");
    assert_eq!(std::fs::read_to_string(&file).unwrap().lines().count(), 14, "12 entries, their checkpoint and the end line");
    assert!(verified.0 && verified.1.contains("ok: complete up to log index 12: 12 entries chained, 1 checkpoints"), "{verified:?}");
    // Cut short, the file is not taken as the whole log.
    let text = std::fs::read_to_string(&file).unwrap();
    let cut = dir.path().join("cut.jsonl");
    std::fs::write(&cut, text.lines().take(13).collect::<Vec<_>>().join("\n")).unwrap();
    let (c_file, k) = (cut.to_str().unwrap().to_owned(), key.clone());
    let short = tokio::task::spawn_blocking(move || try_run(&["audit", "verify", &c_file, "--public-key", &k])).await.unwrap();
    assert!(!short.0 && short.2.contains("cut short"), "{short:?}");
    assert!(!wrong_key.0 && wrong_key.2.contains("not the trusted key"), "{wrong_key:?}");
    // An owner of the database edits an entry: the export no longer verifies, and says which.
    c.batch_execute("ALTER TABLE audit_entries DISABLE TRIGGER audit_entries_append_only; UPDATE audit_entries SET target = 'node_x' WHERE log_index = 4").await.unwrap();
    let id: String = c.query_one("SELECT id FROM audit_entries WHERE log_index = 4", &[]).await.unwrap().get(0);
    let (f, u) = (file.to_str().unwrap().to_owned(), url.clone());
    let tampered = tokio::task::spawn_blocking(move || {
        assert!(try_run(&["audit", "export", "--database-url", &u, "--out", &f]).0);
        try_run(&["audit", "verify", &f, "--public-key", &key])
    })
    .await
    .unwrap();
    assert!(!tampered.0 && tampered.2.contains(&id) && tampered.2.contains("4 entries and 0 checkpoints verified before it"), "{tampered:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_allows_exactly_the_transitions_of_every_state_table() {
    use better_compute_core::state::GUARDED_COLUMNS;
    let db = TestDb::core().await;
    let url = db.connection_string().to_owned();
    tokio::task::spawn_blocking(move || run(&["migrate", "--database-url", &url])).await.unwrap();
    let c = db.client().await;
    let mut checked = 0;
    for g in GUARDED_COLUMNS {
        let trigger: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_trigger WHERE tgrelid = $1::text::regclass AND tgfoid = $2::text::regprocedure AND tgenabled = 'O'",
                &[&g.table, &format!("{}_{}_guard()", g.table, g.column)],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(trigger, 1, "{}.{} has no enabled guard", g.table, g.column);
        let may_become = format!("SELECT {}_{}_may_become($1, $2)", g.table, g.column);
        for from in g.states.state_names() {
            for to in g.states.state_names() {
                let allowed: bool = c.query_one(&may_become, &[&from, &to]).await.unwrap().get(0);
                assert_eq!(allowed, g.states.allows_names(from, to), "{}.{}: {from} -> {to}", g.table, g.column);
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 6 * 6 + 7 * 7 + 4 * 4 + 5 * 5 + 6 * 6 + 7 * 7 + 8 * 8);
}
