//! The crate graph is a list with reasons: `cargo metadata` shows exactly the edges of
//! `crate_graph::EDGES`, and docs/architecture.md draws them.

use std::collections::BTreeSet;
use std::path::Path;

use better_compute_checks::crate_graph::{diagram, BEGIN_MARKER, EDGES, END_MARKER};

const PREFIX: &str = "better-compute-";

fn short(name: &str) -> String {
    if name == "better-compute" { "cli".to_owned() } else { name.strip_prefix(PREFIX).unwrap_or(name).to_owned() }
}

/// Every (crate, dependency) between workspace crates, from `cargo metadata`: normal and build
/// dependencies, optional ones too.
fn edges_in_the_workspace() -> BTreeSet<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(&root)
        .output()
        .unwrap();
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let m: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut edges = BTreeSet::new();
    for p in m["packages"].as_array().unwrap() {
        for d in p["dependencies"].as_array().unwrap() {
            let dep = d["name"].as_str().unwrap();
            if (dep == "better-compute" || dep.starts_with(PREFIX)) && d["kind"].as_str() != Some("dev") {
                edges.insert((short(p["name"].as_str().unwrap()), short(dep)));
            }
        }
    }
    edges
}

#[test]
fn every_dependency_between_workspace_crates_is_listed_with_its_reason() {
    let found = edges_in_the_workspace();
    assert!(found.len() > 50, "only {} edges found", found.len());
    let listed: BTreeSet<(String, String)> = EDGES.iter().map(|(a, b, _)| (a.to_string(), b.to_string())).collect();
    assert_eq!(listed.len(), EDGES.len(), "an edge is listed twice");
    let unlisted: Vec<_> = found.difference(&listed).collect();
    assert!(unlisted.is_empty(), "add these to crates/checks/src/crate_graph.rs with why (or remove the dependency): {unlisted:?}");
    let gone: Vec<_> = listed.difference(&found).collect();
    assert!(gone.is_empty(), "these are listed but no longer dependencies; remove them: {gone:?}");
    assert!(EDGES.iter().all(|(_, _, why)| !why.trim().is_empty()), "every edge says why");
}

#[test]
fn the_architecture_page_draws_the_crate_graph() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/architecture.md");
    let page = std::fs::read_to_string(&file).unwrap();
    let (before, rest) = page.split_once(&format!("{BEGIN_MARKER}\n")).expect("docs/architecture.md lacks the crate graph's begin marker");
    let (drawn, after) = rest.split_once(&format!("{END_MARKER}\n")).expect("docs/architecture.md lacks the crate graph's end marker");
    let want = diagram(EDGES);
    if std::env::var_os("UPDATE_CRATE_GRAPH").is_some() {
        std::fs::write(&file, format!("{before}{BEGIN_MARKER}\n{want}{END_MARKER}\n{after}")).unwrap();
        return;
    }
    assert_eq!(drawn, want, "docs/architecture.md's crate graph drifted; rewrite it: UPDATE_CRATE_GRAPH=1 cargo nextest run -p better-compute-checks");
    assert!(drawn.contains("capacity --> nodes"));
}
