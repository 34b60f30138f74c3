//! The database layer's errors, and their mapping onto the API's stable codes.

use better_compute_core::{Error, ErrorCode};

/// Errors of the database layer.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// A statement or the connection failed.
    #[error("database: {}", detail(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// No connection could be had from the pool.
    #[error("database pool: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),
    /// A domain rule refused the change (CONFLICT, NOT_FOUND, FAILED_PRECONDITION, …).
    #[error(transparent)]
    Domain(#[from] Error),
    /// The fence found the lease gone: another holder took over, or it expired.
    #[error("lease {name} (epoch {epoch}) is no longer held by this process")]
    LeaseLost {
        /// The lease's name.
        name: String,
        /// The epoch this process held.
        epoch: i64,
    },
    /// An applied migration's SQL was edited afterwards.
    #[error("migration {migration} changed after it was applied; add a new migration instead")]
    MigrationChanged {
        /// `module/name`.
        migration: String,
    },
    /// The connection string or its TLS settings cannot be used.
    #[error("database connection settings: {0}")]
    Config(String),
    /// A migration's SQL failed; nothing of it was applied.
    #[error("migration {migration} failed: {source}")]
    MigrationFailed {
        /// `module/name`.
        migration: String,
        /// The database's error.
        source: tokio_postgres::Error,
    },
}

/// tokio-postgres says only "db error" for an error the server raised; the server's message and
/// SQLSTATE are what an operator reading a log needs.
fn detail(e: &tokio_postgres::Error) -> String {
    match (e.as_db_error(), std::error::Error::source(e)) {
        (Some(db), _) => format!("{} ({})", db.message(), db.code().code()),
        // A connection's failure says why only in its cause (a TLS handshake's: the certificate).
        (None, Some(cause)) => format!("{e}: {cause}"),
        (None, None) => e.to_string(),
    }
}

impl DbError {
    /// The PostgreSQL SQLSTATE, when the database raised the error.
    pub fn sqlstate(&self) -> Option<&tokio_postgres::error::SqlState> {
        match self {
            DbError::Postgres(e) | DbError::MigrationFailed { source: e, .. } => e.code(),
            _ => None,
        }
    }
}

/// Domain errors raised by SQL functions (SQLSTATE class `BC`), and their API codes. The message is
/// the API's message; `DETAIL`, when given, is the error's details as JSON.
///
/// The class also holds codes that never leave the function that raises them (the placer's
/// `BCRAC` and `BCFIT`); one that escapes anyway is an internal error.
pub const SQL_DOMAIN_ERRORS: &[(&str, ErrorCode)] = &[
    ("BCINV", ErrorCode::InvalidArgument),
    ("BCNFD", ErrorCode::NotFound),
    ("BCFPC", ErrorCode::FailedPrecondition),
    ("BCCNF", ErrorCode::Conflict),
    ("BCQUO", ErrorCode::QuotaExceeded),
];

fn sql_domain_error(db: &tokio_postgres::error::DbError) -> Option<Error> {
    let (_, code) = SQL_DOMAIN_ERRORS.iter().find(|(c, _)| *c == db.code().code())?;
    let err = Error::new(*code, db.message());
    Some(match db.detail().map(serde_json::from_str::<serde_json::Value>) {
        Some(Ok(details)) => err.with_details(details),
        _ => err,
    })
}

impl From<DbError> for Error {
    fn from(e: DbError) -> Error {
        use tokio_postgres::error::SqlState;
        if let Some(err) = match &e {
            DbError::Postgres(pg) => pg.as_db_error().and_then(sql_domain_error),
            _ => None,
        } {
            return err;
        }
        match e {
            DbError::Domain(err) => err,
            DbError::LeaseLost { .. } => Error::new(ErrorCode::Unavailable, e.to_string()),
            DbError::Pool(_) => Error::new(ErrorCode::Unavailable, "the database is unavailable; retry shortly"),
            DbError::Postgres(ref pg) => match pg.code() {
                Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE || *c == SqlState::T_R_DEADLOCK_DETECTED => {
                    Error::conflict("a concurrent change interfered; retry")
                }
                Some(c) if *c == SqlState::CHARACTER_NOT_IN_REPERTOIRE || *c == SqlState::UNTRANSLATABLE_CHARACTER => {
                    Error::invalid_argument("a text field holds a character the database cannot store (NUL, or invalid UTF-8)")
                }
                Some(c) if *c == SqlState::DATETIME_FIELD_OVERFLOW || *c == SqlState::INVALID_DATETIME_FORMAT => {
                    Error::invalid_argument("a timestamp is out of the range the database can store")
                }
                // No SQLSTATE (the connection broke), a connection exception (class 08), the
                // server shutting down or starting (57P01-57P03), or out of connections.
                None => Error::new(ErrorCode::Unavailable, "the database is unavailable; retry shortly"),
                Some(c) if c.code().starts_with("08") || c.code().starts_with("57P0") || *c == SqlState::TOO_MANY_CONNECTIONS => {
                    Error::new(ErrorCode::Unavailable, "the database is unavailable; retry shortly")
                }
                Some(_) => Error::internal("unexpected database error"),
            },
            DbError::MigrationChanged { .. } | DbError::MigrationFailed { .. } | DbError::Config(_) => Error::internal(e.to_string()),
        }
    }
}
