//! The simulated clock: it follows real time while the run goes, and faults make it jump.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Moves the simulated clock with real time, 200 ms at a time, until `stop`. While the database is
/// away, time waits for it.
pub(crate) async fn tick_clock(conn: String, stop: Arc<AtomicBool>) {
    let mut last = Instant::now();
    let mut client: Option<tokio_postgres::Client> = None;
    while !stop.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = better_compute_db::pool::connect(&conn).await.ok();
        }
        let Some(c) = &client else { continue };
        let now = Instant::now();
        if better_compute_db::clock::advance_sim_clock(c, now - last).await.is_ok() {
            last = now;
        }
    }
}

/// Advances the simulated clock; a failure (the database is restarting) only delays time.
pub(crate) async fn advance_clock(conn: &str, by: Duration) {
    if let Ok(c) = better_compute_db::pool::connect(conn).await {
        let _ = better_compute_db::clock::advance_sim_clock(&c, by).await;
    }
}
