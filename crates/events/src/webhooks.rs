//! Webhook endpoints and their dead letters: create, read, update, delete, rotate the secret,
//! send a test, list and replay dead letters. Every function is scoped to one tenant; another
//! tenant's ids are NOT_FOUND.

use better_compute_core::id::{DeliveryId, EventId, WebhookId};
use better_compute_core::page::{Page, PageRequest};
use better_compute_core::Error;
use better_compute_db::clock::rfc3339_sql;
use better_compute_db::paging::read_page;
use better_compute_db::DbError;
use better_compute_runtime::work_queue;
use serde::{Deserialize, Serialize};
use tokio_postgres::GenericClient;

use crate::signing::new_secret;
use crate::ssrf::{check_url, EgressPolicy};
use crate::DELIVER;

/// The event type of `webhooks.test`.
pub const TEST_EVENT: &str = "webhook.test";
/// The longest a rotated-out secret keeps signing.
pub const MAX_ROTATION_GRACE_S: i64 = 7 * 24 * 3600;

/// A webhook endpoint (never its secret).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookView {
    /// `wh_…`.
    pub id: String,
    /// Where deliveries go.
    pub url: String,
    /// The event types sent (empty: all of the tenant's).
    pub event_types: Vec<String>,
    /// A note.
    pub description: String,
    /// False once disabled (by an update, or by the endpoint answering 410 Gone).
    pub enabled: bool,
    /// Why it is disabled.
    pub disabled_reason: Option<String>,
    /// Until when the previous secret also signs, after a rotation.
    pub previous_secret_valid_until: Option<String>,
    /// The record's version.
    pub version: i64,
    /// RFC 3339.
    pub created_at: String,
}

/// A webhook with its secret: only when created or rotated.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookWithSecret {
    /// The endpoint.
    pub webhook: WebhookView,
    /// The signing secret (`whsec_…`), shown this once: verify `webhook-signature` with it.
    pub secret: String,
    /// What the caller should know but did not stop the create: the URL's name resolves only to
    /// non-public addresses, or not at all, now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// A delivery, as dead letters are listed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryView {
    /// `dlv_…`.
    pub id: String,
    /// The endpoint.
    pub webhook_id: String,
    /// The event (`webhook-id` on the wire).
    pub event_id: String,
    /// Its type.
    pub event_type: String,
    /// pending, delivered or dead.
    pub state: String,
    /// Attempts made.
    pub attempts: i32,
    /// The next attempt, while pending.
    pub next_attempt_at: Option<String>,
    /// The last HTTP status, if any answer came.
    pub last_status: Option<i32>,
    /// What went wrong last.
    pub last_error: Option<String>,
}

fn webhook_select() -> String {
    format!(
        "SELECT id, url, event_types, description, disabled_at IS NULL, disabled_reason,
                CASE WHEN previous_valid_until > compute_now() THEN {} END, version, {} FROM webhooks",
        rfc3339_sql("previous_valid_until"),
        rfc3339_sql("created_at")
    )
}

fn webhook_view(r: &tokio_postgres::Row) -> WebhookView {
    WebhookView {
        id: r.get(0),
        url: r.get(1),
        event_types: r.get(2),
        description: r.get(3),
        enabled: r.get(4),
        disabled_reason: r.get(5),
        previous_secret_valid_until: r.get(6),
        version: r.get(7),
        created_at: r.get(8),
    }
}

fn check_types(types: &[String], catalogue: &[&str]) -> Result<(), Error> {
    if types.len() > 100 {
        return Err(Error::invalid_argument("eventTypes: at most 100"));
    }
    if let Some(t) = types.iter().find(|t| !catalogue.contains(&t.as_str()) && t.as_str() != TEST_EVENT) {
        return Err(Error::invalid_argument(format!("eventTypes: {:?} is not an event type; see docs/events.md", better_compute_core::bounds::echo(t))));
    }
    Ok(())
}

fn check_description(d: &str) -> Result<(), Error> {
    better_compute_core::bounds::check_text("description", d, better_compute_core::bounds::NOTE_CHARS)
}

/// One webhook of the tenant.
pub async fn get(db: &impl GenericClient, tenant_id: &str, id: &str) -> Result<WebhookView, Error> {
    let r = db
        .query_opt(&format!("{} WHERE id = $1 AND tenant_id = $2", webhook_select()), &[&id, &tenant_id])
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("webhook", id))?;
    Ok(webhook_view(&r))
}

/// The tenant's webhooks, a page at a time.
pub async fn list(db: &impl GenericClient, tenant_id: &str, page: &PageRequest) -> Result<Page<WebhookView>, Error> {
    read_page(db, &webhook_select(), "tenant_id = $1", &[&tenant_id], page, webhook_view, |w: &WebhookView| w.id.clone()).await
}

/// Creates an endpoint for the tenant's events of `event_types` (empty: all). `catalogue` is the
/// registry's event types.
pub async fn create(
    tx: &impl GenericClient,
    tenant_id: &str,
    url: &str,
    event_types: &[String],
    description: &str,
    policy: EgressPolicy,
    catalogue: &[&str],
) -> Result<WebhookWithSecret, Error> {
    let url = check_url(url, policy)?;
    check_types(event_types, catalogue)?;
    check_description(description)?;
    let count: i64 = tx.query_one("SELECT count(*) FROM webhooks WHERE tenant_id = $1", &[&tenant_id]).await.map_err(DbError::from)?.get(0);
    if count >= 100 {
        return Err(Error::failed_precondition("a tenant has at most 100 webhooks; delete one first"));
    }
    let (id, secret) = (WebhookId::generate().to_string(), new_secret());
    tx.execute(
        "INSERT INTO webhooks (id, tenant_id, url, event_types, description, secret) VALUES ($1, $2, $3, $4, $5, $6)",
        &[&id, &tenant_id, &url.as_str(), &event_types, &description, &secret],
    )
    .await
    .map_err(DbError::from)?;
    Ok(WebhookWithSecret { webhook: get(tx, tenant_id, &id).await?, secret, warnings: Vec::new() })
}

/// What an update changes (absent fields stay).
#[derive(Debug, Clone, Default)]
pub struct WebhookChange<'a> {
    /// A new URL.
    pub url: Option<&'a str>,
    /// New event types.
    pub event_types: Option<&'a [String]>,
    /// A new description.
    pub description: Option<&'a str>,
    /// Enable (clears a 410's disabling) or disable.
    pub enabled: Option<bool>,
}

/// Updates an endpoint of the tenant.
pub async fn update(
    tx: &impl GenericClient,
    tenant_id: &str,
    id: &str,
    c: &WebhookChange<'_>,
    policy: EgressPolicy,
    catalogue: &[&str],
) -> Result<WebhookView, Error> {
    let url = c.url.map(|u| check_url(u, policy)).transpose()?.map(|u| u.to_string());
    if let Some(t) = c.event_types {
        check_types(t, catalogue)?;
    }
    if let Some(d) = c.description {
        check_description(d)?;
    }
    let n = tx
        .execute(
            "UPDATE webhooks SET url = coalesce($3, url), event_types = coalesce($4, event_types),
                    description = coalesce($5, description),
                    disabled_at = CASE WHEN $6::bool IS NULL THEN disabled_at WHEN $6 THEN NULL ELSE coalesce(disabled_at, compute_now()) END,
                    disabled_reason = CASE WHEN $6::bool IS NULL THEN disabled_reason WHEN $6 THEN NULL ELSE 'disabled by an update' END,
                    version = version + 1
              WHERE id = $1 AND tenant_id = $2",
            &[&id, &tenant_id, &url, &c.event_types, &c.description, &c.enabled],
        )
        .await
        .map_err(DbError::from)?;
    if n == 0 {
        return Err(Error::not_found("webhook", id));
    }
    get(tx, tenant_id, id).await
}

/// Deletes an endpoint of the tenant and its deliveries.
pub async fn delete(tx: &impl GenericClient, tenant_id: &str, id: &str) -> Result<WebhookView, Error> {
    let v = get(tx, tenant_id, id).await?;
    tx.execute("DELETE FROM webhooks WHERE id = $1 AND tenant_id = $2", &[&id, &tenant_id]).await.map_err(DbError::from)?;
    Ok(v)
}

/// Replaces the secret; the old one keeps signing (a second signature) for `grace_s`.
pub async fn rotate_secret(tx: &impl GenericClient, tenant_id: &str, id: &str, grace_s: i64) -> Result<WebhookWithSecret, Error> {
    if !(0..=MAX_ROTATION_GRACE_S).contains(&grace_s) {
        return Err(Error::invalid_argument(format!("graceS must be between 0 and {MAX_ROTATION_GRACE_S}")));
    }
    let secret = new_secret();
    let n = tx
        .execute(
            "UPDATE webhooks SET previous_secret = secret, previous_valid_until = compute_now() + make_interval(secs => $3),
                    secret = $4, version = version + 1
              WHERE id = $1 AND tenant_id = $2",
            &[&id, &tenant_id, &(grace_s as f64), &secret],
        )
        .await
        .map_err(DbError::from)?;
    if n == 0 {
        return Err(Error::not_found("webhook", id));
    }
    Ok(WebhookWithSecret { webhook: get(tx, tenant_id, id).await?, secret, warnings: Vec::new() })
}

/// Queues a `webhook.test` delivery to one endpoint now.
pub async fn send_test(tx: &impl GenericClient, tenant_id: &str, id: &str) -> Result<DeliveryView, Error> {
    get(tx, tenant_id, id).await?;
    let event_id = EventId::generate().to_string();
    let delivery = DeliveryId::generate().to_string();
    tx.execute(
        &format!(
            "INSERT INTO webhook_deliveries (id, webhook_id, tenant_id, event_id, event_type, payload, next_attempt_at)
             VALUES ($1, $2, $3, $4, $5,
                     jsonb_build_object('id', $4::text, 'type', $5::text, 'tenantId', $3::text, 'subject', $2::text,
                                        'data', '{{}}'::jsonb, 'time', {}),
                     compute_now())",
            rfc3339_sql("compute_now()")
        ),
        &[&delivery, &id, &tenant_id, &event_id, &TEST_EVENT],
    )
    .await
    .map_err(DbError::from)?;
    work_queue::enqueue(tx, &DELIVER, id).await?;
    delivery_view(tx, tenant_id, &delivery).await
}

fn delivery_select() -> String {
    format!(
        "SELECT id, webhook_id, event_id, event_type, state, attempts, {}, last_status, last_error FROM webhook_deliveries",
        rfc3339_sql("next_attempt_at")
    )
}

fn delivery_row(r: &tokio_postgres::Row) -> DeliveryView {
    DeliveryView {
        id: r.get(0),
        webhook_id: r.get(1),
        event_id: r.get(2),
        event_type: r.get(3),
        state: r.get(4),
        attempts: r.get(5),
        next_attempt_at: r.get(6),
        last_status: r.get(7),
        last_error: r.get(8),
    }
}

/// One delivery of the tenant.
pub async fn delivery_view(db: &impl GenericClient, tenant_id: &str, id: &str) -> Result<DeliveryView, Error> {
    let r = db
        .query_opt(&format!("{} WHERE id = $1 AND tenant_id = $2", delivery_select()), &[&id, &tenant_id])
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("delivery", id))?;
    Ok(delivery_row(&r))
}

/// The tenant's dead letters, optionally of one endpoint, a page at a time.
pub async fn dead_letters(db: &impl GenericClient, tenant_id: &str, webhook_id: Option<&str>, page: &PageRequest) -> Result<Page<DeliveryView>, Error> {
    let filter = "tenant_id = $1 AND state = 'dead' AND ($2::text IS NULL OR webhook_id = $2)";
    read_page(db, &delivery_select(), filter, &[&tenant_id, &webhook_id], page, delivery_row, |d: &DeliveryView| d.id.clone()).await
}

/// Sends a dead letter again from the start of the schedule. FAILED_PRECONDITION unless it is dead.
pub async fn replay(tx: &impl GenericClient, tenant_id: &str, id: &str) -> Result<DeliveryView, Error> {
    let d = delivery_view(tx, tenant_id, id).await?;
    let n = tx
        .execute(
            "UPDATE webhook_deliveries SET state = 'pending', attempts = 0, next_attempt_at = compute_now(), finished_at = NULL
              WHERE id = $1 AND tenant_id = $2 AND state = 'dead'",
            &[&id, &tenant_id],
        )
        .await
        .map_err(DbError::from)?;
    if n == 0 {
        return Err(Error::failed_precondition(format!("delivery {id} is {}, not dead", d.state)));
    }
    work_queue::enqueue(tx, &DELIVER, &d.webhook_id).await?;
    delivery_view(tx, tenant_id, id).await
}
