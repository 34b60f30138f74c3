//! The QEMU/KVM hypervisor on real KVM: a tiny guest (Debian's kernel, booted directly, and a
//! busybox initramfs this test builds) boots and says it is ready on its serial console; a second
//! backend over the same folder (a daemon restarted mid-boot) converges to exactly one VM; the VM
//! stops with its disk kept, starts again, reboots once, and is deleted with no process or folder
//! left. Skipped, saying why, where `/dev/kvm`, QEMU, a kernel or a static busybox is missing.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use better_compute_daemon::hypervisor::{Hypervisor, VmPower, VmSpec};
use better_compute_daemon::qemu::{Accel, Qemu, QEMU};

/// An ed25519 public key the guest prints as its host key, and its fingerprint (`ssh-keygen -l`).
const HOST_KEY: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl root@tiny";
const FINGERPRINT: &str = "SHA256:+DiY3wvvV6TuJJhbpZisF/zLDA0zPMSvHdkr4UvCOqU";

/// Why this machine cannot run the test, if it cannot.
fn missing() -> Option<String> {
    if std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").is_err() {
        return Some("/dev/kvm is not usable".into());
    }
    if std::process::Command::new(QEMU).arg("--version").output().is_err() {
        return Some(format!("{QEMU} is not installed (Debian's qemu-system-x86)"));
    }
    if kernel().is_none() {
        return Some("no kernel in /boot (Debian's linux-image-amd64)".into());
    }
    if std::process::Command::new("qemu-img").arg("--version").output().is_err() {
        return Some("qemu-img is not installed (Debian's qemu-utils)".into());
    }
    if !Path::new("/bin/busybox").exists() {
        return Some("no /bin/busybox (Debian's busybox-static)".into());
    }
    None
}

fn kernel() -> Option<PathBuf> {
    let mut k: Vec<PathBuf> = std::fs::read_dir("/boot").ok()?.flatten().map(|e| e.path()).filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))).collect();
    k.sort();
    k.pop()
}

/// A `newc` cpio archive (what the kernel unpacks as its initramfs).
struct Cpio(Vec<u8>, u32);

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
        self.1 += 1;
        let fields = [self.1, mode, 0, 0, 1, 0, data.len() as u32, 0, 0, rdev.0, rdev.1, name.len() as u32 + 1, 0];
        self.0.extend_from_slice(b"070701");
        for f in fields {
            self.0.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.0.extend_from_slice(name.as_bytes());
        self.0.push(0);
        self.pad();
        self.0.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.0.len().is_multiple_of(4) {
            self.0.push(0);
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, (0, 0), &[]);
        self.0
    }
}

/// The image `tiny` under `images`: the kernel, an initramfs whose init prints a host key block
/// and a ready line and then idles, and the kernel's command line.
fn tiny_image(images: &Path) {
    let dir = images.join("tiny");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(kernel().unwrap(), dir.join("vmlinuz")).unwrap();
    let init = format!(
        "#!/bin/busybox sh\n/bin/busybox mount -t proc proc /proc\necho -----BEGIN SSH HOST KEY KEYS-----\necho {HOST_KEY}\necho -----END SSH HOST KEY KEYS-----\necho BETTER-COMPUTE-READY\nwhile true; do /bin/busybox sleep 3600; done\n"
    );
    let mut cpio = Cpio(Vec::new(), 0);
    for d in ["bin", "dev", "proc"] {
        cpio.entry(d, 0o040755, (0, 0), &[]);
    }
    cpio.entry("dev/console", 0o020600, (5, 1), &[]);
    cpio.entry("bin/busybox", 0o100755, (0, 0), &std::fs::read("/bin/busybox").unwrap());
    cpio.entry("init", 0o100755, (0, 0), init.as_bytes());
    std::fs::write(dir.join("initrd.img"), cpio.finish()).unwrap();
    std::fs::write(dir.join("cmdline"), "console=ttyS0 panic=-1 quiet").unwrap();
    // A blank base disk: each VM gets a copy-on-write layer over it.
    let out = std::process::Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(dir.join("disk.qcow2")).arg("64M").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn vm(id: &str) -> VmSpec {
    VmSpec {
        instance_id: id.into(),
        allocation_id: "res_1".into(),
        vcpu: 1,
        memory_mib: 256,
        disk_gib: 1,
        image: "tiny".into(),
        ssh_public_keys: vec!["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB7 me@laptop".into()],
        user_data: String::new(),
        atoms: vec![],
    }
}

/// QEMU processes running `id`.
fn processes(id: &str) -> usize {
    let want = format!("-name\0{id}\0");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read(e.path().join("cmdline")).is_ok_and(|c| String::from_utf8_lossy(&c).contains(&want)))
        .count()
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(90);
    while !ok() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_tiny_guest_boots_survives_a_daemon_restart_as_one_vm_stops_reboots_and_leaves_nothing_when_deleted() {
    if let Some(why) = missing() {
        eprintln!("skipped: {why}");
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let vms = root.path().join("vms");
    let mut accel = Accel::Kvm;
    let qemu = Qemu::open(vms.clone()).unwrap();
    tiny_image(qemu.images_dir());
    let id = format!("ins_qemutest{}", std::process::id());
    let console = vms.join(&id).join("console.log");
    if let Err(e) = qemu.ensure(&vm(&id), true, 0) {
        // Nested virtualisation may offer /dev/kvm and still refuse the host's CPU model: the
        // rest runs on QEMU's emulator, which is all this test needs of the machine.
        eprintln!("KVM cannot run a guest here ({e}); the test goes on with TCG");
        qemu.delete(&id).unwrap();
        accel = Accel::Tcg;
        Qemu::open_with(vms.clone(), accel).unwrap().ensure(&vm(&id), true, 0).unwrap();
    }
    // The daemon restarts mid-boot: a new backend over the same folder finds the VM and starts
    // no second one.
    let again = Qemu::open_with(vms.clone(), accel).unwrap();
    again.ensure(&vm(&id), true, 0).unwrap();
    assert_eq!(processes(&id), 1);
    // Its disk is a layer over the base image; its seed carries the tenant's key.
    let info = std::process::Command::new("qemu-img").args(["info", "--force-share"]).arg(vms.join(&id).join("disk.qcow2")).output().unwrap();
    assert!(String::from_utf8_lossy(&info.stdout).contains("backing file"), "{}", String::from_utf8_lossy(&info.stderr));
    assert!(std::fs::read_to_string(vms.join(&id).join("seed/meta-data")).unwrap().contains("me@laptop"));
    wait_for("the guest's ready line", || std::fs::read_to_string(&console).is_ok_and(|c| c.contains("BETTER-COMPUTE-READY")));
    let listed = again.list().unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!((listed[0].power.clone(), listed[0].host_key_fingerprint.as_str()), (VmPower::Running, FINGERPRINT));
    let port: u16 = listed[0].address.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(0);
    assert!(port >= 22_200, "the address is the host's forwarded SSH port: {listed:?}");
    // Stopped: no process, the folder (its disk) kept.
    again.ensure(&vm(&id), false, 0).unwrap();
    assert_eq!((processes(&id), again.list().unwrap()[0].power.clone()), (0, VmPower::Stopped));
    // The console the daemon sends: the same bytes, from any offset.
    let first_boot = again.console(&id, 0, 1 << 20).unwrap();
    assert_eq!(first_boot.offset, 0);
    assert!(String::from_utf8_lossy(&first_boot.data).contains("BETTER-COMPUTE-READY"));
    let size = first_boot.size;
    assert_eq!(again.console(&id, size - 5, 100).unwrap().data, first_boot.data[first_boot.data.len() - 5..]);
    // Started again, then rebooted once (the count is recorded); the console only grows, so the
    // offsets sent before stay valid.
    let readies = || std::fs::read_to_string(&console).map(|c| c.matches("BETTER-COMPUTE-READY").count()).unwrap_or(0);
    again.ensure(&vm(&id), true, 0).unwrap();
    wait_for("the guest's ready line after a start", || readies() >= 2);
    let after = again.console(&id, size, 1 << 20).unwrap();
    assert_eq!(after.offset, size);
    assert!(String::from_utf8_lossy(&after.data).contains("BETTER-COMPUTE-READY"), "the second boot appends to the console");
    again.ensure(&vm(&id), true, 1).unwrap();
    assert_eq!((processes(&id), again.list().unwrap()[0].reboot_count), (1, 1));
    wait_for("the guest's ready line after the reset", || readies() >= 3);
    // Deleted: no process, no folder.
    again.delete(&id).unwrap();
    again.delete(&id).unwrap();
    assert_eq!(processes(&id), 0);
    assert!(!vms.join(&id).exists());
    assert_eq!(again.list().unwrap().len(), 0);
}
