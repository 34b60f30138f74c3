//! The workspace reads one clock: no SQL in `crates/*/src` calls `now()` or its cousins.

use std::path::{Path, PathBuf};

use better_compute_checks::scan_workspace;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

#[test]
fn no_sql_in_the_workspace_reads_the_databases_own_clock() {
    let root = workspace_root();
    let violations = scan_workspace(&root).unwrap();
    let report: Vec<String> = violations.iter().map(|v| v.to_string()).collect();
    assert!(violations.is_empty(), "SQL must read compute_now():\n{}", report.join("\n"));
    // The scan really looked: the clock file and this crate's own sources exist.
    assert!(root.join("crates/db/src/sql/clock.sql").is_file());
}

#[test]
fn the_scanner_catches_a_planted_violation_in_a_workspace() {
    let root = std::env::temp_dir().join(format!("bc-planted-{}", std::process::id()));
    let src = root.join("crates/planted/src");
    std::fs::create_dir_all(src.join("migrations/planted")).unwrap();
    std::fs::write(
        src.join("lib.rs"),
        "pub const Q: &str = \"SELECT 1\";\npub const LEASE: &str = \"UPDATE leases SET expires_at = now() + interval '15 s'\";\n",
    )
    .unwrap();
    std::fs::write(src.join("migrations/planted/0001_t.sql"), "CREATE TABLE t (at timestamptz DEFAULT CURRENT_TIMESTAMP);\n")
        .unwrap();
    let found: Vec<(String, usize, String)> = scan_workspace(&root)
        .unwrap()
        .into_iter()
        .map(|v| (v.path.display().to_string(), v.line, v.found))
        .collect();
    std::fs::remove_dir_all(&root).unwrap();
    assert_eq!(
        found,
        [
            ("crates/planted/src/lib.rs".to_owned(), 2, "now()".to_owned()),
            ("crates/planted/src/migrations/planted/0001_t.sql".to_owned(), 1, "CURRENT_TIMESTAMP".to_owned()),
        ]
    );
}
