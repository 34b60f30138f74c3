//! The table-ownership check: each table has one owning module (the crate whose migration creates
//! it), and only that crate's Rust or SQL writes it. Another crate goes through the owner's
//! functions. The few writes across that line that are meant are listed in [`SANCTIONED`], each with
//! its reason.
//!
//! A write is `INSERT INTO t`, `UPDATE t`, `DELETE FROM t`, `TRUNCATE t`, `ALTER TABLE t`, and an
//! index or trigger created `ON t`, found in every `.sql` file under `crates/*/src` (comments
//! skipped) and in every string literal of every `.rs` file there. Tables are found by the
//! `CREATE TABLE` statements in the same places.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::{line_of, rust_string_spans, walk};

/// Writes across a module's line that are meant: (writing crate, table, why).
pub const SANCTIONED: &[(&str, &str, &str)] = &[
    ("runtime", "nodes", "the nodespec controller stores the merge of every module's parts in nodes.spec and moves nodes.generation"),
    ("capacity", "nodes", "the index nodes_labels for placement by selector, and the triggers nodes_open_counts (keeps node_atom_counts.open), nodes_resources (makes a new node's node_resources row) and nodes_usable_resources (the node's usable resources follow its daemon's reports)"),
    ("bench", "*", "the benchmarks seed fleets, tenants and quotas in bulk and set up each run's state directly, faster than through the owners"),
];

/// A write to another module's table that is not sanctioned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrossWrite {
    /// The file, relative to the scanned root.
    pub path: PathBuf,
    /// 1-based line.
    pub line: usize,
    /// The crate that writes.
    pub writer: String,
    /// The table written.
    pub table: String,
    /// The crate that owns it.
    pub owner: String,
}

impl std::fmt::Display for CrossWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}:{}: crate `{}` writes `{}`, which crate `{}` owns; call the owner's functions (or list the write in checks::ownership::SANCTIONED with its reason)",
            self.path.display(),
            self.line,
            self.writer,
            self.table,
            self.owner
        )
    }
}

/// SQL text with `--` comments blanked out (offsets kept).
fn without_comments(sql: &str) -> String {
    sql.lines()
        .map(|l| match l.find("--") {
            Some(i) => format!("{}{}", &l[..i], " ".repeat(l.len() - i)),
            None => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The words of `text` (lower-cased) with their byte offsets; `public.` prefixes dropped.
fn words(text: &str) -> Vec<(usize, String)> {
    let lower = text.to_ascii_lowercase();
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in lower.char_indices().chain(std::iter::once((lower.len(), ' '))) {
        let word = c.is_ascii_alphanumeric() || c == '_';
        match (word, start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                let w = &lower[s..i];
                if w != "public" {
                    out.push((s, w.to_owned()));
                }
                start = None;
            }
            _ => {}
        }
    }
    out
}

/// The tables `text` creates: (offset, table).
fn creates(text: &str) -> Vec<(usize, String)> {
    let w = words(text);
    let mut out = Vec::new();
    for i in 0..w.len() {
        if w[i].1 == "create" && w.get(i + 1).is_some_and(|x| x.1 == "table") {
            let mut j = i + 2;
            if w.get(j).is_some_and(|x| x.1 == "if") {
                j += 3;
            }
            if let Some((off, t)) = w.get(j) {
                out.push((*off, t.clone()));
            }
        }
    }
    out
}

/// The tables `text` writes: (offset, table). Words that name no table are returned too; the
/// caller keeps the tables it knows.
fn writes(text: &str) -> Vec<(usize, String)> {
    let w = words(text);
    let at = |i: usize| w.get(i).map(|x| x.1.as_str()).unwrap_or("");
    let mut out = Vec::new();
    for i in 0..w.len() {
        let target = match at(i) {
            "insert" if at(i + 1) == "into" => Some(i + 2),
            "delete" if at(i + 1) == "from" => Some(i + 2),
            "update" | "truncate" => Some(i + 1),
            "alter" if at(i + 1) == "table" => Some(if at(i + 2) == "only" { i + 3 } else { i + 2 }),
            // CREATE [UNIQUE] INDEX name ON t, CREATE [OR REPLACE] TRIGGER name … ON t.
            "index" | "trigger" if at(i.wrapping_sub(1)) == "create" || at(i.wrapping_sub(1)) == "unique" || at(i.wrapping_sub(1)) == "replace" => {
                (i + 1..(i + 40).min(w.len())).find(|&j| at(j) == "on").map(|j| j + 1)
            }
            _ => None,
        };
        if let Some((off, t)) = target.and_then(|j| w.get(j)) {
            out.push((*off, t.clone()));
        }
    }
    out
}

/// The crate a workspace path belongs to: `crates/<crate>/…`.
fn crate_of(rel: &Path) -> Option<String> {
    let mut parts = rel.components();
    (parts.next()?.as_os_str() == "crates").then_some(())?;
    Some(parts.next()?.as_os_str().to_string_lossy().into_owned())
}

/// The SQL pieces of a file: the whole of a `.sql` file without comments, the string literals of a
/// `.rs` file. Each as (offset in the file, text).
fn sql_pieces(path: &Path, src: &str) -> Vec<(usize, String)> {
    if path.extension().is_some_and(|e| e == "sql") {
        vec![(0, without_comments(src))]
    } else {
        rust_string_spans(src).into_iter().map(|(s, e)| (s, src[s..e].to_owned())).collect()
    }
}

fn files(root: &Path) -> std::io::Result<Vec<(PathBuf, String)>> {
    let mut files = Vec::new();
    for krate in std::fs::read_dir(root.join("crates"))? {
        let dir = krate?.path().join("src");
        if dir.is_dir() {
            walk(&dir, &mut files)?;
        }
    }
    files.sort();
    files
        .into_iter()
        .map(|f| {
            let src = std::fs::read_to_string(&f)?;
            Ok((f.strip_prefix(root).unwrap_or(&f).to_owned(), src))
        })
        .collect()
}

/// Every table of the workspace and the crate that creates it.
pub fn table_owners(root: &Path) -> std::io::Result<BTreeMap<String, String>> {
    let mut owners = BTreeMap::new();
    for (rel, src) in files(root)? {
        let Some(krate) = crate_of(&rel) else { continue };
        for (_, piece) in sql_pieces(&rel, &src) {
            for (_, table) in creates(&piece) {
                owners.entry(table).or_insert_with(|| krate.clone());
            }
        }
    }
    Ok(owners)
}

/// Every write of the workspace to a table another crate owns, less the [`SANCTIONED`] ones.
pub fn cross_module_writes(root: &Path) -> std::io::Result<Vec<CrossWrite>> {
    let owners = table_owners(root)?;
    let mut out = Vec::new();
    for (rel, src) in files(root)? {
        let Some(writer) = crate_of(&rel) else { continue };
        for (start, piece) in sql_pieces(&rel, &src) {
            for (off, table) in writes(&piece) {
                let Some(owner) = owners.get(&table) else { continue };
                let sanctioned = SANCTIONED.iter().any(|(w, t, _)| *w == writer && (*t == table || *t == "*"));
                if *owner != writer && !sanctioned {
                    out.push(CrossWrite { path: rel.clone(), line: line_of(&src, start + off), writer: writer.clone(), table, owner: owner.clone() });
                }
            }
        }
    }
    Ok(out)
}

/// The crates at the system's edge that read modules' tables only through the owners' functions:
/// their SQL names no module table at all.
pub const EDGE_CRATES: &[&str] = &["cli"];

/// The tables `text` reads or writes by name after `FROM` or `JOIN`: (offset, table), words that
/// name no table included.
fn reads(text: &str) -> Vec<(usize, String)> {
    let w = words(text);
    w.iter().zip(w.iter().skip(1)).filter(|(a, _)| a.1 == "from" || a.1 == "join").map(|(_, t)| t.clone()).collect()
}

/// Every place an [`EDGE_CRATES`] crate's SQL names a module's table (read or written).
pub fn edge_table_uses(root: &Path) -> std::io::Result<Vec<CrossWrite>> {
    let owners = table_owners(root)?;
    let mut out = Vec::new();
    for (rel, src) in files(root)? {
        let Some(writer) = crate_of(&rel).filter(|c| EDGE_CRATES.contains(&c.as_str())) else { continue };
        for (start, piece) in sql_pieces(&rel, &src) {
            for (off, table) in reads(&piece).into_iter().chain(writes(&piece)) {
                if let Some(owner) = owners.get(&table) {
                    out.push(CrossWrite { path: rel.clone(), line: line_of(&src, start + off), writer: writer.clone(), table, owner: owner.clone() });
                }
            }
        }
    }
    Ok(out)
}
