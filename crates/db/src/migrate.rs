//! Migrations per module, core first: ordered, recorded in `schema_migrations`, each applied once in
//! its own transaction. Many processes may migrate at once: a transaction-scoped advisory lock
//! (safe under PgBouncer's transaction pooling) serialises them, and each re-checks what is applied.

use sha2::{Digest, Sha256};

use crate::DbError;

/// One migration: a module's named SQL script.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// The owning module, e.g. `core`.
    pub module: &'static str,
    /// Ordered within the module by name, e.g. `0001_clock`.
    pub name: &'static str,
    /// The SQL, run in one transaction.
    pub sql: &'static str,
}

impl Migration {
    /// SHA-256 of the SQL, recorded so a migration edited after it was applied is noticed.
    pub fn checksum(&self) -> String {
        hex(&Sha256::digest(self.sql.as_bytes()))
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The core module's migrations: the clock, leases and workers, idempotency keys.
pub const CORE_MIGRATIONS: &[Migration] = &[
    Migration { module: "core", name: "0001_clock", sql: include_str!("migrations/core/0001_clock.sql") },
    Migration {
        module: "core",
        name: "0002_leases_and_workers",
        sql: include_str!("migrations/core/0002_leases_and_workers.sql"),
    },
    Migration {
        module: "core",
        name: "0003_idempotency",
        sql: include_str!("migrations/core/0003_idempotency.sql"),
    },
    Migration { module: "core", name: "0004_worker_checks", sql: include_str!("migrations/core/0004_worker_checks.sql") },
];

/// Arbitrary, fixed key of the advisory lock that serialises migrators.
const MIGRATION_LOCK_KEY: i64 = 0x6263_6d69_6772;

/// What a migration run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MigrateReport {
    /// `module/name` of each migration applied by this run.
    pub applied: Vec<String>,
    /// How many were already applied.
    pub already_applied: usize,
}

/// A stable fingerprint of a migration set, used to name test templates.
pub fn fingerprint(sets: &[&[Migration]]) -> String {
    let mut h = Sha256::new();
    for m in sets.iter().flat_map(|s| s.iter()) {
        h.update(m.module.as_bytes());
        h.update([0]);
        h.update(m.name.as_bytes());
        h.update([0]);
        h.update(m.sql.as_bytes());
        h.update([0]);
    }
    hex(&h.finalize())[..16].to_owned()
}

/// Applies every migration of `sets` not yet applied, in order: sets in the order given (core
/// first), names in order within a set.
pub async fn migrate(client: &mut tokio_postgres::Client, sets: &[&[Migration]]) -> Result<MigrateReport, DbError> {
    let mut ordered: Vec<Migration> = Vec::new();
    for set in sets {
        let mut set = set.to_vec();
        set.sort_by_key(|m| m.name);
        ordered.extend(set);
    }
    {
        let tx = client.transaction().await?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK_KEY]).await?;
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (
               module text NOT NULL,
               name text NOT NULL,
               checksum text NOT NULL,
               applied_at timestamptz NOT NULL DEFAULT now(), -- check-sql-now: allow (bookkeeping, before compute_now() exists)
               PRIMARY KEY (module, name))",
        )
        .await?;
        tx.commit().await?;
    }
    let mut report = MigrateReport::default();
    for m in ordered {
        let tx = client.transaction().await?;
        // Serialises concurrent migrators; released at commit.
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK_KEY]).await?;
        let row = tx
            .query_opt("SELECT checksum FROM schema_migrations WHERE module = $1 AND name = $2", &[&m.module, &m.name])
            .await?;
        let checksum = m.checksum();
        match row {
            Some(r) => {
                let recorded: String = r.get(0);
                if recorded != checksum {
                    return Err(DbError::MigrationChanged { migration: format!("{}/{}", m.module, m.name) });
                }
                report.already_applied += 1;
            }
            None => {
                tx.batch_execute(m.sql).await.map_err(|source| DbError::MigrationFailed {
                    migration: format!("{}/{}", m.module, m.name),
                    source,
                })?;
                tx.execute(
                    "INSERT INTO schema_migrations (module, name, checksum) VALUES ($1, $2, $3)",
                    &[&m.module, &m.name, &checksum],
                )
                .await?;
                report.applied.push(format!("{}/{}", m.module, m.name));
            }
        }
        tx.commit().await?;
    }
    Ok(report)
}
