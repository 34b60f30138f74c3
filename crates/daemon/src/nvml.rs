//! The NVML backend for real nodes, through nvml-wrapper (which loads `libnvidia-ml.so` at run
//! time, so this compiles and its pure parts are tested on machines without a GPU). Inventory:
//! uuid, model, memory, MIG mode and instances. Health: XID events from one NVML event set held
//! for the daemon's life by a thread of its own (so none is lost between reports, and each wakes
//! the daemon to report it at once), uncorrected ECC errors, temperature, the PCIe link and
//! throttling. MIG layout changes need the GPU reset that `nvidia-smi mig` does; this
//! backend converges a GPU whose layout already matches and fails the others with that advice.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use better_compute_proto::v1::{DiagNvml, GpuHealth, GpuInfo, GpuMode, GpusSection, Inventory, MigInstance};
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, RetirementCause, TemperatureSensor};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

use crate::backend::{xid_is_critical, BackendError, GpuApply, GpuBackend, HealthWake};

/// Above this temperature a GPU is reported unhealthy.
pub const MAX_HEALTHY_TEMPERATURE_C: u32 = 90;

/// XIDs one GPU may have waiting for the next report; older ones are dropped past it.
const PENDING_XIDS_PER_GPU: usize = 256;

/// What the event thread hands the backend: XIDs per GPU uuid since the last report, and whom to
/// wake.
#[derive(Default)]
struct Events {
    pending: Mutex<HashMap<String, Vec<u32>>>,
    wake: Mutex<Option<HealthWake>>,
}

/// Real GPUs through NVML.
pub struct NvmlBackend {
    nvml: Nvml,
    events: Arc<Events>,
}

fn failed(e: NvmlError) -> BackendError {
    BackendError::Failed(e.to_string())
}

/// The MIG profile at the end of a MIG device's name, e.g. `NVIDIA H100 80GB HBM3 MIG 3g.40gb`.
pub fn mig_profile_of(name: &str) -> Option<String> {
    let p = name.rsplit(' ').next()?;
    let (g, mem) = p.split_once("g.")?;
    (g.parse::<u32>().is_ok() && mem.ends_with("gb")).then(|| p.to_owned())
}

/// Whether a GPU with these readings is healthy, and why not.
pub fn judge(xids: &[u32], ecc_uncorrected: u64, temperature_c: u32) -> (bool, String) {
    if let Some(x) = xids.iter().find(|x| xid_is_critical(**x)) {
        return (false, format!("XID {x}"));
    }
    if ecc_uncorrected > 0 {
        return (false, format!("{ecc_uncorrected} uncorrected ECC errors"));
    }
    if temperature_c > MAX_HEALTHY_TEMPERATURE_C {
        return (false, format!("temperature {temperature_c} °C"));
    }
    (true, String::new())
}

impl NvmlBackend {
    /// Loads NVML, and starts the thread that holds the event set; fails with `Unavailable` where
    /// there is no driver.
    pub fn open() -> Result<NvmlBackend, BackendError> {
        let nvml = Nvml::init().map_err(|e| BackendError::Unavailable(format!("NVML: {e}; is the NVIDIA driver installed?")))?;
        let events = Arc::new(Events::default());
        let e = events.clone();
        std::thread::Builder::new()
            .name("nvml-events".into())
            .spawn(move || watch_xids(&e))
            .map_err(|e| BackendError::Failed(format!("cannot start the NVML event thread: {e}")))?;
        Ok(NvmlBackend { nvml, events })
    }

    fn mig_instances(&self, device: &nvml_wrapper::Device<'_>) -> Vec<MigInstance> {
        // The count is of MIG device slots; an empty slot answers NotFound and is skipped.
        let Ok(slots) = device.mig_device_count() else { return Vec::new() };
        (0..slots)
            .filter_map(|i| device.mig_device_by_index(i).ok())
            .filter_map(|d| {
                let name = d.name().ok()?;
                Some(MigInstance { uuid: d.uuid().ok()?, profile: mig_profile_of(&name).unwrap_or(name) })
            })
            .collect()
    }

}

/// The event thread: one event set for every GPU, registered once and held for the daemon's life
/// (NVML queues events only for a registered set, so a set made per check would miss what
/// happened between checks). Each XID is queued for the next report and wakes the daemon.
fn watch_xids(events: &Events) {
    use nvml_wrapper::bitmasks::event::EventTypes;
    // Its own handle: NVML counts initialisations, and the set borrows it for the thread's life.
    let nvml = match Nvml::init() {
        Ok(n) => n,
        Err(e) => return tracing::warn!(error = %e, "NVML events: cannot initialise; XIDs are not watched"),
    };
    let Ok(count) = nvml.device_count() else { return };
    let mut set = match nvml.create_event_set() {
        Ok(s) => s,
        Err(e) => return tracing::warn!(error = %e, "NVML events: cannot create the event set; XIDs are not watched"),
    };
    for i in 0..count {
        let Ok(d) = nvml.device_by_index(i) else { continue };
        set = match d.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
            Ok(s) => s,
            Err(e) => return tracing::warn!(gpu = i, error = %e, "NVML events: cannot register; XIDs are not watched"),
        };
    }
    loop {
        match set.wait(1_000) {
            Ok(ev) => {
                let (Ok(uuid), Some(nvml_wrapper::enums::event::XidError::Value(x))) = (ev.device.uuid(), ev.event_data) else { continue };
                {
                    let mut pending = events.pending.lock().expect("xids");
                    let q = pending.entry(uuid).or_default();
                    q.push(x as u32);
                    if q.len() > PENDING_XIDS_PER_GPU {
                        q.remove(0);
                    }
                }
                let wake = events.wake.lock().expect("wake").clone();
                if let Some(w) = wake {
                    w();
                }
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                tracing::warn!(error = %e, "NVML events: wait failed; trying again");
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        }
    }
}

/// Row remapping (Ampere and later; NVIDIA's "GPU Memory Error Management" guide): rows remapped
/// for uncorrectable errors, whether one waits for a reset, and whether one failed. nvml-wrapper
/// has no wrapper for `nvmlDeviceGetRemappedRows`, so it is called through its bindings; a GPU
/// without row remapping answers NOT_SUPPORTED and reads as none.
fn remapped_rows(d: &nvml_wrapper::Device<'_>) -> (u32, bool, bool) {
    let (mut corrected, mut uncorrected, mut pending, mut failed) = (0u32, 0u32, 0u32, 0u32);
    // SAFETY: the handle is the live device's, and the four out-pointers are valid for writes.
    let rc = unsafe { d.nvml().lib().nvmlDeviceGetRemappedRows(d.handle(), &mut corrected, &mut uncorrected, &mut pending, &mut failed) };
    // 0 is NVML_SUCCESS.
    if rc != 0 {
        return (0, false, false);
    }
    (uncorrected, pending != 0, failed != 0)
}

/// NVLink data-link errors summed over the GPU's active links.
fn nvlink_errors(d: &nvml_wrapper::Device<'_>) -> u64 {
    use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
    // NVML_NVLINK_MAX_LINKS: 18 on Hopper.
    (0..18)
        .map(|i| d.link_wrapper_for(i))
        .filter(|l| l.is_active().unwrap_or(false))
        .flat_map(|l| [ErrorCounter::DlReplay, ErrorCounter::DlRecovery, ErrorCounter::DlCrcFlit, ErrorCounter::DlCrcData].map(|c| l.error_counter(c).unwrap_or(0)))
        .sum()
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn inventory(&self) -> Result<Inventory, BackendError> {
        let driver = self.nvml.sys_driver_version().unwrap_or_default();
        let count = self.nvml.device_count().map_err(failed)?;
        let mut gpus = Vec::new();
        for i in 0..count {
            let d = self.nvml.device_by_index(i).map_err(failed)?;
            let mig_enabled = d.mig_mode().map(|m| m.current == 1).unwrap_or(false);
            gpus.push(GpuInfo {
                uuid: d.uuid().map_err(failed)?,
                index: i,
                model: d.name().map_err(failed)?,
                memory_mib: d.memory_info().map_err(failed)?.total / (1024 * 1024),
                mig_enabled,
                mig_instances: if mig_enabled { self.mig_instances(&d) } else { Vec::new() },
                driver_version: driver.clone(),
            });
        }
        Ok(Inventory { gpus, backend: "nvml".into(), ..Default::default() })
    }

    fn health(&self) -> Result<Vec<GpuHealth>, BackendError> {
        let mut pending = std::mem::take(&mut *self.events.pending.lock().expect("xids"));
        let count = self.nvml.device_count().map_err(failed)?;
        let mut out = Vec::new();
        for i in 0..count {
            let d = self.nvml.device_by_index(i).map_err(failed)?;
            let uuid = d.uuid().map_err(failed)?;
            let ecc = d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile).unwrap_or(0);
            let temp = d.temperature(TemperatureSensor::Gpu).unwrap_or(0);
            let xids = pending.remove(&uuid).unwrap_or_default();
            let (healthy, reason) = judge(&xids, ecc, temp);
            let (remapped_rows, remap_pending, remap_failed) = remapped_rows(&d);
            out.push(GpuHealth {
                uuid,
                healthy,
                xid_errors: xids,
                ecc_uncorrected: ecc,
                temperature_c: temp,
                reason,
                pcie_link_width: d.current_pcie_link_width().unwrap_or(0),
                pcie_link_width_max: d.max_pcie_link_width().unwrap_or(0),
                pcie_link_gen: d.current_pcie_link_gen().unwrap_or(0),
                pcie_link_gen_max: d.max_pcie_link_gen().unwrap_or(0),
                throttle_reasons: d.current_throttle_reasons().map(|t| t.bits()).unwrap_or(0),
                ecc_corrected: d.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile).unwrap_or(0),
                retired_pages: d.retired_pages(RetirementCause::DoubleBitEccError).map(|p| p.len() as u32).unwrap_or(0),
                retired_pages_pending: d.are_pages_pending_retired().unwrap_or(false),
                remapped_rows,
                remap_pending,
                remap_failed,
                nvlink_errors: nvlink_errors(&d),
            });
        }
        Ok(out)
    }

    fn watch_health(&self, wake: HealthWake) {
        *self.events.wake.lock().expect("wake") = Some(wake);
    }

    fn apply_gpus(&self, desired: &GpusSection, _busy: &[String]) -> Result<Vec<(String, GpuApply)>, BackendError> {
        let inv = self.inventory()?;
        Ok(desired
            .gpus
            .iter()
            .map(|want| {
                let Some(have) = inv.gpus.iter().find(|g| g.uuid == want.uuid) else {
                    return (want.uuid.clone(), GpuApply::Failed("no such GPU on this node".into()));
                };
                let want_mig = want.mode == GpuMode::Mig as i32;
                let have_layout: Vec<&str> = have.mig_instances.iter().map(|m| m.profile.as_str()).collect();
                let same = have.mig_enabled == want_mig && (!want_mig || have_layout == want.mig_layout.iter().map(String::as_str).collect::<Vec<_>>());
                let outcome = if same {
                    GpuApply::Converged
                } else {
                    GpuApply::Failed(format!(
                        "MIG layout differs (have {:?}, want {:?}); change it with `nvidia-smi mig` and a GPU reset, then run inventory.refresh",
                        have_layout, want.mig_layout
                    ))
                };
                (want.uuid.clone(), outcome)
            })
            .collect())
    }

    fn reset(&self, uuid: &str) -> Result<(), BackendError> {
        // NVML has no reset call; nvidia-smi's is the supported way (it needs root and an idle GPU).
        let out = std::process::Command::new("nvidia-smi")
            .args(["--gpu-reset", "-i", uuid])
            .output()
            .map_err(|e| BackendError::Failed(format!("nvidia-smi --gpu-reset: {e}")))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(BackendError::Failed(format!("nvidia-smi --gpu-reset -i {uuid}: {}", String::from_utf8_lossy(&out.stderr).trim())))
        }
    }

    fn diag(&self, req: &DiagNvml) -> Result<serde_json::Value, BackendError> {
        let health = self.health()?;
        let inv = self.inventory()?;
        let gpus: Vec<_> = inv
            .gpus
            .iter()
            .filter(|g| req.gpu_uuids.is_empty() || req.gpu_uuids.contains(&g.uuid))
            .map(|g| {
                let h = health.iter().find(|h| h.uuid == g.uuid);
                serde_json::json!({
                    "uuid": g.uuid, "model": g.model, "memoryMib": g.memory_mib, "migEnabled": g.mig_enabled,
                    "migInstances": g.mig_instances.iter().map(|m| &m.profile).collect::<Vec<_>>(),
                    "passed": h.is_some_and(|h| h.healthy), "reason": h.map(|h| h.reason.clone()),
                    "temperatureC": h.map(|h| h.temperature_c), "eccUncorrected": h.map(|h| h.ecc_uncorrected),
                    "xidErrors": h.map(|h| h.xid_errors.clone()), "remappedRows": h.map(|h| h.remapped_rows),
                    "remapPending": h.map(|h| h.remap_pending), "remapFailed": h.map(|h| h.remap_failed),
                    "nvlinkErrors": h.map(|h| h.nvlink_errors),
                })
            })
            .collect();
        Ok(serde_json::json!({"backend": "nvml", "level": req.level.max(1), "driverVersion": inv.gpus.first().map(|g| g.driver_version.clone()), "gpus": gpus}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mig_devices_profile_is_read_off_its_name() {
        assert_eq!(mig_profile_of("NVIDIA H100 80GB HBM3 MIG 3g.40gb").as_deref(), Some("3g.40gb"));
        assert_eq!(mig_profile_of("NVIDIA H100 80GB HBM3"), None);
    }

    #[test]
    fn health_is_judged_from_xids_ecc_and_temperature() {
        assert_eq!(judge(&[], 0, 50), (true, String::new()));
        assert!(judge(&[13], 0, 50).0, "XID 13 is an application error, not the GPU's");
        assert_eq!(judge(&[13, 79], 0, 50), (false, "XID 79".into()));
        assert!(!judge(&[], 2, 50).0);
        assert!(!judge(&[], 0, 95).0);
    }

    #[test]
    fn without_a_driver_opening_nvml_fails_with_a_clear_error() {
        match NvmlBackend::open() {
            Ok(b) => assert_eq!(b.name(), "nvml"), // a machine with a GPU
            Err(e) => {
                assert!(matches!(e, BackendError::Unavailable(_)));
                assert!(e.to_string().contains("NVML"), "{e}");
            }
        }
    }
}
