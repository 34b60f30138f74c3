//! The daemon's recent log lines, kept in memory (bounded) for `logs.collect`.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

/// Bytes of log lines kept.
pub const KEEP_BYTES: usize = 1 << 20;

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
            if bytes + stamped.len() > max_bytes {
                truncated = true;
                break;
            }
            bytes += stamped.len();
            out.push(stamped);
        }
        out.reverse();
        (out, truncated)
    }
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
        assert!(some.iter().map(String::len).sum::<usize>() <= 200);
    }
}
