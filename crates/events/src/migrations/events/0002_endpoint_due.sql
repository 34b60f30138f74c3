-- Each endpoint's deliveries are claimed on their own (events.deliver runs a key per webhook):
-- its due ones, oldest first.
CREATE INDEX webhook_deliveries_endpoint_due ON webhook_deliveries (webhook_id, next_attempt_at, id) WHERE state = 'pending';
