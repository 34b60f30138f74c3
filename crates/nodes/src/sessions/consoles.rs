//! The serial consoles of vps hosts' VMs: the last [`KEEP_BYTES`] each VM wrote, as its host sent
//! them (`ConsoleOutput`), kept while the host reports the VM. The vps module reads them for
//! `instances.console`; a host writes only the consoles of the VMs it reports.

use better_compute_core::Error;
use better_compute_db::DbError;
use serde::Serialize;
use tokio_postgres::GenericClient;

/// Console bytes kept per VM.
pub const KEEP_BYTES: i32 = 64 << 10;
/// The most bytes one `ConsoleOutput` may carry.
pub const MAX_CHUNK_BYTES: usize = 64 << 10;

/// Whether a host's console report is well formed.
pub(crate) fn check(instance_id: &str, offset: u64, data: &[u8]) -> Result<(), Error> {
    if instance_id.is_empty() || instance_id.len() > 64 {
        return Err(Error::invalid_argument("a console's instance id is 1 to 64 characters"));
    }
    if data.len() > MAX_CHUNK_BYTES || offset > i64::MAX as u64 / 2 {
        return Err(Error::invalid_argument("a console chunk is at most 64 KiB, at an offset below 2^62"));
    }
    Ok(())
}

/// Appends the hosts' console chunks `(node, instance, offset, bytes)`, in order.
pub(crate) async fn append(tx: &impl GenericClient, chunks: &[(&str, &str, u64, &[u8])]) -> Result<(), DbError> {
    for (node, instance, offset, data) in chunks {
        tx.execute("SELECT vm_console_append($1, $2, $3, $4, $5)", &[node, instance, &(*offset as i64), data, &KEEP_BYTES]).await?;
    }
    Ok(())
}

/// Forgets the consoles of the VMs the nodes' spec statuses no longer report.
pub(crate) async fn forget_unreported(tx: &impl GenericClient, nodes: &[&str]) -> Result<(), DbError> {
    tx.execute(
        "DELETE FROM vm_consoles c USING nodes n
          WHERE n.id = ANY($1) AND c.node_id = n.id
            AND NOT coalesce(n.spec_status->'instances', '[]') @> jsonb_build_array(jsonb_build_object('instanceId', c.instance_id))",
        &[&nodes],
    )
    .await?;
    Ok(())
}

/// What is kept of a VM's console from an offset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConsoleTail {
    /// Where `text` starts in the console.
    pub offset: i64,
    /// Where it ends: the `offset` to ask for next.
    pub next_offset: i64,
    /// The console's bytes, as UTF-8 (invalid sequences replaced); a character cut by the end is
    /// left for the next read.
    pub text: String,
    /// The offset asked for was older than what is kept: the bytes before `offset` are gone.
    pub truncated: bool,
}

/// The console of `instance` on `node` from byte `from` (all that is kept when `None`), at most
/// `max_bytes`: `None` when nothing is kept.
pub async fn read(db: &impl GenericClient, node: &str, instance: &str, from: Option<i64>, max_bytes: usize) -> Result<Option<ConsoleTail>, DbError> {
    let Some(row) = db.query_opt("SELECT start_offset, data FROM vm_consoles WHERE node_id = $1 AND instance_id = $2", &[&node, &instance]).await? else {
        return Ok(None);
    };
    let (start, data): (i64, Vec<u8>) = (row.get(0), row.get(1));
    Ok(Some(tail(start, &data, from, max_bytes)))
}

/// The part of a kept console (`data` from `start`) from `from`, cut to whole UTF-8 characters.
fn tail(start: i64, data: &[u8], from: Option<i64>, max_bytes: usize) -> ConsoleTail {
    let end = start + data.len() as i64;
    let from = from.unwrap_or(start).min(end);
    let truncated = from < start;
    let offset = from.max(start);
    let bytes = &data[(offset - start) as usize..];
    let mut bytes = &bytes[..bytes.len().min(max_bytes)];
    // A character cut at the end waits for its other bytes.
    if let Err(e) = std::str::from_utf8(bytes)
        && e.error_len().is_none()
    {
        bytes = &bytes[..e.valid_up_to()];
    }
    ConsoleTail { offset, next_offset: offset + bytes.len() as i64, text: String::from_utf8_lossy(bytes).into_owned(), truncated }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tail_starts_where_asked_within_what_is_kept_and_leaves_a_cut_character_for_later() {
        let data = "abc€".as_bytes(); // € is three bytes
        let t = tail(100, data, Some(101), 10);
        assert_eq!((t.offset, t.next_offset, t.text.as_str(), t.truncated), (101, 106, "bc€", false));
        let t = tail(100, data, Some(50), 4);
        assert_eq!((t.offset, t.next_offset, t.text.as_str(), t.truncated), (100, 103, "abc", true), "the € is cut: it waits");
        let t = tail(100, data, Some(500), 4);
        assert_eq!((t.offset, t.next_offset, t.text.as_str()), (106, 106, ""));
        let t = tail(100, &[b'a', 0xff, b'b'], None, 10);
        assert_eq!((t.text.as_str(), t.next_offset), ("a\u{fffd}b", 103), "an invalid byte is replaced, not held back");
    }
}
