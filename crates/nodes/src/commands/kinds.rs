//! The command kinds the nodes module defines: `diag.nvml`, `inventory.refresh`, `logs.collect` and
//! `node.reboot`, each with its flags and payload message.

use std::time::Duration;

use better_compute_core::Error;
use better_compute_proto::v1::{command_body::Payload, CommandBody, DiagNvml, InventoryRefresh, LogsCollect, NodeReboot};
use better_compute_runtime::commands::CommandKind;

fn parse<T: serde::de::DeserializeOwned + Default>(kind: &str, payload: &serde_json::Value) -> Result<T, Error> {
    if payload.is_null() {
        return Ok(T::default());
    }
    serde_json::from_value(payload.clone()).map_err(|e| Error::invalid_argument(format!("payload of {kind}: {e}")))
}

fn diag_nvml(p: &serde_json::Value) -> Result<CommandBody, Error> {
    check_counts("diag.nvml", p, &["level"])?;
    let mut m: DiagNvml = parse("diag.nvml", p)?;
    if m.level == 0 {
        m.level = 1;
    }
    if m.level > 3 {
        return Err(Error::invalid_argument("payload of diag.nvml: level must be 1 (quick), 2 (medium) or 3 (long)"));
    }
    if m.gpu_uuids.iter().any(|u| u.is_empty()) {
        return Err(Error::invalid_argument("payload of diag.nvml: gpuUuids must not contain empty strings"));
    }
    Ok(CommandBody { payload: Some(Payload::DiagNvml(m)) })
}

/// The inventory sections a daemon reports.
pub const INVENTORY_SECTIONS: [&str; 5] = ["gpus", "cpus", "memory", "disks", "network"];

fn inventory_refresh(p: &serde_json::Value) -> Result<CommandBody, Error> {
    let m: InventoryRefresh = parse("inventory.refresh", p)?;
    if let Some(bad) = m.sections.iter().find(|s| !INVENTORY_SECTIONS.contains(&s.as_str())) {
        return Err(Error::invalid_argument(format!(
            "payload of inventory.refresh: unknown section {bad:?}; sections are {}",
            INVENTORY_SECTIONS.join(", ")
        )));
    }
    Ok(CommandBody { payload: Some(Payload::InventoryRefresh(m)) })
}

/// What a `logs.collect` result may hold: its lines, JSON-escaped, fit in what a gateway passes
/// on from a daemon (1 MiB, `gateway::service`'s result limit) with room for the envelope.
pub const LOGS_MAX_BYTES: u64 = 768 << 10;
/// `maxBytes` when a request names none.
pub const LOGS_DEFAULT_BYTES: u64 = 512 << 10;

/// Each of `fields` present in `p` is a whole number, 0 or more (the generic parse would answer
/// with the decoder's wording).
fn check_counts(kind: &str, p: &serde_json::Value, fields: &[&str]) -> Result<(), Error> {
    match fields.iter().find(|f| p.get(**f).is_some_and(|v| v.as_u64().is_none())) {
        Some(f) => Err(Error::invalid_argument(format!("payload of {kind}: {f} must be a whole number, 0 or more"))),
        None => Ok(()),
    }
}

fn logs_collect(p: &serde_json::Value) -> Result<CommandBody, Error> {
    check_counts("logs.collect", p, &["sinceSeconds", "maxBytes"])?;
    let mut m: LogsCollect = parse("logs.collect", p)?;
    if m.units.is_empty() {
        m.units = vec!["better-compute-daemon".into()];
    }
    if m.since_seconds == 0 {
        m.since_seconds = 3600;
    }
    if m.max_bytes == 0 {
        m.max_bytes = LOGS_DEFAULT_BYTES;
    }
    if m.since_seconds > 7 * 86_400 || m.max_bytes > LOGS_MAX_BYTES {
        return Err(Error::invalid_argument("payload of logs.collect: sinceSeconds is at most 7 days and maxBytes at most 786432 (768 KiB)"));
    }
    Ok(CommandBody { payload: Some(Payload::LogsCollect(m)) })
}

fn node_reboot(p: &serde_json::Value) -> Result<CommandBody, Error> {
    check_counts("node.reboot", p, &["graceSeconds"])?;
    let m: NodeReboot = parse("node.reboot", p)?;
    if m.reason.trim().is_empty() || m.reason.len() > 500 {
        return Err(Error::invalid_argument("payload of node.reboot: a reason of 1 to 500 characters is required"));
    }
    if m.grace_seconds > 3600 {
        return Err(Error::invalid_argument("payload of node.reboot: graceSeconds is at most 3600"));
    }
    Ok(CommandBody { payload: Some(Payload::NodeReboot(m)) })
}

/// The kinds, in the order the reference page lists them.
pub fn command_kinds() -> Vec<CommandKind> {
    vec![
        CommandKind {
            name: "diag.nvml",
            summary: "Runs NVML diagnostics (level 1 quick, 2 medium, 3 long) on the listed GPUs, or all, and reports the result.",
            lane: "diag",
            timeout: Duration::from_secs(600),
            retry_safe: true,
            self_terminating: false,
            destructive: false,
            api_allowed: true,
            payload_message: "DiagNvml",
            encode: diag_nvml,
        },
        CommandKind {
            name: "inventory.refresh",
            summary: "Reports the listed inventory sections (gpus, cpus, memory, disks, network; all when empty) again, rescanning the hardware if `rescan`.",
            lane: "default",
            timeout: Duration::from_secs(120),
            retry_safe: true,
            self_terminating: false,
            destructive: false,
            api_allowed: true,
            payload_message: "InventoryRefresh",
            encode: inventory_refresh,
        },
        CommandKind {
            name: "logs.collect",
            summary: "Gathers the listed units' logs (default: the daemon's) for the last `sinceSeconds` (default 3600, at most 7 days), at most `maxBytes` of JSON-escaped lines (default 512 KiB, at most 768 KiB, so the result always comes back whole), the newest kept.",
            lane: "default",
            timeout: Duration::from_secs(300),
            retry_safe: true,
            self_terminating: false,
            destructive: false,
            api_allowed: true,
            payload_message: "LogsCollect",
            encode: logs_collect,
        },
        CommandKind {
            name: "node.reboot",
            summary: "Reboots the node after `graceSeconds` (at most 3600) for workloads to stop; needs a `reason`. A cancel during the grace stops it (failed, reason `cancelled`); once the grace is over it goes ahead. Self-terminating: a reconnect with a new boot id settles it as succeeded. Never run twice: a new daemon journal fails it with `journal-lost`.",
            lane: "power",
            timeout: Duration::from_secs(900),
            retry_safe: false,
            self_terminating: true,
            destructive: true,
            api_allowed: true,
            payload_message: "NodeReboot",
            encode: node_reboot,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_collect_defaults_to_what_comes_back_whole_and_refuses_bad_counts_plainly() {
        let Some(Payload::LogsCollect(m)) = logs_collect(&serde_json::json!({})).unwrap().payload else { panic!("a logs.collect body") };
        assert_eq!(m.max_bytes, LOGS_DEFAULT_BYTES);
        // Room for the envelope within the gateway's 1 MiB result limit.
        const { assert!(LOGS_MAX_BYTES + (64 << 10) <= 1 << 20) };
        for bad in [serde_json::json!({"maxBytes": -1}), serde_json::json!({"maxBytes": 1.5}), serde_json::json!({"sinceSeconds": "soon"})] {
            let e = logs_collect(&bad).unwrap_err();
            assert!(e.message.contains("must be a whole number"), "{bad}: {e}");
        }
        let e = logs_collect(&serde_json::json!({"maxBytes": 8 << 20})).unwrap_err();
        assert!(e.message.contains("768 KiB"), "{e}");
        let e = node_reboot(&serde_json::json!({"reason": "r", "graceSeconds": -5})).unwrap_err();
        assert!(e.message.contains("graceSeconds must be a whole number"), "{e}");
    }
}
