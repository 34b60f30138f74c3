//! quotas.*, reservations.*.

use better_compute_capacity::quota::{self, Quota};
use better_compute_capacity::reservations::{CreateReservation, ReservationView};
use better_compute_core::page::Page;
use better_compute_core::Error;
use better_compute_runtime::authz::Resource;
use serde::{Deserialize, Serialize};

use crate::method::{change, read, Ctx};
use crate::Method;

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SetQuota {
    /// The tenant whose quota this is.
    tenant_id: String,
    /// gpus, vcpu, memory_mib or disk_gib.
    resource: String,
    /// The new limit (not below what is in use).
    max: i64,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GetQuotas {
    /// Your tenant (default), or another with compute:quotas:read at fleet scope.
    #[serde(default)]
    tenant_id: Option<String>,
}

#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
struct Quotas {
    /// The tenant.
    tenant_id: String,
    /// One line per resource with a limit.
    items: Vec<Quota>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AvailabilityRequest {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `pool_…`.
    pool_id: String,
    /// The GPUs (count 1 to 64).
    gpu: better_compute_capacity::reservations::GpuRequest,
    /// How long, in seconds (at most 366 days).
    duration_s: i64,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ReservationRef {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `res_…`.
    reservation_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListReservations {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// Only this state: pending, placed, active, released, expired or failed.
    #[serde(default)]
    state: Option<String>,
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ExtendReservation {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `res_…`.
    reservation_id: String,
    /// The new end (RFC 3339), later than the current one.
    ends_at: String,
    /// Required: a retry with the same key returns the first result.
    idempotency_key: String,
}

/// Whose quotas: your own tenant's with a tenant binding; another's only with a fleet binding, and
/// NOT_FOUND without one, so nobody learns another tenant exists.
async fn quota_tenant(ctx: &Ctx, asked: Option<&str>, permission: &str) -> Result<String, Error> {
    match asked {
        None => Ok(ctx.principal.tenant_id.clone()),
        Some(t) if t == ctx.principal.tenant_id && ctx.check(permission, Resource::Tenant).await.is_ok() => Ok(t.to_owned()),
        Some(t) => match ctx.check(permission, Resource::Fleet).await {
            Ok(()) => {
                better_compute_iam::directory::get_tenant(&*ctx.read().await?, t).await?;
                Ok(t.to_owned())
            }
            Err(_) if t != ctx.principal.tenant_id => Err(Error::not_found("tenant", t)),
            Err(e) => Err(e),
        },
    }
}

pub(super) fn methods() -> Vec<Method> {
    vec![
        change("quotas.set", "Set a tenant's limit for a resource.", "compute:quotas:write at fleet scope", |ctx: Ctx, r: SetQuota| async move {
            let tenant = quota_tenant(&ctx, Some(&r.tenant_id), "compute:quotas:write").await?;
            if tenant == ctx.principal.tenant_id {
                // Tenant-scope bindings never set quotas, even one's own.
                ctx.check("compute:quotas:write", Resource::Fleet).await?;
            }
            // In the tenant's own audit log: its quota is what changed.
            let mut db = ctx.db().await?;
            let tx = (**db).transaction().await.map_err(better_compute_db::DbError::from)?;
            let q = quota::set(&tx, &tenant, &r.resource, r.max).await?;
            ctx.actor.record(&tx, "quotas.set", &tenant, Some(&tenant)).await?;
            tx.commit().await.map_err(better_compute_db::DbError::from)?;
            Ok::<Quota, Error>(q)
        }),
        read("quotas.get", "Read a tenant's quotas.", "compute:quotas:read at tenant scope (your own) or fleet scope", |ctx: Ctx, r: GetQuotas| async move {
            let tenant = quota_tenant(&ctx, r.tenant_id.as_deref(), "compute:quotas:read").await?;
            if tenant == ctx.principal.tenant_id && r.tenant_id.is_none() {
                ctx.check("compute:quotas:read", Resource::Tenant).await?;
            }
            let items = quota::get(&*ctx.read().await?, &tenant).await?;
            Ok(Quotas { tenant_id: tenant, items })
        }),
        change("reservations.create", "Reserve GPUs (whole, MIG instances or shared slots) with vCPU, memory and disk for a time range.", "compute:reservations:create at tenant scope", |ctx: Ctx, mut r: CreateReservation| async move {
            ctx.own_tenant(r.tenant_id.take().as_deref())?;
            ctx.check("compute:reservations:create", Resource::Tenant).await?;
            super::required_key(r.idempotency_key.as_deref(), "reservations.create")?;
            ctx.state.reservations.create(&ctx.actor, ctx.caller(), &r).await
        }),
        read(
            "reservations.availability",
            "What fits and when, before you reserve: in a pool, how many atoms of a GPU class are placeable, how many one node has free from now for the duration, and the earliest start within 30 days at which one node has the count free for the whole duration. Advice only: it books nothing, counts atoms (not vCPU, memory or disk) and considers nodes without taints.",
            "compute:reservations:create at tenant scope",
            |ctx: Ctx, r: AvailabilityRequest| async move {
                ctx.in_tenant(r.tenant_id.as_deref(), "compute:reservations:create").await?;
                Ok(better_compute_capacity::availability::of(&*ctx.read().await?, &r.pool_id, &r.gpu, r.duration_s).await?)
            },
        ),
        read("reservations.get", "Read a reservation of your tenant.", "compute:reservations:read at tenant scope", |ctx: Ctx, r: ReservationRef| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), "compute:reservations:read").await?;
            ctx.state.reservations.get(ctx.caller(), &r.reservation_id).await
        }),
        read("reservations.list", "List your tenant's reservations.", "compute:reservations:read at tenant scope", |ctx: Ctx, r: ListReservations| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), "compute:reservations:read").await?;
            let (size, _) = super::page(r.page_size, None).bounds()?;
            let p = ctx.state.reservations.list(ctx.caller(), r.state.as_deref(), r.page_token.as_deref(), size).await?;
            Ok(Page::<ReservationView> { items: p.items, next_page_token: p.next_cursor })
        }),
        change("reservations.extend", "Move a reservation's end later, on the same atoms. One whose end has come cannot be extended (FAILED_PRECONDITION): reserve again.", "compute:reservations:write at tenant scope", |ctx: Ctx, r: ExtendReservation| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), "compute:reservations:write").await?;
            let key = super::required_key(Some(&r.idempotency_key), "reservations.extend")?;
            ctx.state.reservations.extend(&ctx.actor, ctx.caller(), &r.reservation_id, &r.ends_at, Some(key)).await
        }),
        change("reservations.release", "End a reservation now; its quota, GPUs and scalars return.", "compute:reservations:write at tenant scope", |ctx: Ctx, r: ReservationRef| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), "compute:reservations:write").await?;
            ctx.state.reservations.release(&ctx.actor, ctx.caller(), &r.reservation_id).await
        }),
    ]
}
