//! sites.*, pools.*.

use better_compute_core::Error;
use better_compute_db::idempotency::{self, Claim, IdempotencyScope};
use better_compute_nodes::inventory::{self, NewPool};
use better_compute_nodes::listing::{self, PoolView, SiteView};
use better_compute_runtime::authz::Resource;
use serde::Deserialize;

use crate::method::{change, read, Ctx};
use crate::Method;

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateSite {
    /// Lowercase letters, digits and dashes; unique.
    name: String,
    /// Optional: a retry with the same key returns the same site.
    #[serde(default)]
    idempotency_key: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SiteRef {
    /// `site_…`.
    site_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListSites {
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreatePool {
    /// Its site.
    site_id: String,
    /// Its name, unique in the site.
    name: String,
    /// `bare-metal`, `provider` or `vps-host`.
    #[schemars(extend("enum" = ["bare-metal", "provider", "vps-host"]))]
    kind: String,
    /// vCPU overcommit, 1 to 16 (default 1).
    #[serde(default)]
    vcpu_ratio: Option<f64>,
    /// Memory overcommit, 1 to 4 (default 1).
    #[serde(default)]
    memory_ratio: Option<f64>,
    /// Disk overcommit, 1 to 4 (default 1).
    #[serde(default)]
    disk_ratio: Option<f64>,
    /// Unreachable nodes become lost after this long (provider and vps-host pools only).
    #[serde(default)]
    lost_after_s: Option<i32>,
    /// Optional: a retry with the same key returns the same pool.
    #[serde(default)]
    idempotency_key: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct PoolRef {
    /// `pool_…`.
    pub(super) pool_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListPools {
    /// Only this site's pools (needed unless you hold compute:pools:read at fleet scope).
    #[serde(default)]
    site_id: Option<String>,
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

/// Runs `create` once per `(tenant, identity, key)` when a key is given: a retry returns the first
/// result, a different request with the same key is CONFLICT.
async fn once<T: serde::Serialize + serde::de::DeserializeOwned>(
    ctx: &Ctx,
    method: &str,
    key: Option<&str>,
    request: serde_json::Value,
    create: impl AsyncFnOnce(&tokio_postgres::Transaction<'_>) -> Result<T, Error>,
) -> Result<T, Error> {
    let scope = key.map(|key| IdempotencyScope { tenant_id: &ctx.principal.tenant_id, identity_id: &ctx.principal.identity_id, key });
    if let Some(scope) = scope {
        idempotency::validate_key(scope.key)?;
    }
    ctx.in_tx(async |tx| {
        if let Some(scope) = scope {
            // A replay commits nothing new: the claim found the first result.
            if let Claim::Replay(v) = idempotency::claim(tx, scope, method, &request).await? {
                return serde_json::from_value(v).map_err(|e| Error::internal(e.to_string()));
            }
        }
        let v = create(tx).await?;
        if let Some(scope) = scope {
            idempotency::complete(tx, scope, &serde_json::to_value(&v).map_err(|e| Error::internal(e.to_string()))?).await?;
        }
        Ok(v)
    })
    .await
}

/// A number of nodes, or a share of them like `10%`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
enum CountOrShare {
    /// Nodes.
    Count(i64),
    /// `3` or `10%`.
    Share(String),
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct UpdatePool {
    /// `pool_…`.
    pool_id: String,
    /// The disruption budget: at most this many of the pool's nodes (`2`) or this share of them
    /// (`10%`, rounded up) unavailable at once through drains, counting nodes that are unreachable
    /// or lost; `100%` is no limit. Drains beyond it wait, queued, in request order.
    max_unavailable: CountOrShare,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct BootSite {
    /// `site_…`.
    site_id: String,
    /// Why (shown in the site.bootStarted event).
    #[serde(default)]
    reason: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct UpdateSite {
    /// `site_…`.
    site_id: String,
    /// Sessions admitted per second while the site boots (1 to 100,000; default 50).
    #[serde(default)]
    boot_admit_per_s: Option<i32>,
    /// The share of its joined nodes connected and converged that ends a boot (1 to 100; default 90).
    #[serde(default)]
    boot_converged_percent: Option<i32>,
    /// The share of its joined nodes unreachable that starts a boot (1 to 100; default 50).
    #[serde(default)]
    boot_outage_percent: Option<i32>,
}

#[allow(clippy::too_many_lines, reason = "the module's method table: one short registration per method, read as a list")]
pub(super) fn methods() -> Vec<Method> {
    vec![
        change("sites.create", "Create a site.", "compute:sites:write at fleet scope", |ctx: Ctx, r: CreateSite| async move {
            ctx.check("compute:sites:write", Resource::Fleet).await?;
            let request = serde_json::json!({"name": r.name});
            once(&ctx, "sites.create", r.idempotency_key.as_deref(), request, async |tx| -> Result<SiteView, Error> {
                let id = inventory::create_site(tx, &r.name).await?;
                listing::get_site(tx, &id).await
            })
            .await
        }),
        read("sites.get", "Read a site.", "compute:sites:read on the site", |ctx: Ctx, r: SiteRef| async move {
            ctx.check("compute:sites:read", Resource::Site(&r.site_id)).await?;
            listing::get_site(&*ctx.read().await?, &r.site_id).await
        }),
        change(
            "sites.boot",
            "Boot a site: its sessions are admitted at the site's pace and placement on it waits until enough of its nodes converged (when a site is first brought up; an outage starts one by itself).",
            "compute:sites:write on the site",
            |ctx: Ctx, r: BootSite| async move {
                ctx.check("compute:sites:write", Resource::Site(&r.site_id)).await?;
                let why = r.reason.unwrap_or_else(|| "an operator booted it".into());
                better_compute_core::bounds::check_text("reason", &why, better_compute_core::bounds::NOTE_CHARS)?;
                ctx.in_tx(async |tx| -> Result<SiteView, Error> {
                    better_compute_nodes::sessions::site_boot::start(tx, &r.site_id, &why).await?;
                    listing::get_site(tx, &r.site_id).await
                })
                .await
            },
        ),
        change("sites.update", "Change a site's boot settings.", "compute:sites:write on the site", |ctx: Ctx, r: UpdateSite| async move {
            ctx.check("compute:sites:write", Resource::Site(&r.site_id)).await?;
            let settings = better_compute_nodes::sessions::site_boot::BootSettings {
                admit_per_s: r.boot_admit_per_s,
                converged_percent: r.boot_converged_percent,
                outage_percent: r.boot_outage_percent,
            };
            ctx.in_tx(async |tx| -> Result<SiteView, Error> {
                better_compute_nodes::sessions::site_boot::configure(tx, &r.site_id, settings).await?;
                listing::get_site(tx, &r.site_id).await
            })
            .await
        }),
        read("sites.list", "List sites.", "compute:sites:read at fleet scope", |ctx: Ctx, r: ListSites| async move {
            ctx.check("compute:sites:read", Resource::Fleet).await?;
            listing::list_sites(&*ctx.read().await?, &super::page(r.page_size, r.page_token)).await
        }),
        change("pools.create", "Create a pool in a site.", "compute:pools:write on the site", |ctx: Ctx, r: CreatePool| async move {
            ctx.check("compute:pools:write", Resource::Site(&r.site_id)).await?;
            let p = NewPool {
                site_id: r.site_id.clone(),
                name: r.name.clone(),
                kind: r.kind.clone(),
                vcpu_ratio: r.vcpu_ratio.unwrap_or(1.0),
                memory_ratio: r.memory_ratio.unwrap_or(1.0),
                disk_ratio: r.disk_ratio.unwrap_or(1.0),
                lost_after_s: r.lost_after_s,
            };
            let request = serde_json::to_value(&p).map_err(|e| Error::internal(e.to_string()))?;
            once(&ctx, "pools.create", r.idempotency_key.as_deref(), request, async |tx| -> Result<PoolView, Error> {
                let id = inventory::create_pool(tx, &p).await?;
                listing::get_pool(tx, &id).await
            })
            .await
        }),
        read("pools.get", "Read a pool.", "compute:pools:read on the pool", |ctx: Ctx, r: PoolRef| async move {
            ctx.check("compute:pools:read", Resource::Pool(&r.pool_id)).await?;
            listing::get_pool(&*ctx.read().await?, &r.pool_id).await
        }),
        change("pools.update", "Change a pool's disruption budget (maxUnavailable).", "compute:pools:write on the pool", |ctx: Ctx, r: UpdatePool| async move {
            ctx.check("compute:pools:write", Resource::Pool(&r.pool_id)).await?;
            let budget = match &r.max_unavailable {
                CountOrShare::Count(n) => better_compute_nodes::drain::Budget::parse(&n.to_string())?,
                CountOrShare::Share(s) => better_compute_nodes::drain::Budget::parse(s)?,
            };
            ctx.in_tx(async |tx| -> Result<PoolView, Error> {
                better_compute_nodes::drain::set_budget(tx, &r.pool_id, budget).await?;
                listing::get_pool(tx, &r.pool_id).await
            })
            .await
        }),
        change(
            "pools.closeHealthCircuit",
            "Close a pool's health circuit after deciding what the errors were: the health signals that waited are set aside, and automatic health actions resume.",
            "compute:pools:write on the pool",
            |ctx: Ctx, r: PoolRef| async move {
                ctx.check("compute:pools:write", Resource::Pool(&r.pool_id)).await?;
                ctx.in_tx(async |tx| -> Result<PoolView, Error> {
                    better_compute_nodes::health::close_circuit(tx, &r.pool_id).await?;
                    listing::get_pool(tx, &r.pool_id).await
                })
                .await
            },
        ),
        read("pools.list", "List pools, of one site or of the fleet.", "compute:pools:read on the site, or at fleet scope without siteId", |ctx: Ctx, r: ListPools| async move {
            match &r.site_id {
                Some(s) => ctx.check("compute:pools:read", Resource::Site(s)).await?,
                None => ctx.check("compute:pools:read", Resource::Fleet).await?,
            }
            listing::list_pools(&*ctx.read().await?, r.site_id.as_deref(), &super::page(r.page_size, r.page_token)).await
        }),
    ]
}

