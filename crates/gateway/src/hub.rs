//! The sessions this gateway holds, in memory: per node, the session epoch, a bounded queue of
//! messages to the daemon, when it was last heard from, and the generation last sent to it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use better_compute_proto::v1::GatewayMessage;
use tokio::sync::{mpsc, watch};

/// What goes down one session's stream.
pub type Outbound = mpsc::Sender<Result<GatewayMessage, tonic::Status>>;

/// One session held here.
pub struct Session {
    /// Its epoch (from the database).
    pub epoch: i64,
    /// The bounded queue to the daemon: a slow daemon fills its own queue and stalls nobody else.
    pub out: Outbound,
    last_seen_ms: AtomicU64,
    flushed_ms: AtomicU64,
    sent_generation: AtomicI64,
    /// Turns true when the hub lets the session go; its reader then ends the stream.
    ended: watch::Sender<bool>,
}

impl Session {
    /// A session whose daemon has applied `observed_generation`.
    pub fn new(epoch: i64, out: Outbound, observed_generation: i64, now_ms: u64) -> Session {
        Session {
            epoch,
            out,
            last_seen_ms: AtomicU64::new(now_ms),
            flushed_ms: AtomicU64::new(0),
            sent_generation: AtomicI64::new(observed_generation),
            ended: watch::Sender::new(false),
        }
    }

    /// Ends the session: says why on its stream (when the queue has room) and wakes its reader,
    /// which lets go of the queue so the stream ends and the daemon reconnects. Dropping the
    /// session from the hub alone would not end the stream: its reader still holds the queue.
    pub fn end(&self, why: &str) {
        if !self.ended.send_replace(true) {
            let _ = self.out.try_send(Err(tonic::Status::aborted(format!("ABORTED: {why}; reconnect"))));
        }
    }

    /// Watches for the session's end (see [`Session::end`]): `wait_for(|e| *e)` resolves once it
    /// ended, also if it already had.
    pub fn ended(&self) -> watch::Receiver<bool> {
        self.ended.subscribe()
    }

    /// The daemon said something.
    pub fn touch(&self, now_ms: u64) {
        self.last_seen_ms.fetch_max(now_ms, Ordering::Relaxed);
    }

    /// The generation last sent (or reported applied).
    pub fn sent_generation(&self) -> i64 {
        self.sent_generation.load(Ordering::Relaxed)
    }

    /// Forgets that `generation` was sent (its send failed), so the next poll sends it again.
    pub fn reset_generation(&self, to: i64) {
        self.sent_generation.store(to, Ordering::Relaxed);
    }

    /// Claims sending `generation`: true when it is newer than anything sent so far.
    pub fn claim_generation(&self, generation: i64) -> bool {
        self.sent_generation.fetch_max(generation, Ordering::AcqRel) < generation
    }
}

/// The sessions, by node id.
pub struct Hub {
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    started: Instant,
}

impl Default for Hub {
    fn default() -> Hub {
        Hub { sessions: Mutex::default(), started: Instant::now() }
    }
}

impl Hub {
    /// An empty hub.
    pub fn new() -> Hub {
        Hub::default()
    }

    /// Milliseconds since the hub started: the clock of `last seen`.
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Holds `session` for `node_id`, replacing (and so ending) an older one of the same node.
    pub fn insert(&self, node_id: &str, session: Arc<Session>) {
        let old = {
            let mut s = self.sessions.lock().expect("hub");
            let old = s.insert(node_id.to_owned(), session);
            metrics::gauge!("better_compute_gateway_sessions").set(s.len() as f64);
            old
        };
        if let Some(old) = old {
            old.end("a newer session of this node replaced this one");
        }
    }

    /// The node's session, if held here.
    pub fn get(&self, node_id: &str) -> Option<Arc<Session>> {
        self.sessions.lock().expect("hub").get(node_id).cloned()
    }

    /// Lets the node's session go, and ends it (see [`Session::end`]), if it is still the one
    /// with `epoch`.
    pub fn remove(&self, node_id: &str, epoch: i64, why: &str) -> bool {
        let removed = {
            let mut s = self.sessions.lock().expect("hub");
            let removed = if s.get(node_id).is_some_and(|x| x.epoch == epoch) { s.remove(node_id) } else { None };
            metrics::gauge!("better_compute_gateway_sessions").set(s.len() as f64);
            removed
        };
        match removed {
            Some(x) => {
                x.end(why);
                true
            }
            None => false,
        }
    }

    /// Lets every session go and ends them (the gateway lost its lease, or is stopping).
    pub fn clear(&self, why: &str) -> usize {
        let all: Vec<Arc<Session>> = self.sessions.lock().expect("hub").drain().map(|(_, x)| x).collect();
        metrics::gauge!("better_compute_gateway_sessions").set(0.0);
        for x in &all {
            x.end(why);
        }
        all.len()
    }

    /// Every session held, as (node, epoch), by node id.
    pub fn held(&self) -> Vec<(String, i64)> {
        let mut all: Vec<(String, i64)> = self.sessions.lock().expect("hub").iter().map(|(n, s)| (n.clone(), s.epoch)).collect();
        all.sort();
        all
    }

    /// How many sessions are held.
    pub fn len(&self) -> usize {
        self.sessions.lock().expect("hub").len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Marks the node's session as not flushed, so the next flush writes it again (its row was
    /// busy this time).
    pub fn unflush(&self, node_id: &str) {
        if let Some(x) = self.sessions.lock().expect("hub").get(node_id) {
            x.flushed_ms.store(0, Ordering::Relaxed);
        }
    }

    /// The sessions heard from since their last flush, as (node, epoch, age in seconds), marking
    /// them flushed: one batch for one statement. The batch is the `max` whose stored `last seen`
    /// is oldest, so when the fleet's heartbeats come faster than one pass can flush them, the
    /// sessions recently flushed wait and none is starved until the liveness job finds it silent.
    pub fn take_unflushed(&self, max: usize) -> (Vec<String>, Vec<i64>, Vec<f64>) {
        let now = self.now_ms();
        let s = self.sessions.lock().expect("hub");
        let mut due: Vec<(u64, &String, &Arc<Session>)> = s
            .iter()
            .filter_map(|(node, x)| {
                let flushed = x.flushed_ms.load(Ordering::Relaxed);
                (x.last_seen_ms.load(Ordering::Relaxed) > flushed).then_some((flushed, node, x))
            })
            .collect();
        if due.len() > max {
            due.select_nth_unstable_by_key(max, |(flushed, _, _)| *flushed);
            due.truncate(max);
        }
        let (mut nodes, mut epochs, mut ages) = (Vec::with_capacity(due.len()), Vec::with_capacity(due.len()), Vec::with_capacity(due.len()));
        for (_, node, x) in due {
            let seen = x.last_seen_ms.load(Ordering::Relaxed);
            x.flushed_ms.store(seen, Ordering::Relaxed);
            nodes.push(node.clone());
            epochs.push(x.epoch);
            ages.push(now.saturating_sub(seen) as f64 / 1000.0);
        }
        (nodes, epochs, ages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn when_heartbeats_outpace_the_flush_the_session_flushed_longest_ago_goes_first() {
        let hub = Hub::new();
        let (out, _rx) = mpsc::channel(1);
        for n in ["a", "b", "c", "d"] {
            hub.insert(n, Arc::new(Session::new(1, out.clone(), 0, 1)));
        }
        // Every session keeps talking; batches of two, each followed by more heartbeats, reach
        // every session in turn instead of the same two again and again.
        let mut flushed = Vec::new();
        for round in 0..4u64 {
            let (nodes, epochs, _) = hub.take_unflushed(2);
            assert_eq!((nodes.len(), epochs), (2, vec![1, 1]));
            flushed.extend(nodes);
            for n in ["a", "b", "c", "d"] {
                hub.get(n).unwrap().touch(10 + round);
            }
        }
        flushed.sort();
        assert_eq!(flushed, ["a", "a", "b", "b", "c", "c", "d", "d"]);
        // A session whose row was busy is first in the next batch.
        let (first, _, _) = hub.take_unflushed(4);
        assert_eq!(first.len(), 4);
        hub.get("c").unwrap().touch(100);
        hub.unflush("b");
        let (next, _, _) = hub.take_unflushed(1);
        assert_eq!(next, ["b"]);
    }
}
