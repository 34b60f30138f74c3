//! Command execution: what each kind does on the node.

use super::*;
use crate::hypervisor::ImageSource;

impl Daemon {
    /// Runs a command. `cancellable` is taken back (true to false) at a point of no return; when
    /// that fails, a cancel came first and the command must not go on.
    #[allow(clippy::too_many_lines, reason = "one arm per command kind, each handing off to its module")]
    pub(super) async fn execute(&self, p: Payload, cancellable: &AtomicBool) -> Option<Outcome> {
        let ok = |v: serde_json::Value| Some(Outcome { succeeded: true, reason: String::new(), result_json: v.to_string() });
        let fail = |r: String| Some(Outcome { succeeded: false, reason: r, result_json: "null".into() });
        match p {
            Payload::DiagNvml(req) => {
                let backend = self.backend.clone();
                // A reset under a workload would kill it: a GPU any allocation holds is never reset.
                let held: Vec<String> = if req.reset {
                    let st = self.state.lock().expect("state");
                    req.gpu_uuids.iter().filter(|u| st.applied.as_ref().is_some_and(|a| a.holds_gpu(u))).cloned().collect()
                } else {
                    Vec::new()
                };
                let run = move || {
                    let mut resets = serde_json::Map::new();
                    if req.reset {
                        for u in &req.gpu_uuids {
                            let r = if held.contains(u) {
                                "refused: an allocation holds the GPU".to_owned()
                            } else {
                                match backend.reset(u) {
                                    Ok(()) => "done".to_owned(),
                                    Err(e) => format!("failed: {e}"),
                                }
                            };
                            resets.insert(u.clone(), r.into());
                        }
                    }
                    backend.diag(&req).map(|mut report| {
                        if req.reset {
                            report["resets"] = resets.into();
                        }
                        report
                    })
                };
                match tokio::task::spawn_blocking(run).await {
                    Ok(Ok(report)) => ok(report),
                    Ok(Err(e)) => fail(e.to_string()),
                    Err(e) => fail(format!("diagnostics crashed: {e}")),
                }
            }
            Payload::InventoryRefresh(req) => {
                let backend = self.backend.clone();
                let inv = match tokio::task::spawn_blocking(move || backend.inventory()).await {
                    Ok(Ok(mut inv)) => {
                        self.cfg.host.fill(&mut inv);
                        inv
                    }
                    Ok(Err(e)) => return fail(e.to_string()),
                    Err(e) => return fail(format!("inventory crashed: {e}")),
                };
                self.send(daemon_message::Msg::Inventory(inv.clone())).await;
                let all = req.sections.is_empty();
                let want = |s: &str| all || req.sections.iter().any(|x| x == s);
                let mut report = serde_json::Map::new();
                if want("gpus") {
                    report.insert("gpus".into(), serde_json::to_value(&inv.gpus).unwrap_or_default());
                }
                if want("cpus") {
                    report.insert("cpus".into(), serde_json::json!({"vcpu": inv.vcpu}));
                }
                if want("memory") {
                    report.insert("memory".into(), serde_json::json!({"memoryMib": inv.memory_mib}));
                }
                if want("disks") {
                    report.insert("disks".into(), serde_json::json!({"diskGib": inv.disk_gib}));
                }
                if want("network") {
                    report.insert("network".into(), serde_json::json!({}));
                }
                ok(serde_json::json!({"rescanned": req.rescan, "backend": inv.backend, "sections": report}))
            }
            Payload::LogsCollect(req) => ok(crate::logs::collect(&self.logs, &req).await),
            Payload::VpsBootstrap(req) => {
                let hv = self.cfg.hypervisor.clone();
                // The catalogue's images first, so the check sees what was fetched.
                let (mut fetched, mut fetch_problems) = (serde_json::Map::new(), Vec::new());
                if let Some(dir) = hv.as_ref().and_then(|h| h.images_dir()) {
                    for src in &req.sources {
                        let outcome = match crate::images::ensure(&dir, src).await {
                            Ok(crate::images::Cached::Kept) => "kept".to_owned(),
                            Ok(crate::images::Cached::Fetched(n)) => format!("fetched {n} bytes"),
                            Err(e) => {
                                fetch_problems.push(format!("image {}: {e}", src.name));
                                format!("failed: {e}")
                            }
                        };
                        self.logs.line(format!("image {}: {outcome}", src.name));
                        fetched.insert(src.name.clone(), outcome.into());
                    }
                }
                let mut images = req.sources.clone();
                images.extend(req.images.iter().filter(|n| !req.sources.iter().any(|s| &s.name == *n)).map(|n| ImageSource { name: n.clone(), ..Default::default() }));
                match tokio::task::spawn_blocking(move || hv.map_or_else(crate::hypervisor::check_without_hypervisor, |h| h.check(&images))).await {
                    Ok(mut report) => {
                        if let Some(p) = report["problems"].as_array_mut() {
                            p.extend(fetch_problems.into_iter().map(serde_json::Value::from));
                        }
                        report["fetched"] = fetched.into();
                        ok(report)
                    }
                    Err(e) => fail(format!("the check crashed: {e}")),
                }
            }
            Payload::NodeReboot(req) => {
                self.logs.line(format!("rebooting in {} s: {}", req.grace_seconds, req.reason));
                tokio::time::sleep(Duration::from_secs(req.grace_seconds as u64)).await;
                if cancellable.compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst).is_err() {
                    // Cancelled during the grace: the cancel reports it.
                    return None;
                }
                match &self.cfg.reboot {
                    // Admission refuses node.reboot as UNSUPPORTED on such a daemon (`kinds_run`).
                    RebootHook::Disabled => {
                        fail("reboot is not enabled on this daemon: start it with --reboot-command or --allow-systemctl-reboot".into())
                    }
                    RebootHook::Callback(f) => {
                        f(&req.reason);
                        None
                    }
                    RebootHook::Command(argv) => {
                        let Some((prog, args)) = argv.split_first() else { return fail("empty reboot command".into()) };
                        match tokio::process::Command::new(prog).args(args).status().await {
                            Ok(s) if s.success() => None,
                            Ok(s) => fail(format!("reboot command exited with {s}")),
                            Err(e) => fail(format!("reboot command: {e}")),
                        }
                    }
                }
            }
        }
    }
}
