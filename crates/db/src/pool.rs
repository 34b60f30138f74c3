//! The connection pool. Connections keep no session state, so it works behind PgBouncer in
//! transaction pooling mode, on one condition: every statement runs in a transaction. tokio-postgres
//! prepares a statement and executes it in two exchanges, and outside a transaction PgBouncer may
//! hand each to another server, where the prepared statement does not exist. Writes take a
//! transaction anyway; reads take a [`ReadTx`].

use crate::DbError;

/// A pool of connections to one database.
pub type Pool = deadpool_postgres::Pool;

/// Builds a pool from a libpq connection string or URL (`host=/sock dbname=x` or `postgresql://…`,
/// with `sslmode` and `sslrootcert` as libpq reads them: `crate::tls`). Connections are opened
/// lazily.
pub fn connect_pool(conn: &str, max_size: usize) -> Result<Pool, DbError> {
    let (cfg, tls) = crate::tls::parse(conn)?;
    let mgr = deadpool_postgres::Manager::from_config(
        cfg,
        tls,
        deadpool_postgres::ManagerConfig { recycling_method: deadpool_postgres::RecyclingMethod::Fast },
    );
    Ok(deadpool_postgres::Pool::builder(mgr)
        .max_size(max_size)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .expect("a pool with a runtime and no hooks always builds"))
}

/// Opens one dedicated connection, driving it on a background task. Use for LISTEN and for tests
/// that need a connection of their own.
pub async fn connect(conn: &str) -> Result<tokio_postgres::Client, DbError> {
    let (cfg, tls) = crate::tls::parse(conn)?;
    let (client, connection) = cfg.connect(tls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "database connection closed");
        }
    });
    Ok(client)
}

/// A pooled connection inside a read-only transaction of its own: what a read takes instead of a
/// bare pooled connection, so that it works behind PgBouncer (see the module's doc). It derefs to
/// the connection's client (`&*read` is a `&tokio_postgres::Client`). A write through it
/// fails (`READ ONLY`) rather than being lost. When dropped, it rolls back in a task of its own,
/// and only then does the connection go back to the pool.
pub struct ReadTx {
    conn: Option<deadpool_postgres::Object>,
}

/// Takes a connection from `pool` and begins a read-only transaction on it (one round trip, over
/// the simple query protocol).
///
/// The connection is a `ReadTx` before `BEGIN` is sent: `BEGIN` leaves with the first poll, so a
/// caller cancelled while it waits for the answer (a dropped stream, a timeout) drops a `ReadTx`,
/// whose rollback runs before the connection goes back, instead of a bare connection that would go
/// back inside the transaction.
pub async fn read_tx(pool: &Pool) -> Result<ReadTx, DbError> {
    let read = ReadTx { conn: Some(pool.get().await?) };
    read.batch_execute("BEGIN READ ONLY").await?;
    Ok(read)
}

impl std::ops::Deref for ReadTx {
    type Target = tokio_postgres::Client;

    fn deref(&self) -> &tokio_postgres::Client {
        self.conn.as_ref().expect("a ReadTx holds its connection until dropped")
    }
}

impl Drop for ReadTx {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    // A connection that cannot roll back leaves the pool rather than going back
                    // inside a transaction.
                    if conn.batch_execute("ROLLBACK").await.is_err() {
                        let _ = deadpool_postgres::Object::take(conn);
                    }
                });
            }
            // No runtime to roll back on: the connection is closed, never reused.
            Err(_) => drop(deadpool_postgres::Object::take(conn)),
        }
    }
}
