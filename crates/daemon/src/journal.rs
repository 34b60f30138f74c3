//! The daemon's journal on local disk (redb): its own journal id, every command it accepted and
//! the outcome, the desired state it last applied, and the layout last applied to each GPU. Written (and synced) before a command is
//! acknowledged, so a command that is not retry-safe never runs twice, also across a daemon restart.
//! A wiped journal gets a new id, and the control plane then fails the node's in-flight commands
//! that are not retry-safe with `journal-lost` instead of sending them again.

use std::path::Path;

use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use serde::{Deserialize, Serialize};

const META: TableDefinition<&str, &str> = TableDefinition::new("meta");
const COMMANDS: TableDefinition<&str, &[u8]> = TableDefinition::new("commands");
const SPEC: TableDefinition<&str, &[u8]> = TableDefinition::new("spec");
/// Key in SPEC of the GPUs' last applied layouts (a protobuf `GpusSection`).
const LAYOUTS_KEY: &str = "gpu_layouts";
/// Finished commands kept; older ones are pruned.
pub const KEEP_COMMANDS: u64 = 10_000;

/// Why the journal failed.
#[derive(Debug, thiserror::Error)]
#[error("journal: {0}")]
pub struct JournalError(String);

fn err(e: impl std::fmt::Display) -> JournalError {
    JournalError(e.to_string())
}

/// How a command ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    /// Whether it succeeded.
    pub succeeded: bool,
    /// Why not.
    pub reason: String,
    /// The kind's report, JSON.
    pub result_json: String,
}

/// A command the daemon accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Its kind.
    pub kind: String,
    /// Its seq on the node.
    pub seq: i64,
    /// Safe to run twice.
    pub retry_safe: bool,
    /// The daemon run (process) that accepted it.
    pub run_id: String,
    /// Its outcome, once it ended.
    pub outcome: Option<Outcome>,
}

/// The journal.
pub struct Journal {
    db: Database,
    id: String,
}

fn new_id() -> String {
    let mut b = [0u8; 12];
    getrandom::fill(&mut b).expect("the operating system's random source works");
    format!("jnl_{}", hex::encode(b))
}

impl Journal {
    /// Opens the journal at `path`, creating it (with a new id) if it is not there. A journal in
    /// redb 2's file format is upgraded in place first, keeping its id and entries.
    pub fn open(path: &Path) -> Result<Journal, JournalError> {
        let db = match Database::create(path) {
            Err(redb::DatabaseError::UpgradeRequired(_)) => {
                upgrade_v2(path)?;
                Database::create(path).map_err(err)?
            }
            other => other.map_err(err)?,
        };
        let w = db.begin_write().map_err(err)?;
        let id = {
            let mut meta = w.open_table(META).map_err(err)?;
            let existing = meta.get("journal_id").map_err(err)?.map(|v| v.value().to_owned());
            match existing {
                Some(id) => id,
                None => {
                    let id = new_id();
                    meta.insert("journal_id", id.as_str()).map_err(err)?;
                    id
                }
            }
        };
        w.open_table(COMMANDS).map_err(err)?;
        w.open_table(SPEC).map_err(err)?;
        w.commit().map_err(err)?;
        Ok(Journal { db, id })
    }

    /// The journal's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The command's entry, if it was ever accepted here.
    pub fn get(&self, command_id: &str) -> Result<Option<Entry>, JournalError> {
        let r = self.db.begin_read().map_err(err)?;
        let t = r.open_table(COMMANDS).map_err(err)?;
        match t.get(command_id).map_err(err)? {
            Some(v) => Ok(Some(serde_json::from_slice(v.value()).map_err(err)?)),
            None => Ok(None),
        }
    }

    fn put(&self, command_id: &str, e: &Entry) -> Result<(), JournalError> {
        let bytes = serde_json::to_vec(e).map_err(err)?;
        let w = self.db.begin_write().map_err(err)?;
        {
            let mut t = w.open_table(COMMANDS).map_err(err)?;
            t.insert(command_id, bytes.as_slice()).map_err(err)?;
            if t.len().map_err(err)? > KEEP_COMMANDS + KEEP_COMMANDS / 10 {
                prune(&mut t)?;
            }
        }
        // Durable before the daemon acknowledges or reports.
        w.commit().map_err(err)
    }

    /// Records that the command was accepted (before it runs).
    pub fn accept(&self, command_id: &str, kind: &str, seq: i64, retry_safe: bool, run_id: &str) -> Result<(), JournalError> {
        self.put(command_id, &Entry { kind: kind.to_owned(), seq, retry_safe, run_id: run_id.to_owned(), outcome: None })
    }

    /// Records how the command ended.
    pub fn finish(&self, command_id: &str, outcome: Outcome) -> Result<(), JournalError> {
        let mut e = self.get(command_id)?.ok_or_else(|| JournalError(format!("{command_id} was never accepted")))?;
        e.outcome = Some(outcome);
        self.put(command_id, &e)
    }

    /// The desired state last applied: (generation, protobuf NodeSpec).
    pub fn applied_spec(&self) -> Result<Option<(i64, Vec<u8>)>, JournalError> {
        let r = self.db.begin_read().map_err(err)?;
        let t = r.open_table(SPEC).map_err(err)?;
        let Some(v) = t.get("applied").map_err(err)? else { return Ok(None) };
        let bytes = v.value();
        if bytes.len() < 8 {
            return Ok(None);
        }
        let generation = i64::from_be_bytes(bytes[..8].try_into().expect("8 bytes"));
        Ok(Some((generation, bytes[8..].to_vec())))
    }

    /// Records the desired state applied.
    pub fn set_applied_spec(&self, generation: i64, spec: &[u8]) -> Result<(), JournalError> {
        let mut bytes = generation.to_be_bytes().to_vec();
        bytes.extend_from_slice(spec);
        let w = self.db.begin_write().map_err(err)?;
        w.open_table(SPEC).map_err(err)?.insert("applied", bytes.as_slice()).map_err(err)?;
        w.commit().map_err(err)
    }

    /// The layout last applied to each GPU (protobuf `GpusSection`), if any was recorded.
    pub fn gpu_layouts(&self) -> Result<Option<Vec<u8>>, JournalError> {
        let r = self.db.begin_read().map_err(err)?;
        let t = r.open_table(SPEC).map_err(err)?;
        Ok(t.get(LAYOUTS_KEY).map_err(err)?.map(|v| v.value().to_vec()))
    }

    /// Records the layout last applied to each GPU.
    pub fn set_gpu_layouts(&self, layouts: &[u8]) -> Result<(), JournalError> {
        let w = self.db.begin_write().map_err(err)?;
        w.open_table(SPEC).map_err(err)?.insert(LAYOUTS_KEY, layouts).map_err(err)?;
        w.commit().map_err(err)
    }
}

/// Rewrites a journal written by redb 2 (file format v2) in the v3 format that redb 3 and later
/// read. Only redb 2.6 can do it, so that version stays a dependency while a daemon may find such a
/// journal.
fn upgrade_v2(path: &Path) -> Result<(), JournalError> {
    let mut old = redb2::Database::open(path).map_err(err)?;
    let upgraded = old.upgrade().map_err(err)?;
    tracing::info!(path = %path.display(), upgraded, "journal upgraded from redb 2's file format");
    Ok(())
}

/// Drops the oldest finished entries (by seq) down to [`KEEP_COMMANDS`].
fn prune(t: &mut redb::Table<'_, &str, &[u8]>) -> Result<(), JournalError> {
    let mut finished: Vec<(i64, String)> = Vec::new();
    for row in t.iter().map_err(err)? {
        let (k, v) = row.map_err(err)?;
        if let Ok(e) = serde_json::from_slice::<Entry>(v.value())
            && e.outcome.is_some() {
                finished.push((e.seq, k.value().to_owned()));
            }
    }
    finished.sort();
    let excess = (t.len().map_err(err)?).saturating_sub(KEEP_COMMANDS) as usize;
    for (_, k) in finished.into_iter().take(excess) {
        t.remove(k.as_str()).map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_journal_written_in_redb_2s_file_format_opens_with_its_id_and_entries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.redb");
        // As a daemon built on redb 2 wrote it: redb 2 makes v2-format files by default.
        {
            const META2: redb2::TableDefinition<&str, &str> = redb2::TableDefinition::new("meta");
            const COMMANDS2: redb2::TableDefinition<&str, &[u8]> = redb2::TableDefinition::new("commands");
            let db = redb2::Database::create(&path).unwrap();
            let w = db.begin_write().unwrap();
            w.open_table(META2).unwrap().insert("journal_id", "jnl_old").unwrap();
            let entry = Entry { kind: "node.reboot".into(), seq: 7, retry_safe: false, run_id: "run-old".into(), outcome: None };
            w.open_table(COMMANDS2).unwrap().insert("cmd_old", serde_json::to_vec(&entry).unwrap().as_slice()).unwrap();
            w.commit().unwrap();
        }
        assert!(
            matches!(Database::create(&path), Err(redb::DatabaseError::UpgradeRequired(_))),
            "the file is not in the old format, so this test shows nothing"
        );
        let j = Journal::open(&path).unwrap();
        assert_eq!(j.id(), "jnl_old");
        let e = j.get("cmd_old").unwrap().unwrap();
        assert_eq!((e.kind.as_str(), e.seq, e.retry_safe, e.outcome), ("node.reboot", 7, false, None));
        j.accept("cmd_new", "diag.nvml", 8, true, "run-new").unwrap();
        drop(j);
        let j = Journal::open(&path).unwrap();
        assert_eq!(j.id(), "jnl_old");
        assert_eq!(j.get("cmd_new").unwrap().unwrap().seq, 8);
    }

    #[test]
    fn the_journal_keeps_its_id_and_entries_across_reopening_and_a_wiped_one_gets_a_new_id() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.redb");
        let j = Journal::open(&path).unwrap();
        let id = j.id().to_owned();
        j.accept("cmd_1", "node.reboot", 1, false, "run-a").unwrap();
        j.set_applied_spec(3, b"spec").unwrap();
        drop(j);
        let j = Journal::open(&path).unwrap();
        assert_eq!(j.id(), id);
        assert_eq!(j.get("cmd_1").unwrap().unwrap().outcome, None);
        j.finish("cmd_1", Outcome { succeeded: true, reason: String::new(), result_json: "{}".into() }).unwrap();
        assert!(j.get("cmd_1").unwrap().unwrap().outcome.unwrap().succeeded);
        assert_eq!(j.applied_spec().unwrap(), Some((3, b"spec".to_vec())));
        assert_eq!(j.gpu_layouts().unwrap(), None);
        j.set_gpu_layouts(b"layouts").unwrap();
        drop(j);
        let j = Journal::open(&path).unwrap();
        assert_eq!(j.gpu_layouts().unwrap(), Some(b"layouts".to_vec()));
        assert_eq!(j.applied_spec().unwrap(), Some((3, b"spec".to_vec())));
        drop(j);
        std::fs::remove_file(&path).unwrap();
        let j = Journal::open(&path).unwrap();
        assert_ne!(j.id(), id);
        assert_eq!(j.get("cmd_1").unwrap(), None);
    }
}
