//! Command admission: the checks in the spec's order, the journal before the acknowledgement, the
//! lanes and their credits, cancellation, and the outcome journaled before it is reported.

use super::*;

impl Daemon {
    pub(super) async fn reject(&self, id: &str, why: RejectReason, message: &str) {
        self.send(daemon_message::Msg::CommandReject(CommandReject { command_id: id.to_owned(), reason: why as i32, message: message.to_owned() })).await;
    }

    pub(super) async fn report(&self, id: &str, o: &Outcome) {
        self.send(daemon_message::Msg::CommandResult(CommandResult {
            command_id: id.to_owned(),
            succeeded: o.succeeded,
            reason: o.reason.clone(),
            result_json: o.result_json.clone(),
        }))
        .await;
    }

    /// A command from the gateway: the journal first (a repeat is answered from it), then the
    /// checks in order, then accept, acknowledge and run.
    pub(super) async fn command(self: Arc<Self>, c: Command) {
        match self.journal.get(&c.command_id) {
            Err(e) => {
                self.logs.line(format!("journal read failed for {}: {e}", c.command_id));
                return;
            }
            Ok(Some(entry)) => match entry.outcome {
                Some(o) => return self.report(&c.command_id, &o).await,
                None if entry.run_id == self.run_id => {
                    if self.state.lock().expect("state").running.contains_key(&c.command_id) {
                        self.send(daemon_message::Msg::CommandAck(CommandAck { command_id: c.command_id.clone() })).await;
                    }
                    return;
                }
                None if !entry.retry_safe && !self.reruns_journaled_commands() => {
                    let o = Outcome {
                        succeeded: false,
                        reason: "interrupted: the daemon restarted while it ran; it is not retry-safe, so it is not run again".into(),
                        result_json: "null".into(),
                    };
                    if self.journal.finish(&c.command_id, o.clone()).is_ok() {
                        self.logs.line(format!("command {} ({}) was interrupted by a restart; not running it again", c.command_id, c.kind));
                        self.report(&c.command_id, &o).await;
                    }
                    return;
                }
                None => {} // retry-safe: run it again
            },
            Ok(None) => {}
        }
        let payload = c.body.as_ref().and_then(|b| b.payload.clone());
        let node_id = self.node_id();
        let command_keys = self.identity.lock().expect("identity").command_keys.clone();
        let decision = {
            let mut st = self.state.lock().expect("state");
            let credits = st.applied.as_ref().map(|a| a.lanes.clone()).unwrap_or_else(|| Applied::initial().lanes).get(&c.lane).copied().unwrap_or(1);
            let applied_generation = st.applied_generation;
            let used = st.in_lane.entry(c.lane.clone()).or_default();
            let d = check(&c, &node_id, &self.kinds_run(), payload.as_ref(), applied_generation, *used < credits, &command_keys);
            if d == Check::Admit {
                // The credit is taken in the same lock as the check, so two commands cannot both
                // see the last one free.
                *used += 1;
            }
            d
        };
        match decision {
            Check::Unsupported => {
                return self.reject(&c.command_id, RejectReason::Unsupported, "another node's command, or a kind this daemon does not run").await;
            }
            Check::WaitForSpec => {
                let deadline = Instant::now() + Duration::from_millis(c.expires_in_ms as u64);
                self.state.lock().expect("state").waiting.push(Waiting { cmd: c, deadline });
                return;
            }
            Check::StaleGeneration => return self.reject(&c.command_id, RejectReason::StaleGeneration, "its minGeneration is not applied").await,
            Check::Expired => return self.reject(&c.command_id, RejectReason::Expired, "past notAfter").await,
            Check::Busy => return self.reject(&c.command_id, RejectReason::Busy, "no credits left in the lane").await,
            Check::BadSignature => {
                self.logs.line(format!("refused command {} ({}): not signed by the key pinned at join", c.command_id, c.kind));
                let why = if command_keys.is_empty() {
                    "a destructive command, and this daemon holds no command-signing key (it learns one only by joining again)"
                } else {
                    "a destructive command without a valid signature by the control plane's command-signing key"
                };
                return self.reject(&c.command_id, RejectReason::BadSignature, why).await;
            }
            Check::Admit => {}
        }
        if let Err(e) = self.journal.accept(&c.command_id, &c.kind, c.seq, c.retry_safe, &self.run_id) {
            self.logs.line(format!("cannot journal {}: {e}; not running it", c.command_id));
            self.release_lane(&c.lane);
            return;
        }
        self.logs.line(format!("running command {} ({})", c.command_id, c.kind));
        let me = self.clone();
        let id = c.command_id.clone();
        let lane = c.lane.clone();
        // A retry-safe command can be stopped at any point; a reboot until its grace is over (the
        // one point of no return a command kind has).
        let cancellable = Arc::new(AtomicBool::new(c.retry_safe || matches!(payload, Some(Payload::NodeReboot(_)))));
        let payload = payload.expect("checked above");
        {
            // Registered before the task can finish and remove itself.
            let mut st = self.state.lock().expect("state");
            let can_cancel = cancellable.clone();
            // The run's span joins the trace of whoever enqueued it (the command's traceparent).
            let span = tracing::info_span!("command", otel.name = %format!("command {}", c.kind), otel.kind = "consumer", command_id = %id, kind = %c.kind);
            better_compute_trace::follow(&span, Some(&c.trace_parent));
            let task = tokio::spawn(
                async move {
                    let outcome = me.execute(payload, &can_cancel).await;
                    me.finish(&id, &lane, outcome).await;
                }
                .instrument(span),
            );
            st.running.insert(c.command_id.clone(), (c.lane.clone(), task.abort_handle(), cancellable));
        }
        self.send(daemon_message::Msg::CommandAck(CommandAck { command_id: c.command_id })).await;
    }

    pub(super) fn release_lane(&self, lane: &str) {
        let mut st = self.state.lock().expect("state");
        if let Some(n) = st.in_lane.get_mut(lane) {
            *n = n.saturating_sub(1);
        }
    }

    pub(super) async fn finish(&self, id: &str, lane: &str, outcome: Option<Outcome>) {
        // Once: a cancel and the command's own end may both get here.
        if self.state.lock().expect("state").running.remove(id).is_none() {
            return;
        }
        self.release_lane(lane);
        // None: the node is going down (a reboot); the reconnect with a new boot id settles it.
        let Some(o) = outcome else { return };
        if let Err(e) = self.journal.finish(id, o.clone()) {
            self.logs.line(format!("cannot journal the outcome of {id}: {e}"));
        }
        self.logs.line(format!("command {id} {}", if o.succeeded { "succeeded".to_owned() } else { format!("failed: {}", o.reason) }));
        self.report(id, &o).await;
    }

    pub(super) async fn cancel(&self, id: &str) {
        let task = self.state.lock().expect("state").running.get(id).cloned();
        let Some((lane, handle, cancellable)) = task else { return };
        if cancellable.compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            return; // a reboot under way cannot be taken back
        }
        handle.abort();
        self.finish(id, &lane, Some(Outcome { succeeded: false, reason: "cancelled".into(), result_json: "null".into() })).await;
    }
}

/// What the checks decide of a command, in the spec's order: UNSUPPORTED, then STALE_GENERATION
/// (waiting for the spec while `notAfter` allows), then EXPIRED, then BUSY, then BAD_SIGNATURE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Check {
    /// Another node's command, an unknown kind, or a body that is not the kind's.
    Unsupported,
    /// Its `minGeneration` is not applied yet, and it has time left: wait for the spec.
    WaitForSpec,
    /// Its `minGeneration` is not applied, and its time is up.
    StaleGeneration,
    /// Past `notAfter`.
    Expired,
    /// No credit left in its lane.
    Busy,
    /// A destructive kind not signed by the key pinned at join.
    BadSignature,
    /// Run it.
    Admit,
}

/// The kinds the daemon runs only with the control plane's signature: its own list, never the
/// command's word.
pub(crate) const DESTRUCTIVE: &[&str] = &["node.reboot"];

/// Whether `c` carries a valid signature by one of `command_keys` over its node, seq, kind, body,
/// notAfter and minGeneration.
fn signed(c: &Command, command_keys: &[Vec<u8>]) -> bool {
    let body = c.body.as_ref().map(prost::Message::encode_to_vec).unwrap_or_default();
    let message = better_compute_proto::command_signing_message(&c.node_id, c.seq, &c.kind, &body, c.not_after_unix_ms, c.min_generation);
    command_keys.iter().any(|k| ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, k).verify(&message, &c.signature).is_ok())
}

/// The checks every command meets before it runs, as a pure function of what the daemon knows
/// (`command_keys`: the keys it pinned).
pub(crate) fn check(
    c: &Command,
    node_id: &str,
    runs: &[&str],
    payload: Option<&Payload>,
    applied_generation: i64,
    lane_has_credit: bool,
    command_keys: &[Vec<u8>],
) -> Check {
    let supported = c.node_id == node_id && runs.contains(&c.kind.as_str()) && payload.is_some_and(|p| kind_of(p) == c.kind);
    if !supported {
        Check::Unsupported
    } else if c.min_generation > applied_generation {
        if c.expires_in_ms <= 0 { Check::StaleGeneration } else { Check::WaitForSpec }
    } else if c.expires_in_ms <= 0 {
        Check::Expired
    } else if !lane_has_credit {
        Check::Busy
    } else if DESTRUCTIVE.contains(&c.kind.as_str()) && !signed(c, command_keys) {
        Check::BadSignature
    } else {
        Check::Admit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checks_run_in_the_specs_order_alone_and_combined() {
        let diag = Payload::DiagNvml(Default::default());
        let cmd = |node: &str, kind: &str, min_generation: i64, expires_in_ms: i64| Command {
            node_id: node.into(),
            kind: kind.into(),
            min_generation,
            expires_in_ms,
            ..Default::default()
        };
        // (command, its payload, applied generation, a credit free) → decision.
        let cases: Vec<(Command, Option<&Payload>, bool, Check)> = vec![
            (cmd("n1", "diag.nvml", 0, 1000), Some(&diag), true, Check::Admit),
            // Each alone.
            (cmd("n2", "diag.nvml", 0, 1000), Some(&diag), true, Check::Unsupported),
            (cmd("n1", "gpu.burn", 0, 1000), Some(&diag), true, Check::Unsupported),
            (cmd("n1", "node.reboot", 0, 1000), Some(&diag), true, Check::Unsupported),
            (cmd("n1", "diag.nvml", 0, 1000), None, true, Check::Unsupported),
            (cmd("n1", "diag.nvml", 9, 1000), Some(&diag), true, Check::WaitForSpec),
            (cmd("n1", "diag.nvml", 9, 0), Some(&diag), true, Check::StaleGeneration),
            (cmd("n1", "diag.nvml", 0, 0), Some(&diag), true, Check::Expired),
            (cmd("n1", "diag.nvml", 0, -5), Some(&diag), true, Check::Expired),
            (cmd("n1", "diag.nvml", 0, 1000), Some(&diag), false, Check::Busy),
            // Combined: the earlier check wins.
            (cmd("n2", "diag.nvml", 9, 0), Some(&diag), false, Check::Unsupported),
            (cmd("n1", "diag.nvml", 9, 0), Some(&diag), false, Check::StaleGeneration),
            (cmd("n1", "diag.nvml", 9, 1000), Some(&diag), false, Check::WaitForSpec),
            (cmd("n1", "diag.nvml", 0, 0), Some(&diag), false, Check::Expired),
            (cmd("n1", "diag.nvml", 5, 1000), Some(&diag), false, Check::Busy),
        ];
        let mut decided = 0;
        for (c, payload, free, want) in &cases {
            assert_eq!(check(c, "n1", KINDS, *payload, 5, *free, &[]), *want, "{c:?} free={free}");
            decided += 1;
        }
        assert_eq!(decided, 15);
        // A daemon that cannot reboot refuses node.reboot as unsupported, before any other check.
        let reboot = Payload::NodeReboot(Default::default());
        let cannot_reboot: Vec<&str> = KINDS.iter().copied().filter(|k| *k != "node.reboot").collect();
        for (c, free) in [(cmd("n1", "node.reboot", 0, 1000), true), (cmd("n1", "node.reboot", 9, 0), false)] {
            assert_eq!(check(&c, "n1", &cannot_reboot, Some(&reboot), 5, free, &[]), Check::Unsupported, "{c:?}");
            assert_ne!(check(&c, "n1", KINDS, Some(&reboot), 5, free, &[]), Check::Unsupported, "{c:?}");
        }
    }

    /// A reboot of node n1, seq 7, signed by `key` (or not).
    fn reboot(key: Option<&ring::signature::Ed25519KeyPair>, node: &str, seq: i64) -> Command {
        let body = better_compute_proto::v1::CommandBody { payload: Some(Payload::NodeReboot(better_compute_proto::v1::NodeReboot { reason: "kernel".into(), grace_seconds: 5 })) };
        let mut c = Command { node_id: node.into(), seq, kind: "node.reboot".into(), body: Some(body), min_generation: 2, expires_in_ms: 1000, not_after_unix_ms: 1_900_000_000_000, ..Default::default() };
        if let Some(k) = key {
            let m = better_compute_proto::command_signing_message(&c.node_id, c.seq, &c.kind, &prost::Message::encode_to_vec(c.body.as_ref().unwrap()), c.not_after_unix_ms, c.min_generation);
            c.signature = k.sign(&m).as_ref().to_vec();
        }
        c
    }

    fn key() -> ring::signature::Ed25519KeyPair {
        let pkcs8 = ring::signature::Ed25519KeyPair::generate_pkcs8(&ring::rand::SystemRandom::new()).unwrap();
        ring::signature::Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap()
    }

    #[test]
    fn a_destructive_command_runs_only_signed_by_the_pinned_key_and_bad_signature_comes_last() {
        use ring::signature::KeyPair;
        let (ours, forger) = (key(), key());
        let pinned = vec![ours.public_key().as_ref().to_vec()];
        let payload = |c: &Command| c.body.as_ref().and_then(|b| b.payload.clone());
        let decide = |c: &Command, node: &str, generation: i64, free: bool, pinned: &[Vec<u8>]| check(c, node, KINDS, payload(c).as_ref(), generation, free, pinned);

        let good = reboot(Some(&ours), "n1", 7);
        assert_eq!(decide(&good, "n1", 5, true, &pinned), Check::Admit);
        // During a rotation either pinned key does.
        assert_eq!(decide(&reboot(Some(&forger), "n1", 7), "n1", 5, true, &[pinned[0].clone(), forger.public_key().as_ref().to_vec()]), Check::Admit);
        // Each alone.
        assert_eq!(decide(&reboot(None, "n1", 7), "n1", 5, true, &pinned), Check::BadSignature, "unsigned");
        assert_eq!(decide(&reboot(Some(&forger), "n1", 7), "n1", 5, true, &pinned), Check::BadSignature, "forged");
        assert_eq!(decide(&good, "n1", 5, true, &[]), Check::BadSignature, "no key pinned (a wiped key store)");
        let mut replayed = good.clone();
        replayed.seq = 8;
        assert_eq!(decide(&replayed, "n1", 5, true, &pinned), Check::BadSignature, "another seq");
        let mut elsewhere = good.clone();
        elsewhere.node_id = "n2".into();
        assert_eq!(decide(&elsewhere, "n2", 5, true, &pinned), Check::BadSignature, "replayed to another node");
        let mut later = good.clone();
        later.not_after_unix_ms += 1;
        assert_eq!(decide(&later, "n1", 5, true, &pinned), Check::BadSignature, "notAfter moved");
        let mut earlier_generation = good.clone();
        earlier_generation.min_generation = 0;
        assert_eq!(decide(&earlier_generation, "n1", 5, true, &pinned), Check::BadSignature, "minGeneration moved");
        let mut other_body = good.clone();
        other_body.body = Some(better_compute_proto::v1::CommandBody { payload: Some(Payload::NodeReboot(better_compute_proto::v1::NodeReboot { reason: "x".into(), grace_seconds: 0 })) });
        assert_eq!(decide(&other_body, "n1", 5, true, &pinned), Check::BadSignature, "another payload");
        // Combined: every other check comes first.
        let unsigned = reboot(None, "n1", 7);
        assert_eq!(decide(&unsigned, "n2", 5, true, &pinned), Check::Unsupported);
        assert_eq!(decide(&unsigned, "n1", 1, true, &pinned), Check::WaitForSpec);
        let mut expired = unsigned.clone();
        expired.expires_in_ms = 0;
        assert_eq!(decide(&expired, "n1", 1, true, &pinned), Check::StaleGeneration);
        assert_eq!(decide(&expired, "n1", 5, true, &pinned), Check::Expired);
        assert_eq!(decide(&unsigned, "n1", 5, false, &pinned), Check::Busy);
        // A kind that is not destructive needs no signature.
        let diag = Command { node_id: "n1".into(), kind: "diag.nvml".into(), body: Some(better_compute_proto::v1::CommandBody { payload: Some(Payload::DiagNvml(Default::default())) }), expires_in_ms: 1000, ..Default::default() };
        assert_eq!(decide(&diag, "n1", 5, true, &[]), Check::Admit);
    }
}
