//! Reading the log: entries (a tenant's own, or the fleet's), checkpoints, proofs and the export.

use better_compute_core::Error;
use better_compute_db::DbError;
use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::checkpoint::{checkpoint_of, CheckpointView, CHECKPOINT_COLUMNS};
use crate::entry::{canonical, entry_of, Entry, COLUMNS};
use crate::merkle::{self, leaf_hash, Hash};
use crate::verify::ExportLine;

/// What `audit.list` filters on.
#[derive(Debug, Clone, Default)]
pub struct Filter<'a> {
    /// One tenant's entries (none: every tenant's and the fleet's).
    pub tenant_id: Option<&'a str>,
    /// Only this actor (an identity, or a job's kind).
    pub actor_id: Option<&'a str>,
    /// Only this action.
    pub action: Option<&'a str>,
    /// Only this target.
    pub target: Option<&'a str>,
    /// RFC 3339: entries at or after it.
    pub from: Option<&'a str>,
    /// RFC 3339: entries before it.
    pub to: Option<&'a str>,
}

/// Entries matching `f`, oldest first, after the entry `after` (its id; empty: from the start),
/// at most `limit + 1` (for the page's next token).
pub async fn list(db: &impl GenericClient, f: &Filter<'_>, after: &str, limit: i64) -> Result<Vec<Entry>, Error> {
    for (name, t) in [("from", f.from), ("to", f.to)] {
        if let Some(t) = t {
            better_compute_core::time::check_rfc3339(name, t)?;
        }
    }
    let rows = db
        .query(
            &format!(
                "SELECT {COLUMNS} FROM audit_entries
                  WHERE ($1::text IS NULL OR tenant_id = $1) AND ($2::text IS NULL OR actor_id = $2) AND ($3::text IS NULL OR action = $3)
                    AND ($4::text IS NULL OR target = $4) AND ($5::text IS NULL OR at >= $5::text::timestamptz) AND ($6::text IS NULL OR at < $6::text::timestamptz)
                    AND position > coalesce((SELECT position FROM audit_entries WHERE id = $7), 0)
                  ORDER BY position LIMIT $8"
            ),
            &[&f.tenant_id, &f.actor_id, &f.action, &f.target, &f.from, &f.to, &after, &(limit + 1)],
        )
        .await
        .map_err(DbError::from)?;
    Ok(rows.iter().map(entry_of).collect())
}

/// One entry (of `tenant_id` when given: another tenant's is not found).
pub async fn get(db: &impl GenericClient, id: &str, tenant_id: Option<&str>) -> Result<Entry, Error> {
    db.query_opt(&format!("SELECT {COLUMNS} FROM audit_entries WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2)"), &[&id, &tenant_id])
        .await
        .map_err(DbError::from)?
        .map(|r| entry_of(&r))
        .ok_or_else(|| Error::not_found("audit entry", id))
}

/// Checkpoints of more than `after` entries, smallest first, at most `limit + 1`.
pub async fn checkpoints(db: &impl GenericClient, after: i64, limit: i64) -> Result<Vec<CheckpointView>, DbError> {
    Ok(db
        .query(&format!("SELECT {CHECKPOINT_COLUMNS} FROM audit_checkpoints WHERE tree_size > $1 ORDER BY tree_size LIMIT $2"), &[&after, &(limit + 1)])
        .await?
        .iter()
        .map(checkpoint_of)
        .collect())
}

async fn checkpoint(db: &impl GenericClient, tree_size: i64) -> Result<CheckpointView, Error> {
    db.query_opt(&format!("SELECT {CHECKPOINT_COLUMNS} FROM audit_checkpoints WHERE tree_size = $1"), &[&tree_size])
        .await
        .map_err(DbError::from)?
        .map(|r| checkpoint_of(&r))
        .ok_or_else(|| Error::not_found("audit checkpoint", &tree_size.to_string()))
}

/// The leaf hashes of the first `size` entries.
async fn leaves(db: &impl GenericClient, size: i64) -> Result<Vec<Hash>, DbError> {
    let rows = db.query(&format!("SELECT {COLUMNS} FROM audit_entries WHERE log_index < $1 ORDER BY log_index"), &[&size]).await?;
    Ok(rows.iter().map(|r| leaf_hash(&canonical(&entry_of(r)))).collect())
}

/// An entry's inclusion in a checkpoint, and the checkpoint's consistency with an earlier one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Proof {
    /// The entry.
    pub entry: Entry,
    /// The checkpoint it is proved in.
    pub checkpoint: CheckpointView,
    /// RFC 6962 audit path of the entry's leaf (`sha256(0x00 || canonical entry)`) to the
    /// checkpoint's root, hex.
    pub inclusion: Vec<String>,
    /// The earlier checkpoint's size, when one was asked for.
    pub consistent_with: Option<i64>,
    /// RFC 6962 consistency proof from that checkpoint to this one, hex.
    pub consistency: Vec<String>,
}

/// `audit.proof`: entry `id`'s inclusion in the checkpoint of `tree_size` (and that checkpoint's
/// consistency with the one of `earlier`, when given).
pub async fn proof(db: &impl GenericClient, id: &str, tenant_id: Option<&str>, tree_size: i64, earlier: Option<i64>) -> Result<Proof, Error> {
    let entry = get(db, id, tenant_id).await?;
    let index = entry.log_index.ok_or_else(|| Error::failed_precondition(format!("entry {id} has no place in the log yet: audit.checkpoint places it within seconds")))?;
    let cp = checkpoint(db, tree_size).await?;
    if index >= tree_size {
        return Err(Error::failed_precondition(format!("entry {id} is at log index {index}, after checkpoint {tree_size}: ask for a later checkpoint")));
    }
    if let Some(e) = earlier {
        checkpoint(db, e).await?;
        if e > tree_size {
            return Err(Error::invalid_argument("the earlier checkpoint must not be larger than the checkpoint"));
        }
    }
    let leaves = leaves(db, tree_size).await?;
    let hex = |v: Vec<Hash>| v.into_iter().map(hex::encode).collect::<Vec<_>>();
    Ok(Proof {
        inclusion: hex(merkle::inclusion_proof(index as usize, &leaves)),
        consistency: earlier.map(|e| hex(merkle::consistency_proof(e as usize, &leaves))).unwrap_or_default(),
        consistent_with: earlier,
        entry,
        checkpoint: cp,
    })
}

/// A page of the export: placed entries from log index `from` in log order, each checkpoint after
/// the last entry it covers, at most `limit` entries.
pub async fn export_page(db: &impl GenericClient, from: i64, limit: i64) -> Result<Vec<ExportLine>, DbError> {
    let entries: Vec<Entry> =
        db.query(&format!("SELECT {COLUMNS} FROM audit_entries WHERE log_index >= $1 ORDER BY log_index LIMIT $2"), &[&from, &limit]).await?.iter().map(entry_of).collect();
    let Some(last) = entries.last().and_then(|e| e.log_index) else { return Ok(Vec::new()) };
    let cps: Vec<CheckpointView> = db
        .query(&format!("SELECT {CHECKPOINT_COLUMNS} FROM audit_checkpoints WHERE tree_size > $1 AND tree_size <= $2 ORDER BY tree_size"), &[&from, &(last + 1)])
        .await?
        .iter()
        .map(checkpoint_of)
        .collect();
    let mut out = Vec::with_capacity(entries.len() + cps.len());
    let mut cps = cps.into_iter().peekable();
    for e in entries {
        let index = e.log_index.unwrap_or_default();
        out.push(ExportLine::Entry(e));
        while let Some(c) = cps.next_if(|c| c.tree_size == index + 1) {
            out.push(ExportLine::Checkpoint(c));
        }
    }
    Ok(out)
}

/// The whole export, read at once (the anchor first when the log was pruned): for checks and
/// tests; `better-compute audit export` pages through it instead.
pub async fn export_all(db: &impl GenericClient) -> Result<Vec<ExportLine>, DbError> {
    let mut out = Vec::new();
    let mut from = 0;
    if let Some(a) = crate::prune::anchor(db).await? {
        from = a.checkpoint.tree_size;
        out.push(ExportLine::Anchor(a));
    }
    loop {
        let page = export_page(db, from, 10_000).await?;
        let entries = page.iter().filter(|l| matches!(l, ExportLine::Entry(_))).count() as i64;
        out.extend(page);
        from += entries;
        if entries < 10_000 {
            out.push(ExportLine::End(crate::verify::End { tree_size: from }));
            return Ok(out);
        }
    }
}
