//! The authorization contract: methods ask an [`Authorizer`] before they act. Modules declare the
//! permissions they check ([`Permission`]); IAM provides the real authorizer (role bindings at
//! tenant, site, pool or node scope). Until then, [`LocalOperator`] stands for someone who already
//! has the database itself, such as the `better-compute` CLI run against `DATABASE_URL`.

use better_compute_core::{Caller, Error};

/// A permission a module checks, for the catalog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Permission {
    /// Its name, e.g. `compute:nodes:exec`.
    pub name: &'static str,
    /// What it allows.
    pub description: &'static str,
}

/// What a permission is asked for on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource<'a> {
    /// The whole fleet (tenants, quotas of any tenant): only fleet-scope bindings grant it.
    Fleet,
    /// The caller's tenant as a whole.
    Tenant,
    /// A site.
    Site(&'a str),
    /// A pool.
    Pool(&'a str),
    /// A node.
    Node(&'a str),
}

/// Decides whether a caller may do something.
#[async_trait::async_trait]
pub trait Authorizer: Send + Sync {
    /// `Ok` when allowed. Otherwise `NOT_FOUND` when the caller may not even see the resource (so it
    /// cannot learn that it exists), else `PERMISSION_DENIED`.
    async fn check(&self, caller: Caller<'_>, permission: &str, resource: Resource<'_>) -> Result<(), Error>;
}

/// Someone with direct access to the database: allowed everything.
pub struct LocalOperator;

#[async_trait::async_trait]
impl Authorizer for LocalOperator {
    async fn check(&self, _caller: Caller<'_>, _permission: &str, _resource: Resource<'_>) -> Result<(), Error> {
        Ok(())
    }
}
