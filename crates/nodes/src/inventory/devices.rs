//! GPUs as the API shows them (`devices.list`, `devices.get`): each physical GPU with its mode,
//! layout, health, quarantine and atoms (the GPU itself in exclusive mode, else its MIG instances
//! or shared slots).

use better_compute_core::page::{Page, PageRequest};
use better_compute_core::Error;
use better_compute_db::paging::read_page;
use better_compute_db::DbError;
use serde::Serialize;
use tokio_postgres::GenericClient;

/// One atom of a GPU: what a reservation books.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AtomView {
    /// The atom's id: the GPU's uuid in exclusive mode, else `<uuid>/mig/<n>` or `<uuid>/slot/<n>`.
    pub id: String,
    /// `gpu`, `mig` or `slot`.
    pub kind: String,
    /// The MIG profile (`1g.10gb`, …) of a MIG instance.
    pub profile: Option<String>,
    /// Its memory.
    pub memory_mib: i32,
    /// Whether the current mode has it (a retired layout's atoms are kept, inactive, for history).
    pub active: bool,
}

/// A physical GPU.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeviceView {
    /// Its uuid (`GPU-…`).
    pub id: String,
    /// Its node.
    pub node_id: String,
    /// Its index on the node.
    pub index: i16,
    /// Its model, e.g. `H100-80GB`.
    pub model: String,
    /// Its memory.
    pub memory_mib: i32,
    /// `exclusive`, `mig`, `time-slice` or `mps`.
    #[schemars(extend("enum" = ["exclusive", "mig", "time-slice", "mps"]))]
    pub mode: String,
    /// The MIG layout (profiles, in order) in mode `mig`.
    pub mig_layout: Vec<String>,
    /// Shared slots in mode `time-slice` or `mps`.
    pub slots: i16,
    /// Whether it is in placement as far as health goes (its health state is `healthy`).
    pub healthy: bool,
    /// `healthy`, `suspect` (a transient error; being checked), `recovering` (checks passing) or
    /// `unhealthy` (quarantined).
    #[schemars(extend("enum" = ["healthy", "suspect", "recovering", "unhealthy"]))]
    pub health_state: String,
    /// Why it is in that state.
    pub health_reason: Option<String>,
    /// RFC 3339: since when.
    pub health_since: Option<String>,
    /// Its newest health transitions, newest first.
    pub health_history: Vec<crate::health::HealthChange>,
    /// What its daemon reported lately (XIDs, PCIe link, throttling), newest first, with what the
    /// health job made of each.
    pub recent_signals: Vec<crate::health::Signal>,
    /// Whether an operator quarantined it: nothing new is placed on it.
    pub quarantined: bool,
    /// Why, while quarantined.
    pub quarantine_reason: Option<String>,
    /// Whether new placements may use it: healthy, not quarantined, on a node without
    /// `noScheduleReasons`.
    pub schedulable: bool,
    /// Its atoms, in index order.
    pub atoms: Vec<AtomView>,
    /// The record's version.
    pub version: i64,
}

const DEVICE_VIEW: &str = "SELECT g.id, g.node_id, g.index, g.model, g.memory_mib, g.mode, g.mig_layout, g.slots, g.healthy, g.quarantined,
       g.quarantine_reason, g.healthy AND NOT g.quarantined AND cardinality(n.no_schedule_reasons) = 0,
       coalesce((SELECT jsonb_agg(jsonb_build_object('id', a.id, 'kind', a.kind, 'profile', a.profile, 'memoryMib', a.memory_mib,
                                                     'active', a.active) ORDER BY a.index, a.id)
                   FROM devices a WHERE a.parent_id = g.id),
                CASE WHEN g.mode = 'exclusive' THEN jsonb_build_array(jsonb_build_object('id', g.id, 'kind', 'gpu', 'profile', NULL,
                                                   'memoryMib', g.memory_mib, 'active', g.active)) ELSE '[]'::jsonb END),
       g.version, g.health_state, g.health_reason, nodes_ts(g.health_since),
       coalesce((SELECT jsonb_agg(jsonb_build_object('from', h.from_state, 'to', h.to_state, 'reason', h.reason, 'at', nodes_ts(h.at)) ORDER BY h.id DESC)
                   FROM (SELECT * FROM gpu_health_history x WHERE x.device_id = g.id ORDER BY x.id DESC LIMIT 10) h), '[]'::jsonb),
       coalesce((SELECT jsonb_agg(jsonb_build_object('kind', x.kind, 'class', x.class, 'detail', x.detail, 'observedAt', nodes_ts(x.observed_at),
                                                     'outcome', x.outcome) ORDER BY x.id DESC)
                   FROM (SELECT * FROM gpu_health_signals y WHERE y.device_id = g.id ORDER BY y.id DESC LIMIT 10) x), '[]'::jsonb),
       n.pool_id
  FROM devices g JOIN nodes n ON n.id = g.node_id";

fn device(r: &tokio_postgres::Row) -> DeviceView {
    let atoms: serde_json::Value = r.get(12);
    DeviceView {
        id: r.get(0),
        node_id: r.get(1),
        index: r.get(2),
        model: r.get(3),
        memory_mib: r.get(4),
        mode: r.get(5),
        mig_layout: r.get(6),
        slots: r.get(7),
        healthy: r.get(8),
        quarantined: r.get(9),
        quarantine_reason: r.get(10),
        schedulable: r.get(11),
        atoms: serde_json::from_value(atoms).unwrap_or_default(),
        version: r.get(13),
        health_state: r.get(14),
        health_reason: r.get(15),
        health_since: r.get(16),
        health_history: serde_json::from_value(r.get(17)).unwrap_or_default(),
        recent_signals: serde_json::from_value(r.get(18)).unwrap_or_default(),
    }
}

/// One GPU by uuid.
pub async fn get_device(db: &impl GenericClient, uuid: &str) -> Result<DeviceView, Error> {
    let r = db
        .query_opt(&format!("{DEVICE_VIEW} WHERE g.id = $1 AND g.parent_id IS NULL"), &[&uuid])
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("device", uuid))?;
    Ok(device(&r))
}

/// The GPUs of a node or of a pool (exactly one of them), a page at a time, by uuid.
pub async fn list_devices(db: &impl GenericClient, node_id: Option<&str>, pool_id: Option<&str>, page: &PageRequest) -> Result<Page<DeviceView>, Error> {
    let select = format!("SELECT * FROM ({DEVICE_VIEW} WHERE g.parent_id IS NULL) d");
    // read_page's `id` is the outer select's first column, the uuid.
    let filter = "($1::text IS NULL OR d.node_id = $1) AND ($2::text IS NULL OR d.pool_id = $2)";
    read_page(db, &select, filter, &[&node_id, &pool_id], page, device, |d: &DeviceView| d.id.clone()).await
}
