//! Reads for the API: sites, pools and nodes by id and in pages, a GPU's node, a node's commands,
//! and join tokens.

use base64::Engine;
use better_compute_core::id::JoinTokenId;
use better_compute_core::page::{Page, PageRequest};
use better_compute_core::Error;
use better_compute_db::clock::rfc3339_sql as ts;
use better_compute_db::paging::read_page;
use better_compute_db::DbError;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio_postgres::GenericClient;

use crate::commands::{to_view, CommandView, VIEW};
use crate::inventory::{node_view, NodeView, NODE_VIEW};

/// A site.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SiteView {
    /// `site_…`.
    pub id: String,
    /// Its name.
    pub name: String,
    /// The record's version.
    pub version: i64,
    /// RFC 3339.
    pub created_at: String,
    /// `normal`, or `booting`: its sessions are admitted at a pace and placement on it waits
    /// (see site boot in docs/node-operations.md).
    #[schemars(extend("enum" = ["normal", "booting"]))]
    pub boot_state: String,
    /// RFC 3339, while booting.
    pub boot_since: Option<String>,
    /// Sessions admitted per second while booting.
    pub boot_admit_per_s: i32,
    /// The share of its joined nodes connected and converged that ends a boot.
    pub boot_converged_percent: i32,
    /// The share of its joined nodes unreachable that starts a boot.
    pub boot_outage_percent: i32,
}

/// A pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolView {
    /// `pool_…`.
    pub id: String,
    /// Its site.
    pub site_id: String,
    /// Its name, unique in the site.
    pub name: String,
    /// `bare-metal`, `provider` or `vps-host`.
    #[schemars(extend("enum" = ["bare-metal", "provider", "vps-host"]))]
    pub kind: String,
    /// vCPU overcommit.
    pub vcpu_ratio: f64,
    /// Memory overcommit.
    pub memory_ratio: f64,
    /// Disk overcommit.
    pub disk_ratio: f64,
    /// Unreachable nodes become lost after this long.
    pub lost_after_s: Option<i32>,
    /// The disruption budget: `3` nodes or `10%` of them unavailable at once (drains, and nodes
    /// unreachable or lost); none: no limit.
    pub max_unavailable: Option<String>,
    /// RFC 3339, while the pool's health circuit is open: automatic health actions are stopped
    /// until an operator closes it (`pools.closeHealthCircuit`).
    pub health_circuit_open_since: Option<String>,
    /// The record's version.
    pub version: i64,
}

fn site(r: &tokio_postgres::Row) -> SiteView {
    SiteView {
        id: r.get(0),
        name: r.get(1),
        version: r.get(2),
        created_at: r.get(3),
        boot_state: r.get(4),
        boot_since: r.get(5),
        boot_admit_per_s: r.get(6),
        boot_converged_percent: r.get(7),
        boot_outage_percent: r.get(8),
    }
}

fn site_select() -> String {
    format!(
        "SELECT id, name, version, {}, boot_state, {}, boot_admit_per_s, boot_converged_percent, boot_outage_percent FROM sites",
        ts("created_at"),
        ts("boot_since")
    )
}

fn pool(r: &tokio_postgres::Row) -> PoolView {
    PoolView {
        id: r.get(0),
        site_id: r.get(1),
        name: r.get(2),
        kind: r.get(3),
        vcpu_ratio: r.get(4),
        memory_ratio: r.get(5),
        disk_ratio: r.get(6),
        lost_after_s: r.get(7),
        version: r.get(8),
        max_unavailable: r.get(9),
        health_circuit_open_since: r.get(10),
    }
}

const POOL: &str = "SELECT id, site_id, name, kind, vcpu_ratio, memory_ratio, disk_ratio, lost_after_s, version,
                           coalesce(max_unavailable::text, max_unavailable_percent::text || '%'),
                           nodes_ts((SELECT c.open_since FROM pool_health_circuits c WHERE c.pool_id = pools.id)) FROM pools";

/// One site.
pub async fn get_site(db: &impl GenericClient, id: &str) -> Result<SiteView, Error> {
    let r = db
        .query_opt(&format!("{} WHERE id = $1", site_select()), &[&id])
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("site", id))?;
    Ok(site(&r))
}

/// Sites, a page at a time.
pub async fn list_sites(db: &impl GenericClient, page: &PageRequest) -> Result<Page<SiteView>, Error> {
    read_page(db, &site_select(), "true", &[], page, site, |s: &SiteView| s.id.clone()).await
}

/// One pool.
pub async fn get_pool(db: &impl GenericClient, id: &str) -> Result<PoolView, Error> {
    let r = db
        .query_opt(&format!("{POOL} WHERE id = $1"), &[&id])
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("pool", id))?;
    Ok(pool(&r))
}

/// Pools, optionally of one site, a page at a time.
pub async fn list_pools(db: &impl GenericClient, site_id: Option<&str>, page: &PageRequest) -> Result<Page<PoolView>, Error> {
    read_page(db, POOL, "$1::text IS NULL OR site_id = $1", &[&site_id], page, pool, |p: &PoolView| p.id.clone()).await
}

/// Filters of `nodes.list`.
#[derive(Debug, Clone, Default)]
pub struct NodeFilter<'a> {
    /// Only this pool's nodes.
    pub pool_id: Option<&'a str>,
    /// Only cordoned (true) or only uncordoned (false) nodes.
    pub cordoned: Option<bool>,
    /// Only nodes in this liveness.
    pub liveness: Option<&'a str>,
    /// Only nodes whose labels match.
    pub labels: Option<crate::inventory::labels::LabelSelector>,
}

/// Nodes, filtered, a page at a time.
pub async fn list_nodes(db: &impl GenericClient, f: &NodeFilter<'_>, page: &PageRequest) -> Result<Page<NodeView>, Error> {
    let (labels, values) = f.labels.clone().unwrap_or_default().sql(4);
    let filter = format!(
        "($1::text IS NULL OR pool_id = $1) AND ($2::bool IS NULL OR ('cordoned' = ANY(no_schedule_reasons)) = $2)
         AND ($3::text IS NULL OR liveness = $3) AND {labels}"
    );
    let [a, b, c, d] = &values;
    read_page(db, NODE_VIEW, &filter, &[&f.pool_id, &f.cordoned, &f.liveness, a, b, c, d], page, node_view, |n: &NodeView| n.id.clone()).await
}

/// The node of a GPU (by uuid), or NOT_FOUND.
pub async fn node_of_device(db: &impl GenericClient, uuid: &str) -> Result<String, Error> {
    Ok(db
        .query_opt("SELECT node_id FROM devices WHERE id = $1 AND parent_id IS NULL", &[&uuid])
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("device", uuid))?
        .get(0))
}

/// A node's commands requested by one tenant, a page at a time.
pub async fn list_commands(db: &impl GenericClient, node_id: &str, tenant_id: &str, page: &PageRequest) -> Result<Page<CommandView>, Error> {
    let filter = "node_id = $1 AND split_part(requested_by, '/', 1) = $2";
    read_page(db, VIEW, filter, &[&node_id, &tenant_id], page, to_view, |c: &CommandView| c.id.clone()).await
}

/// Whether a command was requested by the tenant (commands are the requesting tenant's to see).
pub async fn command_is_tenants(db: &impl GenericClient, node_id: &str, command_id: &str, tenant_id: &str) -> Result<bool, Error> {
    Ok(db
        .query_opt(
            "SELECT 1 FROM commands WHERE id = $1 AND node_id = $2 AND split_part(requested_by, '/', 1) = $3",
            &[&command_id, &node_id, &tenant_id],
        )
        .await
        .map_err(DbError::from)?
        .is_some())
}

/// A join token just issued: the only time its secret is seen.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IssuedJoinToken {
    /// `jt_…`.
    pub id: String,
    /// The pool a daemon joins with it.
    pub pool_id: String,
    /// The secret (`bcj_…`), single use: give it to `better-compute daemon --join-token`.
    pub secret: String,
    /// RFC 3339.
    pub expires_at: String,
}

/// Issues a single-use join token for a pool, valid `ttl_s` (60 s to 7 days, default 1 hour).
pub async fn create_join_token(tx: &impl GenericClient, pool_id: &str, ttl_s: Option<i64>, created_by: &str) -> Result<IssuedJoinToken, Error> {
    let ttl_s = ttl_s.unwrap_or(3600);
    if !(60..=7 * 24 * 3600).contains(&ttl_s) {
        return Err(Error::invalid_argument("ttlS must be between 60 and 604800 (7 days)"));
    }
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the operating system's random source works");
    let secret = format!("bcj_{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes));
    let hash: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
    let id = JoinTokenId::generate().to_string();
    let row = tx
        .query_opt(
            &format!(
                "INSERT INTO join_tokens (id, pool_id, secret_sha256, expires_at, created_by)
                 SELECT $1, p.id, $3, compute_now() + make_interval(secs => $4), $5 FROM pools p WHERE p.id = $2
                 RETURNING {}",
                ts("expires_at")
            ),
            &[&id, &pool_id, &hash.as_slice(), &(ttl_s as f64), &created_by],
        )
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("pool", pool_id))?;
    Ok(IssuedJoinToken { id, pool_id: pool_id.to_owned(), secret, expires_at: row.get(0) })
}

/// A node as the operator's `nodes list` shows it: where it is, its liveness, whether it has
/// converged (generation against observed generation) and why placement skips it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeSummary {
    /// `node_…`.
    pub id: String,
    /// Its name.
    pub name: String,
    /// Its pool's name.
    pub pool: String,
    /// connected, disconnected, unreachable or lost.
    pub liveness: String,
    /// Its desired state's generation.
    pub generation: i64,
    /// The generation its daemon applied last.
    pub observed_generation: i64,
    /// Why the placer skips it.
    pub no_schedule_reasons: Vec<String>,
}

/// Every node, by pool name then node name (the operator's view; no tenant scope).
pub async fn node_summaries(db: &impl GenericClient) -> Result<Vec<NodeSummary>, DbError> {
    let rows = db
        .query(
            "SELECT n.id, n.name, p.name, n.liveness, n.generation, n.observed_generation, n.no_schedule_reasons
               FROM nodes n JOIN pools p ON p.id = n.pool_id ORDER BY p.name, n.name",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| NodeSummary {
            id: r.get(0),
            name: r.get(1),
            pool: r.get(2),
            liveness: r.get(3),
            generation: r.get(4),
            observed_generation: r.get(5),
            no_schedule_reasons: r.get(6),
        })
        .collect())
}

/// The ids of the nodes with these names, by name (names are unique within a pool only).
pub async fn node_ids_named(db: &impl GenericClient, names: &[String]) -> Result<Vec<String>, DbError> {
    Ok(db.query("SELECT id FROM nodes WHERE name = ANY($1) ORDER BY name", &[&names]).await?.iter().map(|r| r.get(0)).collect())
}

/// Whether any site exists yet.
pub async fn any_site(db: &impl GenericClient) -> Result<bool, DbError> {
    Ok(db.query_one("SELECT EXISTS (SELECT 1 FROM sites)", &[]).await?.get(0))
}

/// The id of the pool `pool` of the site named `site`, if there is one.
pub async fn pool_named(db: &impl GenericClient, site: &str, pool: &str) -> Result<Option<String>, DbError> {
    Ok(db
        .query_opt("SELECT p.id FROM pools p JOIN sites s ON s.id = p.site_id WHERE s.name = $1 AND p.name = $2", &[&site, &pool])
        .await?
        .map(|r| r.get(0)))
}
