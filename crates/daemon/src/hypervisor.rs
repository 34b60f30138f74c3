//! The hypervisor contract: what a vps-host's daemon asks of the machine to run instances as VMs,
//! and the fake one `dev`, the simulator and tests use. Every call is idempotent and every answer
//! is read back from the machine (processes, sockets, disks), never from the daemon's memory, so a
//! daemon that restarted mid-way converges to exactly the VMs its desired state names.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;

pub use better_compute_proto::v1::ImageSource;

/// Why the hypervisor could not do something.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HypervisorError {
    /// The hypervisor is not there (no `/dev/kvm`, no QEMU).
    #[error("hypervisor unavailable: {0}")]
    Unavailable(String),
    /// This VM cannot run here, and trying again will not help (a MIG or slot atom without a
    /// vGPU backend, an image the host does not have).
    #[error("{0}")]
    Refused(String),
    /// A call failed; the daemon tries again.
    #[error("hypervisor: {0}")]
    Failed(String),
}

/// A VM as the daemon asks for it: the instance, with its allocation's resources.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VmSpec {
    /// `ins_…`.
    pub instance_id: String,
    /// The allocation it runs on.
    pub allocation_id: String,
    /// vCPUs.
    pub vcpu: u32,
    /// Memory.
    pub memory_mib: u64,
    /// Disk.
    pub disk_gib: u64,
    /// The base image's name.
    pub image: String,
    /// SSH keys for the guest.
    pub ssh_public_keys: Vec<String>,
    /// cloud-init user data.
    pub user_data: String,
    /// The atoms passed through: whole GPUs (`<uuid>`), MIG instances (`<uuid>/mig<k>`) or slots.
    pub atoms: Vec<String>,
}

/// A VM's power, as the machine says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmPower {
    /// Its process runs.
    Running,
    /// Its disk is there and no process runs.
    Stopped,
}

/// A VM the machine has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vm {
    /// `ins_…`.
    pub instance_id: String,
    /// Running or stopped.
    pub power: VmPower,
    /// The guest's address, once known.
    pub address: String,
    /// The guest's SSH host key fingerprint (`SHA256:…`), once read from its console.
    pub host_key_fingerprint: String,
    /// The reboot count it has applied.
    pub reboot_count: u32,
}

/// Bytes read from a VM's serial console.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConsoleRead {
    /// Where `data` starts.
    pub offset: u64,
    /// The bytes.
    pub data: Vec<u8>,
    /// The console's length now.
    pub size: u64,
}

impl ConsoleRead {
    /// The part of `console` from `from`, at most `max_bytes`.
    pub fn of(console: &[u8], from: u64, max_bytes: usize) -> ConsoleRead {
        let start = (from.min(console.len() as u64)) as usize;
        let end = console.len().min(start.saturating_add(max_bytes));
        ConsoleRead { offset: start as u64, data: console[start..end].to_vec(), size: console.len() as u64 }
    }
}

/// A hypervisor backend. Calls may block; the daemon runs them off its async threads.
pub trait Hypervisor: Send + Sync + std::fmt::Debug + 'static {
    /// `qemu` or `fake`.
    fn name(&self) -> &'static str;

    /// Every VM the machine has, running or stopped.
    fn list(&self) -> Result<Vec<Vm>, HypervisorError>;

    /// Makes the VM exist (its disk made from the image if it has none) and run or not as asked;
    /// a running VM whose applied reboot count is below `reboot_count` is restarted once.
    fn ensure(&self, vm: &VmSpec, running: bool, reboot_count: u32) -> Result<(), HypervisorError>;

    /// Stops the VM if it runs and removes it, disk and all; nothing when there is none.
    fn delete(&self, instance_id: &str) -> Result<(), HypervisorError>;

    /// The VM's serial console from byte `from` (clamped to its end), at most `max_bytes` of it,
    /// and how long the console is now. The console only grows while the VM exists.
    fn console(&self, instance_id: &str, from: u64, max_bytes: usize) -> Result<ConsoleRead, HypervisorError>;

    /// What the host has for running VMs (`vps.bootstrap`'s report): `problems` lists what keeps
    /// it from running them, empty when it can; `images` says, for each image asked, whether the
    /// cache has it and its sha256 (a problem when it is not the one asked for).
    fn check(&self, images: &[ImageSource]) -> serde_json::Value;

    /// Where base images are cached, for `vps.bootstrap` to fetch them into (none: this backend
    /// needs no images).
    fn images_dir(&self) -> Option<PathBuf> {
        None
    }
}

/// `vps.bootstrap` on a daemon with no hypervisor.
pub fn check_without_hypervisor() -> serde_json::Value {
    serde_json::json!({"hypervisor": "none", "problems": ["this daemon runs no hypervisor: start it with --hypervisor qemu"], "images": {}})
}

/// Opens the hypervisor a `--hypervisor` value names: `none`, `fake` (its VMs kept in
/// `state_dir`), or `qemu`.
pub fn open(value: &str, state_dir: &std::path::Path) -> Result<Option<std::sync::Arc<dyn Hypervisor>>, HypervisorError> {
    match value {
        "none" => Ok(None),
        "fake" => Ok(Some(std::sync::Arc::new(FakeHypervisor::new(Some(state_dir.join("fake-vms.tsv")))))),
        "qemu" => Ok(Some(std::sync::Arc::new(crate::qemu::Qemu::open(state_dir.join("vms"))?))),
        other => Err(HypervisorError::Unavailable(format!("unknown hypervisor {other:?}: expected none, fake or qemu"))),
    }
}

/// A hypervisor in memory (kept in a file under the daemon's state directory when given, so VMs
/// outlive a daemon restart as real ones do): VMs boot at once, with an address from a /24 and a
/// fingerprint derived from the instance id. MIG and slot atoms are refused, as a host without a
/// vGPU backend refuses them.
#[derive(Debug, Default)]
pub struct FakeHypervisor {
    file: Option<PathBuf>,
    vms: Mutex<BTreeMap<String, Vm>>,
    /// Test only: deletes nothing (`sim --broken keep-deleted-vms` proves the checks catch it).
    leaks: bool,
}

impl FakeHypervisor {
    /// A fake whose VMs live in `file` (none: in memory only).
    pub fn new(file: Option<PathBuf>) -> FakeHypervisor {
        let vms = file
            .as_ref()
            .and_then(|f| std::fs::read_to_string(f).ok())
            .map(|text| {
                text.lines()
                    .filter_map(|l| {
                        let mut f = l.split('\t');
                        let (id, power, address, fp, reboots) = (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?.parse().ok()?);
                        let power = if power == "running" { VmPower::Running } else { VmPower::Stopped };
                        Some((id.to_owned(), Vm { instance_id: id.to_owned(), power, address: address.to_owned(), host_key_fingerprint: fp.to_owned(), reboot_count: reboots }))
                    })
                    .collect()
            })
            .unwrap_or_default();
        FakeHypervisor { file, vms: Mutex::new(vms), leaks: false }
    }

    /// Test only: a broken fake that never deletes a VM, so that leaked VMs can be shown caught.
    pub fn leaking(file: Option<PathBuf>) -> FakeHypervisor {
        FakeHypervisor { leaks: true, ..FakeHypervisor::new(file) }
    }

    /// Test only: the VM's process dies (a crash, an OOM kill), its disk kept.
    pub fn crash(&self, instance_id: &str) {
        if let Some(v) = self.vms.lock().expect("fake VMs").get_mut(instance_id) {
            v.power = VmPower::Stopped;
        }
    }

    fn save(&self, vms: &BTreeMap<String, Vm>) -> Result<(), HypervisorError> {
        let Some(file) = &self.file else { return Ok(()) };
        let text: String = vms
            .values()
            .map(|v| format!("{}\t{}\t{}\t{}\t{}\n", v.instance_id, if v.power == VmPower::Running { "running" } else { "stopped" }, v.address, v.host_key_fingerprint, v.reboot_count))
            .collect();
        let tmp = file.with_extension("tmp");
        std::fs::write(&tmp, text).and_then(|_| std::fs::rename(&tmp, file)).map_err(|e| HypervisorError::Failed(format!("cannot save the fake VMs: {e}")))
    }
}

/// A stable small number from an instance id, for the fake's addresses and fingerprints.
fn hash_of(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

impl Hypervisor for FakeHypervisor {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn list(&self) -> Result<Vec<Vm>, HypervisorError> {
        Ok(self.vms.lock().expect("fake VMs").values().cloned().collect())
    }

    fn ensure(&self, vm: &VmSpec, running: bool, reboot_count: u32) -> Result<(), HypervisorError> {
        if let Some(a) = vm.atoms.iter().find(|a| a.contains('/')) {
            return Err(HypervisorError::Refused(format!("atom {a} is a MIG instance or shared slot, and this host has no vGPU backend to expose it")));
        }
        if vm.image.is_empty() {
            return Err(HypervisorError::Refused("no image".into()));
        }
        let mut vms = self.vms.lock().expect("fake VMs");
        let h = hash_of(&vm.instance_id);
        let v = vms.entry(vm.instance_id.clone()).or_insert_with(|| Vm {
            instance_id: vm.instance_id.clone(),
            power: VmPower::Stopped,
            address: format!("10.88.{}.{}", (h >> 8) % 250 + 1, h % 250 + 2),
            host_key_fingerprint: format!("SHA256:fake{h:016x}"),
            reboot_count,
        });
        v.power = if running { VmPower::Running } else { VmPower::Stopped };
        // A restart of the fake is instant: only the count moves.
        v.reboot_count = v.reboot_count.max(reboot_count);
        self.save(&vms)
    }

    fn console(&self, instance_id: &str, from: u64, max_bytes: usize) -> Result<ConsoleRead, HypervisorError> {
        let vms = self.vms.lock().expect("fake VMs");
        let v = vms.get(instance_id).ok_or_else(|| HypervisorError::Failed(format!("no VM {instance_id}")))?;
        // One boot's lines per applied reboot count: the console grows as a real one does.
        let text: String = (0..=v.reboot_count)
            .map(|k| format!("[fake] {} boot {k}\nSSH host key: {}\n{} login: \n", v.instance_id, v.host_key_fingerprint, v.instance_id))
            .collect();
        Ok(ConsoleRead::of(text.as_bytes(), from, max_bytes))
    }

    fn check(&self, images: &[ImageSource]) -> serde_json::Value {
        // The fake has every image, with the digest asked for.
        let images: serde_json::Map<String, serde_json::Value> = images
            .iter()
            .map(|i| {
                let sha256 = if i.sha256.is_empty() { format!("{:064x}", hash_of(&i.name)) } else { i.sha256.clone() };
                (i.name.clone(), serde_json::json!({"present": true, "sha256": sha256}))
            })
            .collect();
        serde_json::json!({"hypervisor": "fake", "kvm": true, "iommuGroups": 0, "problems": [], "images": images})
    }

    fn delete(&self, instance_id: &str) -> Result<(), HypervisorError> {
        let mut vms = self.vms.lock().expect("fake VMs");
        if !self.leaks && vms.remove(instance_id).is_some() {
            self.save(&vms)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(id: &str, atoms: &[&str]) -> VmSpec {
        VmSpec {
            instance_id: id.into(),
            allocation_id: "res_1".into(),
            vcpu: 2,
            memory_mib: 2048,
            disk_gib: 10,
            image: "debian-12".into(),
            ssh_public_keys: vec!["ssh-ed25519 AAAA me".into()],
            user_data: String::new(),
            atoms: atoms.iter().map(|a| a.to_string()).collect(),
        }
    }

    #[test]
    fn the_fakes_vms_outlive_a_restart_through_its_file_and_mig_atoms_are_refused() {
        let dir = std::env::temp_dir().join(format!("bc-fake-hv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("vms.tsv");
        let hv = FakeHypervisor::new(Some(file.clone()));
        hv.ensure(&spec("ins_a", &["GPU-1"]), true, 0).unwrap();
        hv.ensure(&spec("ins_b", &["GPU-2"]), false, 0).unwrap();
        hv.ensure(&spec("ins_a", &["GPU-1"]), true, 2).unwrap();
        assert!(matches!(hv.ensure(&spec("ins_c", &["GPU-3/mig0"]), true, 0), Err(HypervisorError::Refused(_))));
        let again = FakeHypervisor::new(Some(file));
        let vms = again.list().unwrap();
        assert_eq!(vms.len(), 2, "{vms:?}");
        assert_eq!((vms[0].power.clone(), vms[0].reboot_count, vms[1].power.clone()), (VmPower::Running, 2, VmPower::Stopped));
        again.delete("ins_a").unwrap();
        again.delete("ins_a").unwrap();
        assert_eq!(again.list().unwrap().len(), 1);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
