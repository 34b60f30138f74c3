//! The iam module's tests against a real PostgreSQL: bootstrap, and bearer tokens (stored only as
//! their hash, refused once expired or revoked). The API's tests cover authorization over HTTP.

mod bootstrap;
mod tokens;

use std::sync::Arc;

use better_compute_runtime::harness::Harness;

/// A harness with the iam module alone.
async fn harness() -> Harness {
    Harness::new(vec![Arc::new(better_compute_iam::IamModule)]).await
}
