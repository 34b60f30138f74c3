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

fn logs_collect(p: &serde_json::Value) -> Result<CommandBody, Error> {
    let mut m: LogsCollect = parse("logs.collect", p)?;
    if m.units.is_empty() {
        m.units = vec!["better-compute-daemon".into()];
    }
    if m.since_seconds == 0 {
        m.since_seconds = 3600;
    }
    if m.max_bytes == 0 {
        m.max_bytes = 8 << 20;
    }
    if m.since_seconds > 7 * 86_400 || m.max_bytes > 64 << 20 {
        return Err(Error::invalid_argument("payload of logs.collect: sinceSeconds is at most 7 days and maxBytes at most 64 MiB"));
    }
    Ok(CommandBody { payload: Some(Payload::LogsCollect(m)) })
}

fn node_reboot(p: &serde_json::Value) -> Result<CommandBody, Error> {
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
            summary: "Gathers the listed units' logs (default: the daemon's) for the last `sinceSeconds` (default 3600, at most 7 days), at most `maxBytes` (default 8 MiB, at most 64 MiB), and uploads them.",
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
