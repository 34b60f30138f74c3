//! The daemon's recent log lines, kept in memory (bounded) for `logs.collect`.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use better_compute_proto::v1::LogsCollect;

/// Bytes of log lines kept.
pub const KEEP_BYTES: usize = 1 << 20;

/// What a line costs in a `logs.collect` result: its JSON string (escapes included) and a comma.
/// The server bounds `maxBytes` so that this many bytes of lines come back through the gateway.
pub fn result_bytes(line: &str) -> usize {
    serde_json::to_string(line).map_or(line.len() * 6 + 2, |s| s.len()) + 1
}

/// A bounded ring of recent log lines.
#[derive(Default)]
pub struct LogRing {
    inner: Mutex<(VecDeque<(SystemTime, String)>, usize)>,
}

impl LogRing {
    /// Appends a line (and logs it through tracing).
    pub fn line(&self, msg: impl Into<String>) {
        let msg = msg.into();
        tracing::debug!(target: "better_compute_daemon", "{msg}");
        let mut g = self.inner.lock().expect("logs");
        g.1 += msg.len();
        g.0.push_back((SystemTime::now(), msg));
        while g.1 > KEEP_BYTES {
            match g.0.pop_front() {
                Some((_, old)) => g.1 -= old.len(),
                None => break,
            }
        }
    }

    /// The lines of the last `since`, newest kept when over `max_bytes`, each prefixed with its
    /// time (Unix seconds); and whether some were left out.
    pub fn recent(&self, since: Duration, max_bytes: usize) -> (Vec<String>, bool) {
        let cutoff = SystemTime::now().checked_sub(since).unwrap_or(SystemTime::UNIX_EPOCH);
        let g = self.inner.lock().expect("logs");
        let mut out = Vec::new();
        let mut bytes = 0;
        let mut truncated = false;
        for (t, line) in g.0.iter().rev() {
            if *t < cutoff {
                break;
            }
            let stamped = format!("{} {line}", t.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0));
            let cost = result_bytes(&stamped);
            if bytes + cost > max_bytes {
                truncated = true;
                break;
            }
            bytes += cost;
            out.push(stamped);
        }
        out.reverse();
        (out, truncated)
    }
}

/// `logs.collect`: the daemon's own lines from memory; other units from journald where there is one.
pub async fn collect(ring: &LogRing, req: &LogsCollect) -> serde_json::Value {
    let since = Duration::from_secs(req.since_seconds.max(1) as u64);
    let mut left = req.max_bytes.max(1) as usize;
    let mut units = Vec::new();
    let mut truncated = false;
    for unit in &req.units {
        if unit == "better-compute-daemon" {
            let (lines, cut) = ring.recent(since, left);
            left = left.saturating_sub(lines.iter().map(|l| result_bytes(l)).sum());
            truncated |= cut;
            units.push(serde_json::json!({"unit": unit, "lines": lines}));
            continue;
        }
        let out = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::process::Command::new("journalctl")
                .args(["-u", unit, "--since", &format!("-{}s", since.as_secs()), "--no-pager", "-o", "short-iso"])
                .output(),
        )
        .await;
        match out {
            Ok(Ok(o)) if o.status.success() => {
                let text = String::from_utf8_lossy(&o.stdout);
                let mut lines: Vec<&str> = text.lines().collect();
                let mut bytes: usize = lines.iter().map(|l| result_bytes(l)).sum();
                while bytes > left && !lines.is_empty() {
                    bytes -= result_bytes(lines.remove(0));
                    truncated = true;
                }
                left -= bytes;
                units.push(serde_json::json!({"unit": unit, "lines": lines}));
            }
            _ => units.push(serde_json::json!({"unit": unit, "error": "journald is not available for this unit on this node"})),
        }
    }
    serde_json::json!({"units": units, "truncated": truncated})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_lines_are_bounded_by_bytes_keeping_the_newest() {
        let r = LogRing::default();
        for i in 0..100 {
            r.line(format!("line {i:03}"));
        }
        let (all, cut) = r.recent(Duration::from_secs(60), 1 << 20);
        assert_eq!((all.len(), cut), (100, false));
        let (some, cut) = r.recent(Duration::from_secs(60), 200);
        assert!(cut && !some.is_empty() && some.len() < 100);
        assert!(some.last().unwrap().ends_with("line 099"));
        assert!(some.iter().map(|l| result_bytes(l)).sum::<usize>() <= 200);
    }

    #[test]
    fn lines_are_counted_as_the_result_carries_them_escaped() {
        let r = LogRing::default();
        for _ in 0..100 {
            r.line("\u{1}".repeat(50));
        }
        let (some, cut) = r.recent(Duration::from_secs(60), 4096);
        let json = serde_json::to_string(&some).unwrap();
        assert!(cut && !some.is_empty());
        assert!(json.len() <= 4096 + 2, "{} bytes of JSON for 4096 asked", json.len());
    }
}
