//! Workspace checks: table ownership ([`ownership`]) and, here, the one-clock check: every SQL time
//! comparison must read `compute_now()`, never the database's own clock, so that simulated time
//! governs leases, deadlines and liveness everywhere.
//!
//! [`scan_workspace`] looks in every string literal of every `.rs` file and in every `.sql` file under
//! `crates/*/src` (migrations live there too) for `now()`, `CURRENT_TIMESTAMP`, `LOCALTIMESTAMP`,
//! `transaction_timestamp()`, `statement_timestamp()`, `clock_timestamp()` and their cousins
//! `CURRENT_TIME`, `CURRENT_DATE` and `LOCALTIME`. Exceptions: the migration that defines
//! `compute_now()` (`crates/db/src/sql/clock.sql`), and any line marked `check-sql-now: allow`.

pub mod crate_graph;
pub mod ownership;

use std::path::{Path, PathBuf};

/// The marker that allows a line.
pub const ALLOW_MARKER: &str = "check-sql-now: allow";

/// The one file allowed to read the real clock: it defines `compute_now()`.
pub const CLOCK_FILE: &str = "db/src/sql/clock.sql";

/// A forbidden clock read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The file, relative to the scanned root.
    pub path: PathBuf,
    /// 1-based line.
    pub line: usize,
    /// What was found, as written.
    pub found: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}:{}: `{}` reads the database's own clock; use compute_now() (or mark the line `{ALLOW_MARKER}`)",
            self.path.display(),
            self.line,
            self.found
        )
    }
}

/// Function-call forms: the name, then optional spaces, then `(`.
const CALLS: &[&str] = &["now", "transaction_timestamp", "statement_timestamp", "clock_timestamp"];
/// Keyword forms, matched as whole words.
const KEYWORDS: &[&str] = &["current_timestamp", "localtimestamp", "current_time", "current_date", "localtime"]; // check-sql-now: allow (the names this check looks for)

fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Finds forbidden forms in `text`; returns (byte offset, what was found).
pub fn find_clock_reads(text: &str) -> Vec<(usize, String)> {
    let lower = text.to_ascii_lowercase();
    let bytes = lower.as_bytes();
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if !is_word(bytes[i]) || (i > 0 && is_word(bytes[i - 1])) {
            i += 1;
            continue;
        }
        let mut end = i;
        while end < bytes.len() && is_word(bytes[end]) {
            end += 1;
        }
        let word = &lower[i..end];
        let mut after = end;
        while after < bytes.len() && bytes[after].is_ascii_whitespace() {
            after += 1;
        }
        let is_call = after < bytes.len() && bytes[after] == b'(';
        if (CALLS.contains(&word) && is_call) || KEYWORDS.contains(&word) {
            let shown_end = if is_call {
                // Show `now()` whole when the parentheses are empty.
                let mut close = after + 1;
                while close < bytes.len() && bytes[close].is_ascii_whitespace() {
                    close += 1;
                }
                if close < bytes.len() && bytes[close] == b')' { close + 1 } else { after + 1 }
            } else {
                end
            };
            found.push((i, text[i..shown_end].to_owned()));
        }
        i = end;
    }
    found
}

/// The byte spans of string literals in Rust source (normal, raw, byte and C strings); comments and
/// char literals are skipped.
pub fn rust_string_spans(src: &str) -> Vec<(usize, usize)> {
    let b = src.as_bytes();
    let mut spans = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let prev_is_word = i > 0 && is_word(b[i - 1]);
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 1;
            i += 2;
            while i < b.len() && depth > 0 {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                } else {
                    i += 1;
                }
            }
        } else if !prev_is_word && (c == b'r' || ((c == b'b' || c == b'c') && b.get(i + 1) == Some(&b'r'))) {
            // A raw string: r"…", r#"…"#, br"…", cr#"…"#; anything else is an identifier.
            let mut j = if c == b'r' { i + 1 } else { i + 2 };
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) == Some(&b'"') {
                let start = j + 1;
                let mut k = start;
                loop {
                    if k >= b.len() {
                        break;
                    }
                    if b[k] == b'"' && b[k + 1..].iter().take(hashes).filter(|&&h| h == b'#').count() == hashes {
                        break;
                    }
                    k += 1;
                }
                spans.push((start, k.min(b.len())));
                i = k + 1 + hashes;
            } else {
                i += 1;
                while i < b.len() && is_word(b[i]) {
                    i += 1;
                }
            }
        } else if c == b'"' {
            let start = i + 1;
            let mut k = start;
            while k < b.len() && b[k] != b'"' {
                k += if b[k] == b'\\' { 2 } else { 1 };
            }
            let end = k.min(b.len());
            spans.push((start, end));
            i = end + 1;
        } else if c == b'\'' {
            // A char literal ('"', '\'', '\u{1F600}') or a lifetime ('a).
            if b.get(i + 1) == Some(&b'\\') {
                let mut k = i + 2;
                while k < b.len() && b[k] != b'\'' {
                    k += 1;
                }
                i = k + 1;
            } else if let Some(ch) = src[i + 1..].chars().next() {
                let after = i + 1 + ch.len_utf8();
                i = if b.get(after) == Some(&b'\'') { after + 1 } else { i + 1 };
            } else {
                i += 1;
            }
        } else if is_word(c) {
            while i < b.len() && is_word(b[i]) {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    spans
}

pub(crate) fn line_of(src: &str, offset: usize) -> usize {
    src[..offset].bytes().filter(|&b| b == b'\n').count() + 1
}

fn allowed(src: &str, line: usize) -> bool {
    src.lines().nth(line - 1).is_some_and(|l| l.contains(ALLOW_MARKER))
}

/// Scans Rust source: string literals only.
pub fn scan_rust(path: &Path, src: &str) -> Vec<Violation> {
    let mut out = Vec::new();
    for (start, end) in rust_string_spans(src) {
        for (off, found) in find_clock_reads(&src[start..end]) {
            let line = line_of(src, start + off);
            if !allowed(src, line) {
                out.push(Violation { path: path.to_owned(), line, found });
            }
        }
    }
    out
}

/// Scans a SQL file: all of it.
pub fn scan_sql(path: &Path, src: &str) -> Vec<Violation> {
    if path.to_string_lossy().replace('\\', "/").ends_with(CLOCK_FILE) {
        return Vec::new();
    }
    find_clock_reads(src)
        .into_iter()
        .map(|(off, found)| (line_of(src, off), found))
        .filter(|(line, _)| !allowed(src, *line))
        .map(|(line, found)| Violation { path: path.to_owned(), line, found })
        .collect()
}

pub(crate) fn walk(dir: &Path, files: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            walk(&path, files)?;
        } else if matches!(path.extension().and_then(|e| e.to_str()), Some("rs" | "sql")) {
            files.push(path);
        }
    }
    Ok(())
}

/// Scans `root/crates/*/src` (and `root/crates/*/migrations`, if a crate keeps them beside `src`).
pub fn scan_workspace(root: &Path) -> std::io::Result<Vec<Violation>> {
    let mut files = Vec::new();
    for krate in std::fs::read_dir(root.join("crates"))? {
        let krate = krate?.path();
        for sub in ["src", "migrations"] {
            let dir = krate.join(sub);
            if dir.is_dir() {
                walk(&dir, &mut files)?;
            }
        }
    }
    files.sort();
    let mut out = Vec::new();
    for file in files {
        let src = std::fs::read_to_string(&file)?;
        let rel = file.strip_prefix(root).unwrap_or(&file).to_owned();
        if file.extension().is_some_and(|e| e == "rs") {
            out.extend(scan_rust(&rel, &src));
        } else {
            out.extend(scan_sql(&rel, &src));
        }
    }
    Ok(out)
}
