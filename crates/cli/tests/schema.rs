//! The checked-in schema snapshot cannot drift from what the migrations make.

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
