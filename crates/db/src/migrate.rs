//! Migrations per module: numbered migrations (tables, indexes, constraints, settings), each
//! applied once, and repeatable SQL files (the module's functions and the triggers that call
//! them, one file per concept, every statement `CREATE OR REPLACE`), applied after the module's
//! numbered ones and again whenever their text changes, as Flyway's repeatable migrations are.
//! So a function's current text is in one file, and changing it is editing that file.
//!
//! One run applies everything pending in one transaction, under a transaction-scoped advisory
//! lock (safe under PgBouncer's transaction pooling) that serialises concurrent migrators: either
//! all of it lands or none. Everything applied is recorded in `schema_migrations` with its
//! checksum; a numbered migration edited after it was applied is refused.

use sha2::{Digest, Sha256};

use crate::DbError;

/// How a migration is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigrationKind {
    /// Once, in name order within its module; never edited afterwards.
    Numbered,
    /// After the module's numbered migrations, and again whenever its text changes.
    Repeatable,
}

/// One migration: a module's named SQL script.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// The owning module, e.g. `core`.
    pub module: &'static str,
    /// `0001_core` for a numbered migration (ordered by name within its module); the concept for a
    /// repeatable one, e.g. `placer`.
    pub name: &'static str,
    /// The SQL.
    pub sql: &'static str,
    /// Numbered or repeatable.
    pub kind: MigrationKind,
    /// The `(module, name)` it was recorded under before it moved to another module: a database
    /// that applied it under that name has it, and its record is renamed.
    pub was: Option<(&'static str, &'static str)>,
}

impl Migration {
    /// A numbered migration.
    pub const fn numbered(module: &'static str, name: &'static str, sql: &'static str) -> Migration {
        Migration { module, name, sql, kind: MigrationKind::Numbered, was: None }
    }

    /// A repeatable SQL file.
    pub const fn repeatable(module: &'static str, name: &'static str, sql: &'static str) -> Migration {
        Migration { module, name, sql, kind: MigrationKind::Repeatable, was: None }
    }

    /// The same migration, once recorded as `module/name`.
    pub const fn was(self, module: &'static str, name: &'static str) -> Migration {
        Migration { was: Some((module, name)), ..self }
    }

    /// SHA-256 of the SQL, recorded so a migration edited after it was applied is noticed.
    pub fn checksum(&self) -> String {
        hex(&Sha256::digest(self.sql.as_bytes()))
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The clock module: `compute_sim_clock` and `compute_now()`, before every other module because
/// their tables' defaults read the clock.
pub const CLOCK_MIGRATIONS: &[Migration] = &[
    Migration::numbered("clock", "0001_clock", include_str!("migrations/clock/0001_clock.sql")),
    Migration::repeatable("clock", "clock", include_str!("sql/clock.sql")),
];

/// The core module's migrations: leases and workers, idempotency keys and their functions.
pub const CORE_MIGRATIONS: &[Migration] = &[
    Migration::numbered("core", "0001_core", include_str!("migrations/core/0001_core.sql")),
    Migration::repeatable("core", "idempotency", include_str!("sql/idempotency.sql")),
];

/// The foundation every database has, in order: the clock, then core.
pub const FOUNDATION_MIGRATIONS: &[&[Migration]] = &[CLOCK_MIGRATIONS, CORE_MIGRATIONS];

/// Arbitrary, fixed key of the advisory lock that serialises migrators.
const MIGRATION_LOCK_KEY: i64 = 0x6263_6d69_6772;

/// What a migration run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MigrateReport {
    /// `module/name` of each numbered migration and repeatable file applied by this run.
    pub applied: Vec<String>,
    /// How many were already applied (repeatable files unchanged since).
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
        h.update([m.kind as u8]);
        h.update(m.sql.as_bytes());
        h.update([0]);
    }
    hex(&h.finalize())[..16].to_owned()
}

/// What [`migrate`] would apply of `sets`, as `module/name` (numbered migrations not recorded,
/// repeatable files new or changed); reads only. A server whose binary carries migrations its
/// database lacks is not ready (`/readyz`): run `better-compute migrate`.
pub async fn pending(db: &impl tokio_postgres::GenericClient, sets: &[&[Migration]]) -> Result<Vec<String>, DbError> {
    let table: bool = db.query_one("SELECT to_regclass('schema_migrations') IS NOT NULL", &[]).await?.get(0);
    let recorded: std::collections::HashMap<(String, String), String> = if table {
        db.query("SELECT module, name, checksum FROM schema_migrations", &[]).await?.iter().map(|r| ((r.get(0), r.get(1)), r.get(2))).collect()
    } else {
        Default::default()
    };
    Ok(sets
        .iter()
        .flat_map(|s| s.iter())
        .filter(|m| {
            let was = m.was.and_then(|(module, name)| recorded.get(&(module.to_owned(), name.to_owned())));
            recorded.get(&(m.module.to_owned(), m.name.to_owned())).or(was) != Some(&m.checksum())
        })
        .map(|m| format!("{}/{}", m.module, m.name))
        .collect())
}

/// Applies what is pending of `sets`, in one transaction: sets in the order given (the clock and
/// core first), within a set its numbered migrations not yet applied in name order, then its
/// repeatable files that are new or changed, in the order listed.
pub async fn migrate(client: &mut tokio_postgres::Client, sets: &[&[Migration]]) -> Result<MigrateReport, DbError> {
    let mut ordered: Vec<Migration> = Vec::new();
    for set in sets {
        let mut numbered: Vec<Migration> = set.iter().filter(|m| m.kind == MigrationKind::Numbered).copied().collect();
        numbered.sort_by_key(|m| m.name);
        ordered.extend(numbered);
        ordered.extend(set.iter().filter(|m| m.kind == MigrationKind::Repeatable));
    }
    let tx = client.transaction().await?;
    // Serialises concurrent migrators; released at commit.
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
    // A migration that moved to another module keeps its record under its new name.
    for (m, (module, name)) in ordered.iter().filter_map(|m| m.was.map(|w| (m, w))) {
        tx.execute(
            "UPDATE schema_migrations SET module = $1, name = $2 WHERE module = $3 AND name = $4
                AND NOT EXISTS (SELECT 1 FROM schema_migrations WHERE module = $1 AND name = $2)",
            &[&m.module, &m.name, &module, &name],
        )
        .await?;
    }
    let mut report = MigrateReport::default();
    for m in ordered {
        let label = format!("{}/{}", m.module, m.name);
        let recorded: Option<String> = tx
            .query_opt("SELECT checksum FROM schema_migrations WHERE module = $1 AND name = $2", &[&m.module, &m.name])
            .await?
            .map(|r| r.get(0));
        let checksum = m.checksum();
        match (recorded, m.kind) {
            (Some(recorded), _) if recorded == checksum => report.already_applied += 1,
            (Some(_), MigrationKind::Numbered) => return Err(DbError::MigrationChanged { migration: label }),
            _ => {
                tx.batch_execute(m.sql).await.map_err(|source| DbError::MigrationFailed { migration: label.clone(), source })?;
                tx.execute(
                    "INSERT INTO schema_migrations (module, name, checksum) VALUES ($1, $2, $3)
                     ON CONFLICT (module, name) DO UPDATE SET checksum = EXCLUDED.checksum, applied_at = now()", // check-sql-now: allow (bookkeeping)
                    &[&m.module, &m.name, &checksum],
                )
                .await?;
                report.applied.push(label);
            }
        }
    }
    tx.commit().await?;
    Ok(report)
}
