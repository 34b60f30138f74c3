//! `events.fanout`: an outbox sink that turns each tenant event into one delivery row per matching
//! enabled webhook of that tenant, in the sink's fenced transaction (with its cursor), and wakes
//! the deliverer in the same transaction.

use better_compute_core::id::DeliveryId;
use better_compute_runtime::outbox::{Event, Sink};
use better_compute_runtime::{work_queue, RunError};
use tokio_postgres::Transaction;

use crate::DELIVER;

/// The fan-out sink.
pub struct Fanout;

#[async_trait::async_trait]
impl Sink for Fanout {
    fn name(&self) -> &str {
        "events.fanout"
    }

    async fn deliver(&self, tx: &Transaction<'_>, events: &[Event]) -> Result<(), RunError> {
        let tenants: Vec<&str> = events.iter().filter_map(|e| e.tenant_id.as_deref()).collect();
        if tenants.is_empty() {
            return Ok(());
        }
        let hooks = tx
            .query("SELECT id, tenant_id, event_types FROM webhooks WHERE tenant_id = ANY($1) AND disabled_at IS NULL", &[&tenants])
            .await?;
        let (mut ids, mut hook_ids, mut tenant_ids, mut event_ids, mut types, mut payloads) = (vec![], vec![], vec![], vec![], vec![], vec![]);
        for e in events {
            let Some(tenant) = e.tenant_id.as_deref() else { continue };
            for h in hooks.iter().filter(|h| h.get::<_, &str>(1) == tenant) {
                let wanted: Vec<String> = h.get(2);
                if wanted.is_empty() || wanted.contains(&e.event_type) {
                    ids.push(DeliveryId::generate().to_string());
                    hook_ids.push(h.get::<_, String>(0));
                    tenant_ids.push(tenant.to_owned());
                    event_ids.push(e.id.clone());
                    types.push(e.event_type.clone());
                    payloads.push(e.envelope());
                }
            }
        }
        if ids.is_empty() {
            return Ok(());
        }
        // At least once: a batch delivered again finds its rows and inserts nothing.
        tx.execute(
            "INSERT INTO webhook_deliveries (id, webhook_id, tenant_id, event_id, event_type, payload, next_attempt_at)
             SELECT d.id, d.webhook_id, d.tenant_id, d.event_id, d.event_type, d.payload, compute_now()
               FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::jsonb[])
                    AS d(id, webhook_id, tenant_id, event_id, event_type, payload)
             ON CONFLICT (webhook_id, event_id) DO NOTHING",
            &[&ids, &hook_ids, &tenant_ids, &event_ids, &types, &payloads],
        )
        .await?;
        // Each endpoint's key, once.
        let mut endpoints = hook_ids.clone();
        endpoints.sort();
        endpoints.dedup();
        work_queue::enqueue_many(tx, &DELIVER, &endpoints).await?;
        Ok(())
    }
}
