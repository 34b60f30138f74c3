//! webhooks.*: the tenant's endpoints, their secrets and dead letters.

use better_compute_core::Error;
use better_compute_events::webhooks::{self, DeliveryView, WebhookChange, WebhookView, WebhookWithSecret};
use better_compute_events::{EgressPolicy, WEBHOOKS_READ, WEBHOOKS_WRITE};
use serde::Deserialize;

use super::{page, TenantPage};
use crate::method::{change, read, Ctx};
use crate::Method;

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateWebhook {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// An https URL on the public internet.
    url: String,
    /// Event types to send (default: all of the tenant's); see docs/events.md.
    #[serde(default)]
    event_types: Vec<String>,
    /// A note.
    #[serde(default)]
    description: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WebhookRef {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `wh_…`.
    webhook_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct UpdateWebhook {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `wh_…`.
    webhook_id: String,
    /// A new URL.
    #[serde(default)]
    url: Option<String>,
    /// New event types.
    #[serde(default)]
    event_types: Option<Vec<String>>,
    /// A new note.
    #[serde(default)]
    description: Option<String>,
    /// Enable (also after a 410 disabled it) or disable.
    #[serde(default)]
    enabled: Option<bool>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RotateSecret {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `wh_…`.
    webhook_id: String,
    /// How long in seconds the old secret keeps signing too (default 86400, at most 7 days);
    /// `graceSeconds` is accepted too.
    #[serde(default, alias = "graceSeconds")]
    grace_s: Option<i64>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListDeadLetters {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// Only this endpoint's.
    #[serde(default)]
    webhook_id: Option<String>,
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct DeliveryRef {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `dlv_…`.
    delivery_id: String,
}

/// The registry's event types, for checking filters.
fn catalogue(ctx: &Ctx) -> Vec<&'static str> {
    ctx.state.registry.event_types().iter().map(|t| t.name).collect()
}

async fn write<T>(ctx: &Ctx, tenant: Option<&str>, f: impl AsyncFnOnce(&tokio_postgres::Transaction<'_>) -> Result<T, Error>) -> Result<T, Error> {
    ctx.in_tenant(tenant, WEBHOOKS_WRITE).await?;
    ctx.in_tx(f).await
}

pub(super) fn methods() -> Vec<Method> {
    vec![
        change("webhooks.create", "Create a webhook endpoint for your tenant's events. The signing secret is in this response only.", "compute:webhooks:write at tenant scope", |ctx: Ctx, r: CreateWebhook| async move {
            let (policy, types) = (EgressPolicy::from_env(), catalogue(&ctx));
            ctx.in_tenant(r.tenant_id.as_deref(), WEBHOOKS_WRITE).await?;
            // Resolved before the transaction, so no connection waits on DNS.
            let warnings = better_compute_events::ssrf::resolution_warnings(&r.url, policy).await;
            let mut made = ctx
                .in_tx(async |tx| -> Result<WebhookWithSecret, Error> {
                    webhooks::create(tx, &ctx.principal.tenant_id, &r.url, &r.event_types, &r.description, policy, &types).await
                })
                .await?;
            made.warnings = warnings;
            Ok(made)
        }),
        read("webhooks.get", "Read a webhook endpoint.", "compute:webhooks:read at tenant scope", |ctx: Ctx, r: WebhookRef| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), WEBHOOKS_READ).await?;
            webhooks::get(&*ctx.read().await?, &ctx.principal.tenant_id, &r.webhook_id).await
        }),
        read("webhooks.list", "List your tenant's webhook endpoints.", "compute:webhooks:read at tenant scope", |ctx: Ctx, r: TenantPage| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), WEBHOOKS_READ).await?;
            webhooks::list(&*ctx.read().await?, &ctx.principal.tenant_id, &r.page()).await
        }),
        change("webhooks.update", "Change a webhook endpoint's URL, event types or note; enable or disable it.", "compute:webhooks:write at tenant scope", |ctx: Ctx, r: UpdateWebhook| async move {
            let (policy, types) = (EgressPolicy::from_env(), catalogue(&ctx));
            let change = WebhookChange { url: r.url.as_deref(), event_types: r.event_types.as_deref(), description: r.description.as_deref(), enabled: r.enabled };
            write(&ctx, r.tenant_id.as_deref(), async |tx| -> Result<WebhookView, Error> {
                webhooks::update(tx, &ctx.principal.tenant_id, &r.webhook_id, &change, policy, &types).await
            })
            .await
        }),
        change("webhooks.delete", "Delete a webhook endpoint and its deliveries.", "compute:webhooks:write at tenant scope", |ctx: Ctx, r: WebhookRef| async move {
            write(&ctx, r.tenant_id.as_deref(), async |tx| webhooks::delete(tx, &ctx.principal.tenant_id, &r.webhook_id).await).await
        }),
        change("webhooks.rotateSecret", "Give a webhook a new signing secret; the old one keeps signing (a second signature) for the grace period.", "compute:webhooks:write at tenant scope", |ctx: Ctx, r: RotateSecret| async move {
            write(&ctx, r.tenant_id.as_deref(), async |tx| {
                webhooks::rotate_secret(tx, &ctx.principal.tenant_id, &r.webhook_id, r.grace_s.unwrap_or(86_400)).await
            })
            .await
        }),
        change("webhooks.test", "Send a webhook.test event to one endpoint now.", "compute:webhooks:write at tenant scope", |ctx: Ctx, r: WebhookRef| async move {
            let d: DeliveryView = write(&ctx, r.tenant_id.as_deref(), async |tx| webhooks::send_test(tx, &ctx.principal.tenant_id, &r.webhook_id).await).await?;
            better_compute_runtime::work_queue::poke(&**ctx.db().await?).await;
            Ok(d)
        }),
        read("webhooks.deadLetters.list", "List deliveries that exhausted their retries (or met a disabled endpoint).", "compute:webhooks:read at tenant scope", |ctx: Ctx, r: ListDeadLetters| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), WEBHOOKS_READ).await?;
            webhooks::dead_letters(&*ctx.read().await?, &ctx.principal.tenant_id, r.webhook_id.as_deref(), &page(r.page_size, r.page_token)).await
        }),
        change("webhooks.deadLetters.replay", "Send a dead letter again, from the start of the retry schedule.", "compute:webhooks:write at tenant scope", |ctx: Ctx, r: DeliveryRef| async move {
            let d = write(&ctx, r.tenant_id.as_deref(), async |tx| webhooks::replay(tx, &ctx.principal.tenant_id, &r.delivery_id).await).await?;
            better_compute_runtime::work_queue::poke(&**ctx.db().await?).await;
            Ok(d)
        }),
    ]
}
