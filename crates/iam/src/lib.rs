//! Built-in IAM: tenants, identities (people and service accounts), bearer tokens stored only as
//! their SHA-256, roles as sets of the permissions modules declare, role bindings at fleet, tenant,
//! site, pool or node scope, and the `authz_projection` of effective permissions.
//!
//! [`Iam`] is the runtime's [`Authorizer`](better_compute_runtime::authz::Authorizer): it
//! authenticates bearer tokens (cached 30 s) and decides reads (cached 10 s) and writes (never
//! cached) against the projection, and tails `authz_changes` to drop cached entries as soon as a
//! token is revoked or a binding removed.

pub mod bindings;
pub mod bootstrap;
pub mod directory;
pub mod resolver;
pub mod tokens;

use better_compute_db::Migration;
use better_compute_runtime::authz::Permission;

pub use resolver::{Iam, IdentityChange, Principal};

/// The IAM module's migrations.
pub const IAM_MIGRATIONS: &[Migration] =
    &[Migration::numbered("iam", "0001_iam", include_str!("migrations/iam/0001_iam.sql"))];

/// `iam:tenants:read` (fleet): read every tenant.
pub const TENANTS_READ: &str = "iam:tenants:read";
/// `iam:tenants:write` (fleet): create tenants.
pub const TENANTS_WRITE: &str = "iam:tenants:write";
/// `iam:identities:read` (tenant).
pub const IDENTITIES_READ: &str = "iam:identities:read";
/// `iam:identities:write` (tenant): create identities and issue or revoke their tokens.
pub const IDENTITIES_WRITE: &str = "iam:identities:write";
/// `iam:bindings:read` (tenant).
pub const BINDINGS_READ: &str = "iam:bindings:read";
/// `iam:bindings:write` (tenant): bind and unbind roles (never beyond what the granter holds).
pub const BINDINGS_WRITE: &str = "iam:bindings:write";

/// The IAM module, for the registry.
pub struct IamModule;

impl better_compute_runtime::Module for IamModule {
    fn name(&self) -> &'static str {
        "iam"
    }

    fn migrations(&self) -> &'static [Migration] {
        IAM_MIGRATIONS
    }

    fn permissions(&self) -> Vec<Permission> {
        vec![
            Permission { name: TENANTS_READ, description: "Read every tenant (fleet scope)." },
            Permission { name: TENANTS_WRITE, description: "Create tenants (fleet scope)." },
            Permission { name: IDENTITIES_READ, description: "Read the tenant's identities and their tokens' metadata." },
            Permission { name: IDENTITIES_WRITE, description: "Create identities, issue and revoke tokens." },
            Permission { name: BINDINGS_READ, description: "Read the tenant's role bindings." },
            Permission { name: BINDINGS_WRITE, description: "Bind and unbind roles, never beyond the granter's own permissions." },
        ]
    }
}
