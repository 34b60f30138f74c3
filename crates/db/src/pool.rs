//! The connection pool. Plain connections, no session state, so it works behind PgBouncer in
//! transaction pooling mode.

use std::str::FromStr;

use crate::DbError;

/// A pool of connections to one database.
pub type Pool = deadpool_postgres::Pool;

/// Builds a pool from a libpq connection string or URL (`host=/sock dbname=x` or `postgresql://…`).
/// Connections are opened lazily.
pub fn connect_pool(conn: &str, max_size: usize) -> Result<Pool, DbError> {
    let cfg = tokio_postgres::Config::from_str(conn)?;
    let mgr = deadpool_postgres::Manager::from_config(
        cfg,
        tokio_postgres::NoTls,
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
    let (client, connection) = tokio_postgres::connect(conn, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "database connection closed");
        }
    });
    Ok(client)
}
