//! Each table is written only by the module that owns it, or by a write listed with its reason.

use std::path::PathBuf;

use better_compute_checks::ownership::{cross_module_writes, edge_table_uses, table_owners, SANCTIONED};

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn no_module_writes_another_modules_table_outside_the_sanctioned_list() {
    let root = workspace_root();
    let owners = table_owners(&root).unwrap();
    // The scan really looked: every module's tables were found, with their owners.
    assert_eq!(owners.get("reservations").map(String::as_str), Some("capacity"));
    assert_eq!(owners.get("nodes").map(String::as_str), Some("nodes"));
    assert_eq!(owners.get("work_queue").map(String::as_str), Some("runtime"));
    assert_eq!(owners.get("schema_migrations").map(String::as_str), Some("db"));
    assert!(owners.len() >= 35, "{owners:?}");
    let found: Vec<String> = cross_module_writes(&root).unwrap().iter().map(|w| w.to_string()).collect();
    assert!(found.is_empty(), "writes across a module's line:\n{}", found.join("\n"));
}

#[test]
fn a_planted_write_to_another_modules_table_is_caught_and_a_sanctioned_one_is_not() {
    let root = std::env::temp_dir().join(format!("bc-owners-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for (krate, file, text) in [
        ("owner", "src/migrations/owner/0001_owner.sql", "CREATE TABLE owned (a int);\nCREATE TABLE IF NOT EXISTS other (b int);\n"),
        ("owner", "src/lib.rs", "fn f() { let _ = \"UPDATE owned SET a = 1\"; }\n"),
        // A comment names the table but writes nothing; the string below it does.
        ("thief", "src/lib.rs", "// UPDATE owned is the owner's\nfn g() {\n    let _ = \"INSERT INTO public.owned (a) VALUES (1)\";\n}\n"),
        ("thief", "src/sql/steal.sql", "-- DELETE FROM owned\nCREATE OR REPLACE TRIGGER t AFTER UPDATE OF b ON other FOR EACH ROW EXECUTE FUNCTION f();\n"),
        ("runtime", "src/lib.rs", "fn h() { let _ = \"UPDATE owned SET a = 2\"; }\n"),
    ] {
        let path = root.join("crates").join(krate).join(file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    let found = cross_module_writes(&root).unwrap();
    let seen: Vec<(String, usize, String)> =
        found.iter().map(|w| (w.path.to_string_lossy().into_owned(), w.line, w.table.clone())).collect();
    // runtime's write is not sanctioned for `owned` either: only the listed (crate, table) pairs are.
    assert!(!SANCTIONED.iter().any(|(w, t, _)| *w == "runtime" && *t == "owned"));
    assert_eq!(
        seen,
        [
            ("crates/runtime/src/lib.rs".to_owned(), 1, "owned".to_owned()),
            ("crates/thief/src/lib.rs".to_owned(), 3, "owned".to_owned()),
            ("crates/thief/src/sql/steal.sql".to_owned(), 2, "other".to_owned()),
        ]
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn the_cli_names_no_modules_table_and_reads_through_the_owners_functions() {
    let found: Vec<String> = edge_table_uses(&workspace_root()).unwrap().iter().map(|w| w.to_string()).collect();
    assert!(found.is_empty(), "the CLI's own SQL over module tables:\n{}", found.join("\n"));
}

#[test]
fn a_planted_read_of_a_modules_table_in_the_cli_is_caught() {
    let root = std::env::temp_dir().join(format!("bc-edge-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for (krate, file, text) in [
        ("owner", "src/migrations/owner/0001_owner.sql", "CREATE TABLE owned (a int);\n"),
        ("owner", "src/lib.rs", "fn f() { let _ = \"SELECT a FROM owned\"; }\n"),
        ("cli", "src/lib.rs", "fn g() {\n    let _ = \"SELECT 1 FROM pg_database\";\n    let _ = \"SELECT o.a FROM x JOIN owned o ON true\";\n}\n"),
    ] {
        let path = root.join("crates").join(krate).join(file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    let seen: Vec<(String, usize, String)> =
        edge_table_uses(&root).unwrap().iter().map(|w| (w.path.to_string_lossy().into_owned(), w.line, w.table.clone())).collect();
    assert_eq!(seen, [("crates/cli/src/lib.rs".to_owned(), 3, "owned".to_owned())]);
    let _ = std::fs::remove_dir_all(&root);
}
