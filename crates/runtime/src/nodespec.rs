//! Desired state: every module's part of a node's desired state ([`NodeSpecPart`]), merged in
//! registration order by the `nodespec` job (`jobs/nodespec.rs`) and stored in `nodes.spec` as the
//! proto3 JSON of `NodeSpec`; `nodes.generation` moves only when that JSON changes. `nodes` is the one table of another module the runtime touches: the
//! spec says desired state lives there.

use better_compute_proto::v1::{NodeSpec, SiteSection};
use tokio_postgres::Transaction;

use crate::reconciler::RunError;

/// The channel a gateway listens on for "this node's desired state changed"; the payload is the
/// node id. Sent after commit; gateways also poll.
pub const NODESPEC_CHANNEL: &str = "better_compute_nodespec";

/// A module's contribution to a node's desired state: the sections (or, for `site`, the fields)
/// it owns.
#[async_trait::async_trait]
pub trait NodeSpecPart: Send + Sync + 'static {
    /// A name for errors and logs.
    fn name(&self) -> &'static str;

    /// This part of each of `node_ids`' desired state, in `node_ids`' order, read inside the
    /// controller's transaction (set-based: one statement for the whole batch).
    async fn node_specs(&self, tx: &Transaction<'_>, node_ids: &[String]) -> Result<Vec<NodeSpec>, RunError>;
}

/// A module's word that its job follows what the nodes of one pool kind report of one section of
/// their desired state: the node report path wakes `kind` for such a node whose reported status of
/// `section` (a key of `SpecStatus`' proto3 JSON, such as `instances`) reads differently from its
/// last report, or that applied a newer generation (a thing removed from the section is gone once
/// the node applied the spec without it, whether or not it ever reported it, and the spec may then
/// have no such section at all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusWatch {
    /// The section of `NodeSpec` and `SpecStatus` followed.
    pub section: &'static str,
    /// The kind of pool whose nodes are followed (`pools.kind`).
    pub pool_kind: &'static str,
    /// The job woken, keyed by node.
    pub kind: crate::Kind,
}

fn merge_site(into: &mut SiteSection, from: SiteSection) {
    for (to, value) in [
        (&mut into.site_id, from.site_id),
        (&mut into.site_name, from.site_name),
        (&mut into.pool_id, from.pool_id),
        (&mut into.pool_name, from.pool_name),
        (&mut into.node_name, from.node_name),
    ] {
        if !value.is_empty() {
            *to = value;
        }
    }
    into.labels.extend(from.labels);
}

/// Merges parts in registration order: `site` field by field (a later part's non-empty field wins,
/// labels key by key); every other section whole, from the last part that sets it.
pub fn merge(parts: impl IntoIterator<Item = NodeSpec>) -> NodeSpec {
    let mut spec = NodeSpec::default();
    for p in parts {
        if let Some(site) = p.site {
            merge_site(spec.site.get_or_insert_with(SiteSection::default), site);
        }
        if p.agent.is_some() {
            spec.agent = p.agent;
        }
        if p.gpus.is_some() {
            spec.gpus = p.gpus;
        }
        if p.allocations.is_some() {
            spec.allocations = p.allocations;
        }
        if p.instances.is_some() {
            spec.instances = p.instances;
        }
    }
    spec
}


#[cfg(test)]
mod tests {
    use super::*;
    use better_compute_proto::v1::{AgentSection, GpusSection};

    fn site(f: impl FnOnce(&mut SiteSection)) -> NodeSpec {
        let mut s = SiteSection::default();
        f(&mut s);
        NodeSpec { site: Some(s), ..Default::default() }
    }

    #[test]
    fn site_merges_field_by_field_in_registration_order_and_other_sections_whole() {
        let a = site(|s| {
            s.site_id = "site_a".into();
            s.node_name = "n1".into();
            s.labels.insert("rack".into(), "r1".into());
            s.labels.insert("zone".into(), "z1".into());
        });
        let b = site(|s| {
            s.pool_id = "pool_b".into();
            s.node_name = "n1-renamed".into();
            s.labels.insert("zone".into(), "z2".into());
        });
        let gpus = NodeSpec { gpus: Some(GpusSection::default()), agent: Some(AgentSection { heartbeat_interval_ms: 5, lanes: vec![], command_keys: vec![] }), ..Default::default() };
        let merged = merge([a, b, gpus]);
        let s = merged.site.unwrap();
        assert_eq!((s.site_id.as_str(), s.pool_id.as_str(), s.node_name.as_str()), ("site_a", "pool_b", "n1-renamed"));
        assert_eq!(s.labels.get("rack").map(String::as_str), Some("r1"));
        assert_eq!(s.labels.get("zone").map(String::as_str), Some("z2"));
        assert_eq!(merged.agent.unwrap().heartbeat_interval_ms, 5);
    }

    #[test]
    fn the_stored_json_is_proto3_json_and_omits_defaults() {
        let spec = merge([site(|s| s.site_id = "site_a".into())]);
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json, serde_json::json!({"site": {"siteId": "site_a"}}));
        let back: NodeSpec = serde_json::from_value(json).unwrap();
        assert_eq!(back, spec);
    }
}
