//! Pokes follow the commit: only the work queue sends notifications (`work_queue::notify`,
//! `notify_many`, `AfterCommit`), over connections outside a transaction. A `pg_notify` anywhere
//! else is a NOTIFY inside some transaction, which takes the database's one notification lock at
//! commit.

use std::path::{Path, PathBuf};

const SENDER: &str = "crates/runtime/src/work_queue.rs";

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs" || x == "sql") {
            out.push(p);
        }
    }
}

#[test]
fn only_the_work_queue_sends_notifications() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap();
    let mut all = Vec::new();
    for krate in std::fs::read_dir(root.join("crates")).unwrap().flatten() {
        if krate.path().join("src").is_dir() {
            files(&krate.path().join("src"), &mut all);
        }
    }
    let mut senders: Vec<String> = all
        .iter()
        .filter(|p| std::fs::read_to_string(p).unwrap().to_ascii_lowercase().contains("pg_notify"))
        .map(|p| p.strip_prefix(&root).unwrap().display().to_string())
        .collect();
    senders.sort();
    assert!(all.len() > 100, "the scan found only {} files", all.len());
    assert_eq!(senders, [SENDER], "pg_notify outside the work queue");
}
