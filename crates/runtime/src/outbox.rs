//! The outbox: events written in the transaction of the change they describe, and delivered to
//! sinks afterwards. Nothing external happens inside a business transaction; if it rolls back, the
//! event never existed.
//!
//! Commit order is not sequence order, so a reader takes only rows whose transaction is older than
//! every transaction still running (`txid < pg_snapshot_xmin(pg_current_snapshot())`), in
//! `(txid, seq)` order after its saved cursor: nothing can commit behind the cursor later.
//!
//! Each sink is delivered by the holder of `singleton:outbox-dispatch:<sink>`. A batch is handed to
//! the sink inside a transaction fenced by that lease, which also saves the cursor: the sink's
//! database effects and the cursor commit together, and anything else it does is at least once,
//! repeated only for a batch whose transaction did not commit. Consumers deduplicate by event id.

use std::time::{Duration, SystemTime};

use better_compute_core::id::EventId;
use better_compute_db::{DbError, Lease, Pool};
use tokio_postgres::{GenericClient, Transaction};

use crate::reconciler::RunError;

/// An event to write.
#[derive(Debug, Clone)]
pub struct NewEvent<'a> {
    /// Its type from the module's catalogue, e.g. `reservation.placed`.
    pub event_type: &'a str,
    /// The tenant it belongs to; `None` for fleet events only operators see.
    pub tenant_id: Option<&'a str>,
    /// What it is about, e.g. a reservation id.
    pub subject: &'a str,
    /// The type's data.
    pub data: serde_json::Value,
}

/// A stored event.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// `evt_…`, the deduplication key.
    pub id: String,
    /// Its type.
    pub event_type: String,
    /// Its tenant.
    pub tenant_id: Option<String>,
    /// Its subject.
    pub subject: String,
    /// Its data.
    pub data: serde_json::Value,
    /// `compute_now()` when it was written.
    pub time: SystemTime,
    /// Its position: the writing transaction's id and the row's sequence number.
    pub cursor: Cursor,
}

impl Event {
    /// The event as it leaves the system (webhooks, the watch stream):
    /// `{ id, type, tenantId, subject, data, time }`.
    pub fn envelope(&self) -> serde_json::Value {
        serde_json::json!({
            "id": self.id, "type": self.event_type, "tenantId": self.tenant_id, "subject": self.subject,
            "data": self.data, "time": better_compute_core::time::rfc3339(self.time),
        })
    }
}

/// A position in the outbox: everything at or before it has been delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Cursor {
    /// The transaction id (`xid8`).
    pub txid: u64,
    /// The sequence number.
    pub seq: i64,
}

impl Cursor {
    /// Before every event.
    pub const START: Cursor = Cursor { txid: 0, seq: 0 };
}

impl std::fmt::Display for Cursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.txid, self.seq)
    }
}

impl std::str::FromStr for Cursor {
    type Err = better_compute_core::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || better_compute_core::Error::invalid_argument(format!("{:?} is not an event id like 1234-5", better_compute_core::bounds::echo(s)));
        let (t, q) = s.split_once('-').ok_or_else(bad)?;
        // Digits only: `parse` would also take a sign ("+1-1").
        let digits = |x: &str| !x.is_empty() && x.bytes().all(|b| b.is_ascii_digit());
        if !digits(t) || !digits(q) {
            return Err(bad());
        }
        Ok(Cursor { txid: t.parse().map_err(|_| bad())?, seq: q.parse().map_err(|_| bad())? })
    }
}

/// Writes an event in the caller's transaction; returns its id.
pub async fn emit(tx: &impl GenericClient, event: NewEvent<'_>) -> Result<String, DbError> {
    let id = EventId::generate().to_string();
    // outbox_emit (src/sql/outbox.sql) is also called by SQL functions.
    tx.execute(
        "SELECT outbox_emit($1, $2, $3, $4, $5)",
        &[&id, &event.event_type, &event.tenant_id, &event.subject, &event.data],
    )
    .await?;
    Ok(id)
}

/// Writes many events in the caller's transaction, in the order given, with one statement;
/// returns their ids.
pub async fn emit_many(tx: &impl GenericClient, events: &[NewEvent<'_>]) -> Result<Vec<String>, DbError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<String> = events.iter().map(|_| EventId::generate().to_string()).collect();
    let types: Vec<&str> = events.iter().map(|e| e.event_type).collect();
    let tenants: Vec<Option<&str>> = events.iter().map(|e| e.tenant_id).collect();
    let subjects: Vec<&str> = events.iter().map(|e| e.subject).collect();
    let data: Vec<&serde_json::Value> = events.iter().map(|e| &e.data).collect();
    tx.execute("SELECT outbox_emit_many($1, $2, $3, $4, $5)", &[&ids, &types, &tenants, &subjects, &data]).await?;
    Ok(ids)
}

/// Which events a reader wants: everything by default.
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    /// Only this tenant's events (`None`: every tenant's).
    pub tenant_id: Option<String>,
    /// With `tenant_id`, also the fleet's own events (those with no tenant).
    pub include_fleet: bool,
    /// Only these types (empty: all).
    pub types: Vec<String>,
    /// Only events about this subject.
    pub subject: Option<String>,
}

/// Up to `limit` events after `after`, in order, from transactions that can no longer commit
/// behind it.
pub async fn read_after(db: &impl GenericClient, after: Cursor, limit: i64) -> Result<Vec<Event>, DbError> {
    read_matching(db, after, limit, &EventFilter::default()).await
}

/// [`read_after`], only the events `filter` selects (the cursor rule is the same).
pub async fn read_matching(db: &impl GenericClient, after: Cursor, limit: i64, filter: &EventFilter) -> Result<Vec<Event>, DbError> {
    let rows = db
        .query(
            "SELECT id, type, tenant_id, subject, data, time, txid::text, seq FROM outbox o
              WHERE o.txid < pg_snapshot_xmin(pg_current_snapshot())
                AND (o.txid, o.seq) > ($1::text::xid8, $2)
                AND ($4::text IS NULL OR o.tenant_id = $4 OR ($5 AND o.tenant_id IS NULL))
                AND (cardinality($6::text[]) = 0 OR o.type = ANY($6))
                AND ($7::text IS NULL OR o.subject = $7)
              ORDER BY o.txid, o.seq
              LIMIT $3",
            &[&after.txid.to_string(), &after.seq, &limit, &filter.tenant_id, &filter.include_fleet, &filter.types, &filter.subject],
        )
        .await?;
    rows.iter().map(event_of).collect()
}

/// A row of `id, type, tenant_id, subject, data, time, txid::text, seq` as an [`Event`].
fn event_of(r: &tokio_postgres::Row) -> Result<Event, DbError> {
    let txid: String = r.get(6);
    Ok(Event {
        id: r.get(0),
        event_type: r.get(1),
        tenant_id: r.get(2),
        subject: r.get(3),
        data: r.get(4),
        time: r.get(5),
        cursor: Cursor { txid: txid.parse().map_err(|_| better_compute_core::Error::internal("bad txid"))?, seq: r.get(7) },
    })
}

/// The newest fleet events (those with no tenant) about any of `subjects`, newest first, at most
/// `limit`: what an operator's `nodes.describe` shows. A backward scan of the outbox, which
/// `events.prune` keeps to its retention.
pub async fn recent_fleet_events(db: &impl GenericClient, subjects: &[String], limit: i64) -> Result<Vec<Event>, DbError> {
    let rows = db
        .query(
            "SELECT id, type, tenant_id, subject, data, time, txid::text, seq FROM outbox o
              WHERE o.tenant_id IS NULL AND o.subject = ANY($1)
              ORDER BY o.txid DESC, o.seq DESC LIMIT $2",
            &[&subjects, &limit],
        )
        .await?;
    rows.iter().map(event_of).collect()
}

/// The position of the newest event a reader may take now ([`Cursor::START`] when none): where a
/// reader that wants only what happens from now on starts.
pub async fn visible_head(db: &impl GenericClient) -> Result<Cursor, DbError> {
    let row = db
        .query_opt(
            "SELECT o.txid::text, o.seq FROM outbox o WHERE o.txid < pg_snapshot_xmin(pg_current_snapshot()) ORDER BY o.txid DESC, o.seq DESC LIMIT 1",
            &[],
        )
        .await?;
    Ok(match row {
        Some(r) => Cursor { txid: r.get::<_, String>(0).parse().map_err(|_| better_compute_core::Error::internal("bad txid"))?, seq: r.get(1) },
        None => Cursor::START,
    })
}

/// A sink's saved cursor ([`Cursor::START`] when it has none).
pub async fn load_cursor(db: &impl GenericClient, sink: &str) -> Result<Cursor, DbError> {
    let row = db.query_opt("SELECT txid::text, seq FROM outbox_cursors WHERE sink = $1", &[&sink]).await?;
    Ok(match row {
        Some(r) => Cursor {
            txid: r.get::<_, String>(0).parse().map_err(|_| better_compute_core::Error::internal("bad txid"))?,
            seq: r.get(1),
        },
        None => Cursor::START,
    })
}

async fn save_cursor(tx: &impl GenericClient, sink: &str, cursor: Cursor, delivered: i64) -> Result<(), DbError> {
    tx.execute(
        "INSERT INTO outbox_cursors (sink, txid, seq, delivered) VALUES ($1, $2::text::xid8, $3, $4)
         ON CONFLICT (sink) DO UPDATE SET txid = EXCLUDED.txid, seq = EXCLUDED.seq,
           delivered = outbox_cursors.delivered + EXCLUDED.delivered, updated_at = compute_now()",
        &[&sink, &cursor.txid.to_string(), &cursor.seq, &delivered],
    )
    .await?;
    Ok(())
}

/// Where events go: an in-process subscriber, or the fan-out to webhooks.
#[async_trait::async_trait]
pub trait Sink: Send + Sync + 'static {
    /// A stable name; it names the sink's lease and cursor.
    fn name(&self) -> &str;

    /// Handles a batch, in order, inside the transaction that will save the cursor past it. An
    /// error rolls the batch back; it is delivered again later.
    async fn deliver(&self, tx: &Transaction<'_>, events: &[Event]) -> Result<(), RunError>;

    /// The most events one batch (one transaction) hands it, when that must be fewer than the
    /// worker's `outbox_batch`: a sink that locks rows per event keeps its transactions short.
    fn batch_limit(&self) -> Option<i64> {
        None
    }
}

/// The lease under which a sink is delivered.
pub fn sink_lease(sink: &str) -> String {
    format!("singleton:outbox-dispatch:{sink}")
}

/// Why a dispatch stopped.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    /// The database failed, or the lease was lost (nothing was saved).
    #[error(transparent)]
    Db(#[from] DbError),
    /// The sink refused the batch; its cursor did not move.
    #[error("sink {sink}: {message}")]
    Sink {
        /// The sink.
        sink: String,
        /// What it said.
        message: String,
    },
}

/// Delivers at most one batch of up to `limit` events to `sink` under `lease`. Returns how many were
/// delivered (0 when caught up).
pub async fn dispatch_batch(pool: &Pool, sink: &dyn Sink, lease: &Lease, limit: i64) -> Result<usize, DispatchError> {
    let mut client = pool.get().await.map_err(DbError::from)?;
    let tx = lease.begin_fenced(&mut client).await?;
    let cursor = load_cursor(&*tx, sink.name()).await?;
    let events = read_after(&*tx, cursor, limit).await?;
    if events.is_empty() {
        tx.rollback().await?;
        return Ok(0);
    }
    if let Err(e) = sink.deliver(&tx, &events).await {
        tx.rollback().await?;
        return Err(DispatchError::Sink { sink: sink.name().to_owned(), message: e.to_string() });
    }
    let last = events.last().expect("non-empty").cursor;
    save_cursor(&*tx, sink.name(), last, events.len() as i64).await?;
    tx.commit().await?;
    metrics::counter!("better_compute_outbox_delivered_total", "sink" => sink.name().to_owned()).increment(events.len() as u64);
    Ok(events.len())
}

/// The slowest sink's cursor, as `(txid as text, seq)`: no outbox row past it may go.
pub const SLOWEST_CURSOR_SQL: &str = "SELECT txid::text, seq FROM outbox_cursors ORDER BY txid, seq LIMIT 1";

/// Deletes up to `$2` outbox rows older than `$1` seconds at or behind the cursor `($3, $4)`. The
/// cursor is a constant, so the rows are found by one walk of the primary key from its start,
/// stopping after `$2` (a correlated cursor would rescan the outbox per row).
pub const PRUNE_SQL: &str = "DELETE FROM outbox o WHERE (o.txid, o.seq) IN (
       SELECT x.txid, x.seq FROM outbox x
        WHERE (x.txid, x.seq) <= ($3::text::xid8, $4::int8) AND x.time < compute_now() - make_interval(secs => $1)
        ORDER BY x.txid, x.seq LIMIT $2)";

/// Removes up to `limit` events older than `retention` that every sink's cursor has passed (a row
/// a cursor still needs is never removed); returns how many. With no sink, nothing goes.
pub async fn prune(db: &impl GenericClient, retention: Duration, limit: i64) -> Result<u64, tokio_postgres::Error> {
    match db.query_opt(SLOWEST_CURSOR_SQL, &[]).await? {
        Some(c) => db.execute(PRUNE_SQL, &[&retention.as_secs_f64(), &limit, &c.get::<_, String>(0), &c.get::<_, i64>(1)]).await,
        None => Ok(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_print_and_parse_and_order_by_txid_then_seq() {
        let c = Cursor { txid: 812, seq: 44 };
        assert_eq!(c.to_string(), "812-44");
        assert_eq!("812-44".parse::<Cursor>().unwrap(), c);
        assert!("812".parse::<Cursor>().is_err());
        assert!("a-1".parse::<Cursor>().is_err());
        for signed in ["+1-1", "1-+1", "-1-1", " 1-1", "1-"] {
            assert!(signed.parse::<Cursor>().is_err(), "{signed:?}");
        }
        assert!(Cursor { txid: 811, seq: 99 } < c);
        assert!(Cursor { txid: 812, seq: 43 } < c);
    }
}
