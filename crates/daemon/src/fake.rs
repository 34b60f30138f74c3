//! Fake GPUs: configurable models and counts (`fake:8xH100-80GB`, `fake:2xA100-40GB,1xL4-24GB`),
//! modes and MIG layouts that apply instantly, injected XID errors, and diagnostics that count
//! their runs and can be held, for tests of what runs when.

use std::sync::{Condvar, Mutex};

use better_compute_proto::v1::{DiagNvml, GpuHealth, GpuInfo, GpuMode, GpusSection, Inventory, MigInstance};
use sha2::{Digest, Sha256};

use crate::backend::{xid_is_critical, BackendError, GpuApply, GpuBackend, HealthWake};

#[derive(Debug, Clone)]
struct FakeGpu {
    uuid: String,
    model: String,
    memory_mib: u64,
    mode: i32,
    mig_layout: Vec<String>,
    xids_pending: Vec<u32>,
    xids_seen: Vec<u32>,
    /// Uncorrectable ECC errors since the last reset (volatile), and rows remapped for them.
    ecc_uncorrected: u64,
    remapped_rows: u32,
    /// A remap waits for a reset; a remap failed (the GPU needs service, a reset does not help).
    remap_pending: bool,
    remap_failed: bool,
    nvlink_errors: u64,
}

#[derive(Default)]
struct Gate {
    held: bool,
}

/// Simulated GPUs.
pub struct FakeGpus {
    gpus: Mutex<Vec<FakeGpu>>,
    wake: Mutex<Option<HealthWake>>,
    diag_runs: Mutex<u64>,
    resets: Mutex<u64>,
    gate: (Mutex<Gate>, Condvar),
}

fn bad(value: &str, why: impl Into<String>) -> BackendError {
    BackendError::BadSpec { value: value.to_owned(), why: why.into() }
}

impl FakeGpus {
    /// Parses `fake:<count>x<model>-<memory>GB[,…]`; uuids derive from `seed`.
    pub fn parse(value: &str, seed: &str) -> Result<FakeGpus, BackendError> {
        let groups = value.strip_prefix("fake:").ok_or_else(|| bad(value, "it is neither nvml nor fake:…"))?;
        let digest = hex::encode(&Sha256::digest(seed.as_bytes())[..8]);
        let mut gpus = Vec::new();
        for g in groups.split(',').filter(|g| !g.is_empty()) {
            let (count, model) = g.split_once('x').ok_or_else(|| bad(value, format!("{g:?} has no <count>x")))?;
            let count: usize = count.parse().map_err(|_| bad(value, format!("{count:?} is not a count")))?;
            let gb = model
                .rsplit_once('-')
                .and_then(|(_, m)| m.strip_suffix("GB"))
                .and_then(|m| m.parse::<u64>().ok())
                .filter(|m| (1..=1024).contains(m))
                .ok_or_else(|| bad(value, format!("{model:?} does not end in -<memory>GB")))?;
            for _ in 0..count {
                let index = gpus.len();
                gpus.push(FakeGpu {
                    uuid: format!("GPU-fake-{digest}-{index}"),
                    model: model.to_owned(),
                    memory_mib: gb * 1024,
                    mode: GpuMode::Exclusive as i32,
                    mig_layout: Vec::new(),
                    xids_pending: Vec::new(),
                    xids_seen: Vec::new(),
                    ecc_uncorrected: 0,
                    remapped_rows: 0,
                    remap_pending: false,
                    remap_failed: false,
                    nvlink_errors: 0,
                });
            }
        }
        if gpus.is_empty() || gpus.len() > 64 {
            return Err(bad(value, "a node has 1 to 64 GPUs"));
        }
        Ok(FakeGpus { gpus: Mutex::new(gpus), wake: Mutex::new(None), diag_runs: Mutex::new(0), resets: Mutex::new(0), gate: (Mutex::new(Gate::default()), Condvar::new()) })
    }

    /// Injects an XID error on the GPU at `index`, as the driver would report it: the daemon
    /// watching health is woken at once.
    pub fn inject_xid(&self, index: usize, xid: u32) {
        if let Some(g) = self.gpus.lock().expect("fake gpus").get_mut(index) {
            g.xids_pending.push(xid);
        }
        let wake = self.wake.lock().expect("fake wake").clone();
        if let Some(w) = wake {
            w();
        }
    }

    /// An uncorrectable memory error on the GPU at `index`: its ECC count rises and a row remap
    /// waits for a reset (or, `failed`, the remap failed: the GPU needs service).
    pub fn inject_memory_error(&self, index: usize, failed: bool) {
        if let Some(g) = self.gpus.lock().expect("fake gpus").get_mut(index) {
            g.ecc_uncorrected += 1;
            if failed {
                g.remap_failed = true;
            } else {
                g.remapped_rows += 1;
                g.remap_pending = true;
            }
        }
        let wake = self.wake.lock().expect("fake wake").clone();
        if let Some(w) = wake {
            w();
        }
    }

    /// NVLink errors on the GPU at `index`.
    pub fn inject_nvlink_errors(&self, index: usize, n: u64) {
        if let Some(g) = self.gpus.lock().expect("fake gpus").get_mut(index) {
            g.nvlink_errors += n;
        }
    }

    /// Resets the GPU at `index`: clears its XID history and volatile ECC count, and applies a
    /// pending row remap.
    pub fn reset_gpu(&self, index: usize) {
        if let Some(g) = self.gpus.lock().expect("fake gpus").get_mut(index) {
            g.xids_pending.clear();
            g.xids_seen.clear();
            g.ecc_uncorrected = 0;
            g.remap_pending = false;
        }
    }

    /// How many GPU resets ran.
    pub fn resets(&self) -> u64 {
        *self.resets.lock().expect("fake resets")
    }

    /// How many diagnostics ran.
    pub fn diag_runs(&self) -> u64 {
        *self.diag_runs.lock().expect("fake diag")
    }

    /// Holds every diagnostic (after it counted itself) until [`FakeGpus::release_diag`].
    pub fn hold_diag(&self) {
        self.gate.0.lock().expect("gate").held = true;
    }

    /// Lets held diagnostics finish.
    pub fn release_diag(&self) {
        self.gate.0.lock().expect("gate").held = false;
        self.gate.1.notify_all();
    }

    /// The GPUs' uuids, in index order.
    pub fn uuids(&self) -> Vec<String> {
        self.gpus.lock().expect("fake gpus").iter().map(|g| g.uuid.clone()).collect()
    }
}

impl GpuBackend for FakeGpus {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn watch_health(&self, wake: HealthWake) {
        *self.wake.lock().expect("fake wake") = Some(wake);
    }

    fn inventory(&self) -> Result<Inventory, BackendError> {
        let gpus = self.gpus.lock().expect("fake gpus");
        Ok(Inventory {
            gpus: gpus
                .iter()
                .enumerate()
                .map(|(i, g)| GpuInfo {
                    uuid: g.uuid.clone(),
                    index: i as u32,
                    model: g.model.clone(),
                    memory_mib: g.memory_mib,
                    mig_enabled: g.mode == GpuMode::Mig as i32,
                    mig_instances: g
                        .mig_layout
                        .iter()
                        .enumerate()
                        .map(|(k, p)| MigInstance { uuid: format!("MIG-{}-{k}", g.uuid), profile: p.clone() })
                        .collect(),
                    driver_version: "fake-1.0".into(),
                })
                .collect(),
            backend: "fake".into(),
            ..Default::default()
        })
    }

    fn health(&self) -> Result<Vec<GpuHealth>, BackendError> {
        let mut gpus = self.gpus.lock().expect("fake gpus");
        Ok(gpus
            .iter_mut()
            .map(|g| {
                let new: Vec<u32> = std::mem::take(&mut g.xids_pending);
                g.xids_seen.extend(&new);
                let critical = new.iter().find(|x| xid_is_critical(**x));
                GpuHealth {
                    uuid: g.uuid.clone(),
                    healthy: critical.is_none(),
                    reason: critical.map(|x| format!("XID {x}")).unwrap_or_default(),
                    xid_errors: new,
                    ecc_uncorrected: g.ecc_uncorrected,
                    temperature_c: 40,
                    pcie_link_width: 16,
                    pcie_link_width_max: 16,
                    pcie_link_gen: 5,
                    pcie_link_gen_max: 5,
                    throttle_reasons: 0,
                    remapped_rows: g.remapped_rows,
                    remap_pending: g.remap_pending,
                    remap_failed: g.remap_failed,
                    nvlink_errors: g.nvlink_errors,
                    ..Default::default()
                }
            })
            .collect())
    }

    fn reset(&self, uuid: &str) -> Result<(), BackendError> {
        let index = self.gpus.lock().expect("fake gpus").iter().position(|g| g.uuid == uuid);
        let index = index.ok_or_else(|| BackendError::Failed(format!("no GPU {uuid} on this node")))?;
        *self.resets.lock().expect("fake resets") += 1;
        self.reset_gpu(index);
        Ok(())
    }

    fn apply_gpus(&self, desired: &GpusSection, busy: &[String]) -> Result<Vec<(String, GpuApply)>, BackendError> {
        let mut gpus = self.gpus.lock().expect("fake gpus");
        Ok(desired
            .gpus
            .iter()
            .map(|d| {
                let Some(g) = gpus.iter_mut().find(|g| g.uuid == d.uuid) else {
                    return (d.uuid.clone(), GpuApply::Failed("no such GPU on this node".into()));
                };
                let want_layout = if d.mode == GpuMode::Mig as i32 { d.mig_layout.clone() } else { Vec::new() };
                if g.mode == d.mode && g.mig_layout == want_layout {
                    return (d.uuid.clone(), GpuApply::Converged);
                }
                if busy.contains(&g.uuid) {
                    return (d.uuid.clone(), GpuApply::Pending("an allocation holds this GPU; its mode changes once it is free".into()));
                }
                g.mode = d.mode;
                g.mig_layout = want_layout;
                (d.uuid.clone(), GpuApply::Converged)
            })
            .collect())
    }

    fn diag(&self, req: &DiagNvml) -> Result<serde_json::Value, BackendError> {
        *self.diag_runs.lock().expect("fake diag") += 1;
        let mut gate = self.gate.0.lock().expect("gate");
        while gate.held {
            gate = self.gate.1.wait(gate).expect("gate");
        }
        drop(gate);
        let gpus = self.gpus.lock().expect("fake gpus");
        let report: Vec<_> = gpus
            .iter()
            .filter(|g| req.gpu_uuids.is_empty() || req.gpu_uuids.contains(&g.uuid))
            .map(|g| {
                // Hardware faults and a remap that waits for a reset fail the check until a reset;
                // transient ones were recovered. A failed remap fails it for good.
                let passed = !g.xids_seen.iter().any(|x| better_compute_core::xid::classify(*x) == better_compute_core::xid::XidClass::Fatal)
                    && !g.remap_pending
                    && !g.remap_failed;
                serde_json::json!({"uuid": g.uuid, "model": g.model, "passed": passed, "xidErrors": g.xids_seen})
            })
            .collect();
        Ok(serde_json::json!({"backend": "fake", "level": req.level.max(1), "gpus": report}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fake_spec_gives_stable_uuids_per_seed_and_bad_specs_say_what_is_expected() {
        let a = FakeGpus::parse("fake:8xH100-80GB", "node-a").unwrap();
        assert_eq!(a.uuids().len(), 8);
        assert_eq!(a.uuids(), FakeGpus::parse("fake:8xH100-80GB", "node-a").unwrap().uuids());
        assert_ne!(a.uuids(), FakeGpus::parse("fake:8xH100-80GB", "node-b").unwrap().uuids());
        assert_eq!(a.inventory().unwrap().gpus[0].memory_mib, 80 * 1024);
        let two = FakeGpus::parse("fake:2xA100-40GB,1xL4-24GB", "n").unwrap().inventory().unwrap();
        assert_eq!(two.gpus.iter().map(|g| g.model.as_str()).collect::<Vec<_>>(), ["A100-40GB", "A100-40GB", "L4-24GB"]);
        for bad in ["fake:", "fake:8H100-80GB", "fake:8xH100", "gpu:1xA-1GB", "fake:100xH100-80GB"] {
            let e = FakeGpus::parse(bad, "n").err().expect(bad);
            assert!(e.to_string().contains("fake:8xH100-80GB"), "{e}");
        }
    }

    #[test]
    fn an_injected_xid_wakes_the_watcher_is_reported_once_and_a_fatal_one_fails_checks_until_reset() {
        let f = FakeGpus::parse("fake:2xH100-80GB", "n").unwrap();
        let woken = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let w = woken.clone();
        f.watch_health(std::sync::Arc::new(move || {
            w.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }));
        f.inject_xid(1, 119);
        f.inject_xid(1, 79);
        assert_eq!(woken.load(std::sync::atomic::Ordering::SeqCst), 2, "woken as each happens");
        let h = f.health().unwrap();
        assert!(h[0].healthy);
        assert_eq!((h[1].healthy, h[1].xid_errors.as_slice()), (false, &[119, 79][..]), "both, in order, none lost");
        assert_eq!(f.health().unwrap()[1].xid_errors, Vec::<u32>::new(), "reported once");
        let passed = |f: &FakeGpus| f.diag(&DiagNvml { level: 1, gpu_uuids: vec![], reset: false }).unwrap()["gpus"][1]["passed"].as_bool();
        assert_eq!(passed(&f), Some(false), "fallen off the bus: fails its checks");
        f.reset_gpu(1);
        assert_eq!(passed(&f), Some(true));
    }

    #[test]
    fn a_pending_row_remap_fails_checks_until_a_reset_and_a_failed_one_for_good() {
        let f = FakeGpus::parse("fake:2xH100-80GB", "n").unwrap();
        let uuid = f.uuids()[1].clone();
        let passed = |f: &FakeGpus| f.diag(&DiagNvml { level: 1, gpu_uuids: vec![], reset: false }).unwrap()["gpus"][1]["passed"].as_bool();
        f.inject_memory_error(1, false);
        let h = f.health().unwrap();
        assert_eq!((h[1].ecc_uncorrected, h[1].remapped_rows, h[1].remap_pending, h[1].remap_failed), (1, 1, true, false));
        assert_eq!(passed(&f), Some(false));
        f.reset(&uuid).unwrap();
        assert_eq!(f.resets(), 1);
        let h = f.health().unwrap();
        assert_eq!((h[1].ecc_uncorrected, h[1].remapped_rows, h[1].remap_pending), (0, 1, false), "the remap applied; the volatile count cleared");
        assert_eq!(passed(&f), Some(true));
        f.inject_memory_error(1, true);
        f.reset(&uuid).unwrap();
        assert!(f.health().unwrap()[1].remap_failed);
        assert_eq!(passed(&f), Some(false), "a failed remap needs service, not a reset");
        assert!(f.reset("GPU-nope").is_err());
    }

    #[test]
    fn a_mode_change_waits_while_an_allocation_holds_the_gpu() {
        let f = FakeGpus::parse("fake:1xH100-80GB", "n").unwrap();
        let uuid = f.uuids()[0].clone();
        let mig = GpusSection {
            gpus: vec![better_compute_proto::v1::Gpu { uuid: uuid.clone(), index: 0, mode: GpuMode::Mig as i32, mig_layout: vec!["3g.40gb".into()], slots: 0 }],
        };
        assert!(matches!(f.apply_gpus(&mig, std::slice::from_ref(&uuid)).unwrap()[0].1, GpuApply::Pending(_)));
        assert_eq!(f.apply_gpus(&mig, &[]).unwrap()[0].1, GpuApply::Converged);
        assert!(f.inventory().unwrap().gpus[0].mig_enabled);
        assert_eq!(f.apply_gpus(&mig, &[]).unwrap()[0].1, GpuApply::Converged, "idempotent");
    }
}
