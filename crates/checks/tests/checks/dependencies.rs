//! Every dependency's version is declared once, in the workspace's `[workspace.dependencies]`.

use std::path::PathBuf;

#[test]
fn every_crate_takes_its_dependencies_from_the_workspace() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut seen = 0;
    let mut local = Vec::new();
    for krate in std::fs::read_dir(root.join("crates")).unwrap() {
        let manifest = krate.unwrap().path().join("Cargo.toml");
        let Ok(text) = std::fs::read_to_string(&manifest) else { continue };
        let mut section = String::new();
        for line in text.lines() {
            let line = line.trim();
            if line.starts_with('[') {
                section = line.to_owned();
            } else if section.ends_with("dependencies]") && !line.is_empty() && !line.starts_with('#') {
                seen += 1;
                let (name, spec) = line.split_once('=').unwrap_or((line, ""));
                if !name.trim().ends_with(".workspace") && !spec.contains("workspace = true") {
                    local.push(format!("{}: {line}", manifest.display()));
                }
            }
        }
    }
    assert!(seen > 100, "only {seen} dependency lines found");
    assert!(local.is_empty(), "declare these in [workspace.dependencies] and use `name.workspace = true`:\n{}", local.join("\n"));
}
