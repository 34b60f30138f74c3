//! The QEMU/KVM hypervisor: a `qemu-system-x86_64` process per running VM, driven over QMP.
//!
//! Each instance has a folder `<root>/<instanceId>/` holding its copy-on-write disk
//! (`disk.qcow2`, backed by the cached base image), its cloud-init NoCloud seed (`seed.iso`, with
//! the tenant's SSH keys and user data), its QMP socket (`qmp.sock`), its serial console
//! (`console.log`) and what was applied (`vm.json`: the spec, the forwarded SSH port and the reboot
//! count). Whether a VM runs is read from `/proc` (a QEMU process whose `-name` is the instance), so
//! a daemon that crashed between starting a VM and reporting it finds it running and never starts
//! a second; the folder is the VM's existence, so a stopped VM keeps its disk.
//!
//! Base images live in `<root>/../images/<name>/`: `disk.qcow2` (a cloud image) or, for direct
//! kernel boot, `vmlinuz` and `initrd.img` (with an optional `cmdline`). The guest's network is
//! QEMU's user-mode NIC (virtio-net) with the guest's port 22 forwarded to a port of the host, so
//! the address to SSH to is `<host>:<port>`. Whole GPUs would be passed through with VFIO
//! (`vfio-pci`); this backend refuses MIG instances and shared slots, which need a vGPU backend.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use base64::Engine;
use serde::{Deserialize, Serialize};
use sha2::Digest;

use crate::hypervisor::{ConsoleRead, Hypervisor, HypervisorError, ImageSource, Vm, VmPower, VmSpec};

/// The QEMU binary.
pub const QEMU: &str = "qemu-system-x86_64";
/// How long a QMP exchange may take.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a stopping VM's process may take to exit.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// The first host port forwarded to a guest's SSH.
const FIRST_SSH_PORT: u16 = 22_200;

/// What a VM's folder records of it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Applied {
    instance_id: String,
    ssh_port: u16,
    reboot_count: u32,
}

/// How QEMU runs guests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// KVM with the host's CPU model: what a vps-host runs.
    Kvm,
    /// QEMU's emulator, for machines without a working KVM (tests on nested virtualisation);
    /// far slower, never for tenants.
    Tcg,
}

/// The QEMU/KVM backend.
#[derive(Debug)]
pub struct Qemu {
    accel: Accel,
    root: PathBuf,
    images: PathBuf,
    /// The host name in the addresses it reports.
    host: String,
    /// One change at a time: ensure and delete read, then act.
    lock: Mutex<()>,
}

fn failed(what: &str, e: impl std::fmt::Display) -> HypervisorError {
    HypervisorError::Failed(format!("{what}: {e}"))
}

impl Qemu {
    /// The backend with its VMs under `root` and its images beside it (`root/../images`): checks
    /// that KVM and QEMU are there.
    pub fn open(root: PathBuf) -> Result<Qemu, HypervisorError> {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .map_err(|e| HypervisorError::Unavailable(format!("/dev/kvm: {e} (enable virtualisation, load kvm_intel or kvm_amd)")))?;
        Qemu::open_with(root, Accel::Kvm)
    }

    /// The backend with another accelerator ([`Accel::Tcg`] where KVM does not work).
    pub fn open_with(root: PathBuf, accel: Accel) -> Result<Qemu, HypervisorError> {
        Command::new(QEMU)
            .arg("--version")
            .output()
            .map_err(|e| HypervisorError::Unavailable(format!("{QEMU}: {e} (install Debian's qemu-system-x86)")))?;
        std::fs::create_dir_all(&root).map_err(|e| failed("cannot make the VMs' folder", e))?;
        let images = root.parent().unwrap_or(&root).join("images");
        let host = std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_owned()).unwrap_or_else(|_| "localhost".into());
        Ok(Qemu { accel, root, images, host, lock: Mutex::new(()) })
    }

    /// Where the base images are cached.
    pub fn images_dir(&self) -> &Path {
        &self.images
    }

    fn dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    /// The pid of the QEMU process running `id`, from `/proc`.
    fn pid_of(id: &str) -> Option<u32> {
        let want = format!("-name\0{id}\0");
        std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let text = String::from_utf8_lossy(&cmdline);
            (text.contains(QEMU) && text.contains(&want)).then_some(pid)
        })
    }

    fn applied(&self, id: &str) -> Option<Applied> {
        serde_json::from_slice(&std::fs::read(self.dir(id).join("vm.json")).ok()?).ok()
    }

    fn save(&self, a: &Applied) -> Result<(), HypervisorError> {
        let path = self.dir(&a.instance_id).join("vm.json");
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(a).expect("serializes")).and_then(|_| std::fs::rename(&tmp, &path)).map_err(|e| failed("cannot record the VM", e))
    }

    /// A port no other VM here forwards.
    fn free_port(&self) -> u16 {
        let used: Vec<u16> = std::fs::read_dir(&self.root)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| self.applied(e.file_name().to_str()?).map(|a| a.ssh_port))
            .collect();
        (FIRST_SSH_PORT..u16::MAX).find(|p| !used.contains(p) && std::net::TcpListener::bind(("0.0.0.0", *p)).is_ok()).unwrap_or(FIRST_SSH_PORT)
    }

    /// Makes the VM's folder: its disk over the base image and its cloud-init seed.
    fn create(&self, vm: &VmSpec, reboot_count: u32) -> Result<(), HypervisorError> {
        let base = self.images.join(&vm.image);
        if !base.is_dir() {
            return Err(HypervisorError::Refused(format!("image {} is not in this host's cache ({})", vm.image, base.display())));
        }
        let dir = self.dir(&vm.instance_id);
        let building = self.root.join(format!(".{}.building", vm.instance_id));
        let _ = std::fs::remove_dir_all(&building);
        std::fs::create_dir_all(&building).map_err(|e| failed("cannot make the VM's folder", e))?;
        if base.join("disk.qcow2").exists() {
            let out = Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
                .arg(base.join("disk.qcow2"))
                .arg(building.join("disk.qcow2"))
                .arg(format!("{}G", vm.disk_gib.max(1)))
                .output()
                .map_err(|e| failed("qemu-img", e))?;
            if !out.status.success() {
                return Err(failed("qemu-img create", String::from_utf8_lossy(&out.stderr)));
            }
        }
        let seed = building.join("seed");
        std::fs::create_dir_all(&seed).map_err(|e| failed("seed", e))?;
        let keys: String = vm.ssh_public_keys.iter().map(|k| format!("  - {k}\n")).collect();
        let user_data = if vm.user_data.is_empty() { "#cloud-config\n".to_owned() } else { vm.user_data.clone() };
        let write = |name: &str, text: &str| std::fs::write(seed.join(name), text).map_err(|e| failed("seed", e));
        write("meta-data", &format!("instance-id: {}\nlocal-hostname: {}\npublic-keys:\n{keys}", vm.instance_id, vm.instance_id.replace('_', "-")))?;
        write("user-data", &user_data)?;
        // The NoCloud seed as an ISO labelled cidata, where genisoimage is installed.
        if let Ok(out) = Command::new("genisoimage")
            .args(["-quiet", "-output"])
            .arg(building.join("seed.iso"))
            .args(["-volid", "cidata", "-joliet", "-rock"])
            .arg(seed.join("user-data"))
            .arg(seed.join("meta-data"))
            .output()
            && !out.status.success()
        {
            return Err(failed("genisoimage", String::from_utf8_lossy(&out.stderr)));
        }
        std::fs::rename(&building, &dir).map_err(|e| failed("cannot make the VM's folder", e))?;
        self.save(&Applied { instance_id: vm.instance_id.clone(), ssh_port: self.free_port(), reboot_count })
    }

    fn start(&self, vm: &VmSpec, a: &Applied) -> Result<(), HypervisorError> {
        let dir = self.dir(&vm.instance_id);
        let base = self.images.join(&vm.image);
        let mut cmd = Command::new(QEMU);
        let (accel, cpu) = match self.accel {
            Accel::Kvm => ("q35,accel=kvm", "host"),
            Accel::Tcg => ("q35,accel=tcg", "max"),
        };
        cmd.args(["-name", &vm.instance_id, "-machine", accel, "-cpu", cpu, "-nodefaults", "-display", "none", "-daemonize"])
            .args(["-smp", &vm.vcpu.max(1).to_string(), "-m", &format!("{}M", vm.memory_mib.max(128))])
            .arg("-pidfile")
            .arg(dir.join("pid"))
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", dir.join("qmp.sock").display()))
            // Appended to, so the console only grows while the VM exists (offsets stay valid across
            // restarts of the VM).
            .arg("-chardev")
            .arg(format!("file,id=console,append=on,path={}", dir.join("console.log").display()))
            .args(["-serial", "chardev:console"])
            .args(["-nic", &format!("user,model=virtio-net-pci,hostfwd=tcp::{}-:22", a.ssh_port)]);
        if dir.join("disk.qcow2").exists() {
            cmd.arg("-drive").arg(format!("file={},if=virtio,format=qcow2", dir.join("disk.qcow2").display()));
        }
        if dir.join("seed.iso").exists() {
            cmd.arg("-drive").arg(format!("file={},if=virtio,format=raw,readonly=on", dir.join("seed.iso").display()));
        }
        if base.join("vmlinuz").exists() {
            let cmdline = std::fs::read_to_string(base.join("cmdline")).unwrap_or_else(|_| "console=ttyS0 panic=-1".into());
            cmd.arg("-kernel").arg(base.join("vmlinuz")).arg("-initrd").arg(base.join("initrd.img")).args(["-append", cmdline.trim()]);
        }
        let out = cmd.output().map_err(|e| failed(QEMU, e))?;
        if !out.status.success() {
            return Err(failed("QEMU did not start", String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(())
    }

    /// One QMP command on the VM's socket: its `return`.
    fn qmp(&self, id: &str, command: &str) -> Result<serde_json::Value, HypervisorError> {
        let s = UnixStream::connect(self.dir(id).join("qmp.sock")).map_err(|e| failed("QMP", e))?;
        s.set_read_timeout(Some(QMP_TIMEOUT)).map_err(|e| failed("QMP", e))?;
        let mut w = s.try_clone().map_err(|e| failed("QMP", e))?;
        let mut r = BufReader::new(s);
        let answer = |r: &mut BufReader<UnixStream>| -> Result<serde_json::Value, HypervisorError> {
            loop {
                let mut line = String::new();
                if r.read_line(&mut line).map_err(|e| failed("QMP", e))? == 0 {
                    return Err(failed("QMP", "the socket closed"));
                }
                let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| failed("QMP", e))?;
                if let Some(ret) = v.get("return") {
                    return Ok(ret.clone());
                }
                if let Some(err) = v.get("error") {
                    return Err(failed("QMP", err));
                }
                // A greeting or an event: read on.
            }
        };
        let mut greeting = String::new();
        r.read_line(&mut greeting).map_err(|e| failed("QMP", e))?;
        writeln!(w, r#"{{"execute":"qmp_capabilities"}}"#).map_err(|e| failed("QMP", e))?;
        answer(&mut r)?;
        writeln!(w, r#"{{"execute":"{command}"}}"#).map_err(|e| failed("QMP", e))?;
        // `quit` may close the socket before it answers.
        match answer(&mut r) {
            Err(_) if command == "quit" => Ok(serde_json::Value::Null),
            other => other,
        }
    }

    /// Stops the VM's process: QMP `quit`, then SIGKILL if it lingers.
    fn stop(&self, id: &str) -> Result<(), HypervisorError> {
        let Some(pid) = Self::pid_of(id) else { return Ok(()) };
        let _ = self.qmp(id, "quit");
        let until = Instant::now() + STOP_TIMEOUT;
        while Self::pid_of(id).is_some() {
            if Instant::now() > until {
                // SAFETY: kill(2) with a pid read from /proc for this VM's QEMU; no memory is touched.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                std::thread::sleep(Duration::from_millis(100));
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The guest's SSH host key fingerprint, from the host keys cloud-init prints on the console.
    fn fingerprint(&self, id: &str) -> String {
        let Ok(console) = std::fs::read_to_string(self.dir(id).join("console.log")) else { return String::new() };
        host_key_fingerprint(&console).unwrap_or_default()
    }
}

/// `SHA256:<base64>` of the first ed25519 (else any) host key between cloud-init's
/// `-----BEGIN SSH HOST KEY KEYS-----` and `-----END SSH HOST KEY KEYS-----` on a console.
pub fn host_key_fingerprint(console: &str) -> Option<String> {
    let block = console.split("-----BEGIN SSH HOST KEY KEYS-----").nth(1)?.split("-----END SSH HOST KEY KEYS-----").next()?;
    let keys: Vec<(&str, &str)> = block.lines().filter_map(|l| {
        let mut f = l.split_whitespace();
        Some((f.next()?, f.next()?))
    }).collect();
    let (_, blob) = keys.iter().find(|(k, _)| *k == "ssh-ed25519").or(keys.first())?;
    let bytes = base64::engine::general_purpose::STANDARD.decode(blob).ok()?;
    Some(format!("SHA256:{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(sha2::Sha256::digest(bytes))))
}

impl Hypervisor for Qemu {
    fn name(&self) -> &'static str {
        "qemu"
    }

    fn console(&self, instance_id: &str, from: u64, max_bytes: usize) -> Result<ConsoleRead, HypervisorError> {
        use std::io::{Read, Seek, SeekFrom};
        let path = self.dir(instance_id).join("console.log");
        let mut f = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && self.applied(instance_id).is_some() => return Ok(ConsoleRead::default()),
            Err(e) => return Err(failed("cannot read the console", e)),
        };
        let size = f.metadata().map_err(|e| failed("cannot read the console", e))?.len();
        let offset = from.min(size);
        f.seek(SeekFrom::Start(offset)).map_err(|e| failed("cannot read the console", e))?;
        let mut data = Vec::with_capacity(max_bytes.min((size - offset) as usize));
        f.take(max_bytes as u64).read_to_end(&mut data).map_err(|e| failed("cannot read the console", e))?;
        Ok(ConsoleRead { offset, data, size })
    }

    fn list(&self) -> Result<Vec<Vm>, HypervisorError> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.root).map_err(|e| failed("cannot read the VMs' folder", e))?.flatten() {
            let Some(id) = e.file_name().to_str().map(str::to_owned) else { continue };
            if id.starts_with('.') {
                continue;
            }
            let Some(a) = self.applied(&id) else { continue };
            let power = if Self::pid_of(&id).is_some() { VmPower::Running } else { VmPower::Stopped };
            out.push(Vm {
                host_key_fingerprint: self.fingerprint(&id),
                address: format!("{}:{}", self.host, a.ssh_port),
                instance_id: id,
                power,
                reboot_count: a.reboot_count,
            });
        }
        out.sort_by(|a, b| a.instance_id.cmp(&b.instance_id));
        Ok(out)
    }

    fn ensure(&self, vm: &VmSpec, running: bool, reboot_count: u32) -> Result<(), HypervisorError> {
        if let Some(a) = vm.atoms.iter().find(|a| a.contains('/')) {
            return Err(HypervisorError::Refused(format!("atom {a} is a MIG instance or shared slot; this host has no vGPU backend to expose it to a VM")));
        }
        let _one = self.lock.lock().expect("qemu lock");
        if self.applied(&vm.instance_id).is_none() {
            let _ = std::fs::remove_dir_all(self.dir(&vm.instance_id));
            self.create(vm, reboot_count)?;
        }
        let mut a = self.applied(&vm.instance_id).ok_or_else(|| failed("the VM's record", "missing after create"))?;
        let up = Self::pid_of(&vm.instance_id).is_some();
        match (running, up) {
            (true, false) => self.start(vm, &a)?,
            (false, true) => self.stop(&vm.instance_id)?,
            (true, true) if a.reboot_count < reboot_count => {
                self.qmp(&vm.instance_id, "system_reset")?;
            }
            _ => {}
        }
        if a.reboot_count < reboot_count {
            a.reboot_count = reboot_count;
            self.save(&a)?;
        }
        Ok(())
    }

    fn images_dir(&self) -> Option<PathBuf> {
        Some(self.images.clone())
    }

    fn check(&self, images: &[ImageSource]) -> serde_json::Value {
        let mut problems = Vec::new();
        let kvm = std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm");
        if let Err(e) = &kvm {
            problems.push(format!("/dev/kvm: {e}"));
        }
        let qemu = Command::new(QEMU).arg("--version").output().ok().filter(|o| o.status.success()).map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").to_owned());
        if qemu.is_none() {
            problems.push(format!("{QEMU} does not run (install Debian's qemu-system-x86)"));
        }
        // Without an IOMMU no GPU can be passed through.
        let iommu_groups = std::fs::read_dir("/sys/kernel/iommu_groups").map(|d| d.count()).unwrap_or(0);
        if iommu_groups == 0 {
            problems.push("no IOMMU groups: enable VT-d/AMD-Vi and boot with intel_iommu=on (or amd_iommu=on)".into());
        }
        let mut found = serde_json::Map::new();
        for image in images {
            let name = &image.name;
            let dir = self.images.join(name);
            let file = ["disk.qcow2", "vmlinuz"].iter().map(|f| dir.join(f)).find(|f| f.exists());
            let sha256 = file.as_deref().and_then(crate::images::sha256_of);
            match &sha256 {
                None => problems.push(format!("image {name} is not in the cache ({})", dir.display())),
                Some(s) if !image.sha256.is_empty() && *s != image.sha256 => {
                    problems.push(format!("image {name} in the cache has sha256 {s}, not the catalogue's {}", image.sha256))
                }
                Some(_) => {}
            }
            found.insert(name.clone(), serde_json::json!({"present": sha256.is_some(), "sha256": sha256}));
        }
        serde_json::json!({"hypervisor": "qemu", "accel": format!("{:?}", self.accel).to_lowercase(), "kvm": kvm.is_ok(), "qemu": qemu, "iommuGroups": iommu_groups, "problems": problems, "images": found})
    }

    fn delete(&self, instance_id: &str) -> Result<(), HypervisorError> {
        let _one = self.lock.lock().expect("qemu lock");
        self.stop(instance_id)?;
        match std::fs::remove_dir_all(self.dir(instance_id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(failed("cannot remove the VM's folder", e)),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_key_fingerprint_is_read_from_cloud_inits_console_block() {
        let console = "boot…\n-----BEGIN SSH HOST KEY KEYS-----\necdsa-sha2-nistp256 AAAAE2VjZHNh root@vm\nssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl root@vm\n-----END SSH HOST KEY KEYS-----\n";
        // `ssh-keygen -lf` of that key.
        assert_eq!(host_key_fingerprint(console).as_deref(), Some("SHA256:+DiY3wvvV6TuJJhbpZisF/zLDA0zPMSvHdkr4UvCOqU"));
        assert_eq!(host_key_fingerprint("no keys here"), None);
    }
}
