//! The event catalogue: every module declares the event types it writes to the outbox, with the
//! version of their data and its fields. Webhook filters are checked against it, and the reference
//! page (`docs/events.md`) is generated from it.

/// An event type a module writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventType {
    /// `resource.what`, e.g. `reservation.placed`.
    pub name: &'static str,
    /// The version of `data`'s shape; raised when a field changes meaning or goes away.
    pub version: u32,
    /// Who sees it: `tenant` (the tenant it names) or `fleet` (operators with fleet read access).
    pub audience: &'static str,
    /// When it is written.
    pub description: &'static str,
    /// `data`'s fields and what they hold.
    pub data: &'static [(&'static str, &'static str)],
}

/// The reference page for `types`.
pub fn reference_page(types: &[EventType]) -> String {
    let mut s = String::from(
        "# Events\n\nGenerated from the registry by `better-compute docs events`; a test fails when this page and the\n\
         registry differ.\n\n\
         Every event is `{ id, type, tenantId, subject, data, time }`. `id` (`evt_…`) is the deduplication key:\n\
         delivery is at least once. Tenant events reach that tenant's webhooks and watch streams; fleet events\n\
         (no tenant) reach watch streams of identities with `compute:nodes:read` at fleet scope.\n\n\
         | type | version | audience | subject | when |\n| --- | --- | --- | --- | --- |\n",
    );
    for t in types {
        let subject = t.name.split('.').next().unwrap_or("");
        s.push_str(&format!("| `{}` | {} | {} | the {subject} | {} |\n", t.name, t.version, t.audience, t.description));
    }
    s.push('\n');
    for t in types {
        s.push_str(&format!("## `{}` (v{})\n\n{}\n\n", t.name, t.version, t.description));
        if t.data.is_empty() {
            s.push_str("`data` is empty.\n\n");
        } else {
            s.push_str("| data field | holds |\n| --- | --- |\n");
            for (f, d) in t.data {
                s.push_str(&format!("| `{f}` | {d} |\n"));
            }
            s.push('\n');
        }
    }
    s
}
