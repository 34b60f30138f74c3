//! One clock: every SQL time comparison reads `compute_now()`, and business time in Rust comes from a
//! [`Clock`] anchored to it.
//!
//! Tests and the simulator swap the body of `compute_now()` to read `compute_sim_clock`, so leases,
//! deadlines and liveness expire in simulated time, deterministically.

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use better_compute_core::lease::CLOCK_SKEW_LIMIT_MS;
use tokio_postgres::GenericClient;

use crate::DbError;

/// Where simulated time starts in a fresh test database: 2030-01-01T00:00:00Z.
pub const SIM_EPOCH_UNIX_S: u64 = 1_893_456_000;

/// `SIM_EPOCH_UNIX_S` as a time.
pub fn sim_epoch() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(SIM_EPOCH_UNIX_S)
}

/// Points `compute_now()` at `compute_sim_clock`, starting at `at`.
pub async fn use_sim_clock(db: &impl GenericClient, at: SystemTime) -> Result<(), DbError> {
    db.execute(
        "INSERT INTO compute_sim_clock (id, ts) VALUES (1, $1) ON CONFLICT (id) DO UPDATE SET ts = EXCLUDED.ts",
        &[&at],
    )
    .await?;
    db.batch_execute(
        "CREATE OR REPLACE FUNCTION compute_now() RETURNS timestamptz LANGUAGE sql STABLE
           AS $$ SELECT ts FROM compute_sim_clock WHERE id = 1 $$",
    )
    .await?;
    Ok(())
}

/// Points `compute_now()` back at the database's real clock.
pub async fn use_real_clock(db: &impl GenericClient) -> Result<(), DbError> {
    db.batch_execute(
        "CREATE OR REPLACE FUNCTION compute_now() RETURNS timestamptz LANGUAGE sql STABLE
           AS $$ SELECT now() $$", // check-sql-now: allow (the real clock's body)
    )
    .await?;
    Ok(())
}

/// Whether `compute_now()` currently reads the simulated clock.
pub async fn is_sim_clock(db: &impl GenericClient) -> Result<bool, DbError> {
    let row = db
        .query_one("SELECT prosrc LIKE '%compute_sim_clock%' FROM pg_proc WHERE proname = 'compute_now'", &[])
        .await?;
    Ok(row.get(0))
}

/// Sets simulated time.
pub async fn set_sim_clock(db: &impl GenericClient, at: SystemTime) -> Result<(), DbError> {
    db.execute("UPDATE compute_sim_clock SET ts = $1 WHERE id = 1", &[&at]).await?;
    Ok(())
}

/// Moves simulated time forward (or back, with a negative step) and returns the new time.
pub async fn advance_sim_clock(db: &impl GenericClient, by: Duration) -> Result<SystemTime, DbError> {
    let row = db
        .query_one(
            "UPDATE compute_sim_clock SET ts = ts + make_interval(secs => $1) WHERE id = 1 RETURNING ts",
            &[&by.as_secs_f64()],
        )
        .await?;
    Ok(row.get(0))
}

/// `compute_now()`.
pub async fn db_now(db: &impl GenericClient) -> Result<SystemTime, DbError> {
    Ok(db.query_one("SELECT compute_now()", &[]).await?.get(0))
}

#[derive(Debug, Clone, Copy)]
struct Anchor {
    db_time: SystemTime,
    at: Instant,
}

#[derive(Debug)]
struct ClockState {
    anchor: Anchor,
    simulated: bool,
    last_skew_ms: i64,
    samples: u64,
}

/// The outcome of one self-check, as operators see it.
#[derive(Debug, Clone, PartialEq)]
pub struct SelfCheck {
    /// What was checked, e.g. `clock.skew`.
    pub name: &'static str,
    /// Whether it is healthy.
    pub ok: bool,
    /// A one-line explanation.
    pub detail: String,
}

/// Business time for Rust code, anchored to `compute_now()`.
///
/// Sampled at start and at every lease renewal (the renewal returns `compute_now()`, so a sample
/// costs nothing extra). Between samples, real time advances by the monotonic clock from the last
/// anchor; simulated time stands still until the next sample, so tests stay deterministic. When a
/// sample differs from the prediction by more than a second, the clock logs `ClockSkew` and
/// [`Clock::self_check`] reports `clock.skew`.
#[derive(Debug)]
pub struct Clock {
    state: Mutex<ClockState>,
}

impl Clock {
    /// Samples the database once and anchors to it.
    pub async fn start(db: &impl GenericClient) -> Result<Clock, DbError> {
        let simulated = is_sim_clock(db).await?;
        let sent = Instant::now();
        let db_time = db_now(db).await?;
        let received = Instant::now();
        Ok(Clock {
            state: Mutex::new(ClockState {
                anchor: Anchor { db_time, at: midpoint(sent, received) },
                simulated,
                last_skew_ms: 0,
                samples: 1,
            }),
        })
    }

    /// A clock fixed at `at` that never samples; for pure unit tests.
    pub fn fixed(at: SystemTime) -> Clock {
        Clock {
            state: Mutex::new(ClockState {
                anchor: Anchor { db_time: at, at: Instant::now() },
                simulated: true,
                last_skew_ms: 0,
                samples: 0,
            }),
        }
    }

    /// Business time now.
    pub fn now(&self) -> SystemTime {
        let s = self.state.lock().expect("clock lock");
        if s.simulated { s.anchor.db_time } else { s.anchor.db_time + s.anchor.at.elapsed() }
    }

    /// Samples `compute_now()` now.
    pub async fn sample(&self, db: &impl GenericClient) -> Result<SystemTime, DbError> {
        let sent = Instant::now();
        let db_time = db_now(db).await?;
        self.observe(db_time, sent, Instant::now());
        Ok(db_time)
    }

    /// Records a value of `compute_now()` read by a statement sent at `sent` and answered at
    /// `received`, and returns the skew in milliseconds (observed minus predicted).
    pub fn observe(&self, db_time: SystemTime, sent: Instant, received: Instant) -> i64 {
        let at = midpoint(sent, received);
        let mut s = self.state.lock().expect("clock lock");
        let skew_ms = if s.simulated {
            0
        } else {
            let predicted = s.anchor.db_time + at.saturating_duration_since(s.anchor.at);
            signed_ms(db_time, predicted)
        };
        if skew_ms.unsigned_abs() > CLOCK_SKEW_LIMIT_MS {
            tracing::warn!(event = "ClockSkew", skew_ms, "the database clock moved away from this process's clock");
        }
        s.anchor = Anchor { db_time, at };
        s.last_skew_ms = skew_ms;
        s.samples += 1;
        skew_ms
    }

    /// The skew at the last sample, in milliseconds.
    pub fn last_skew_ms(&self) -> i64 {
        self.state.lock().expect("clock lock").last_skew_ms
    }

    /// Operator-facing checks: `clock.skew`.
    pub fn self_check(&self) -> Vec<SelfCheck> {
        let s = self.state.lock().expect("clock lock");
        let ok = s.last_skew_ms.unsigned_abs() <= CLOCK_SKEW_LIMIT_MS;
        let detail = if s.simulated {
            "simulated time (compute_sim_clock)".to_owned()
        } else {
            format!("{} ms at the last of {} samples (limit {CLOCK_SKEW_LIMIT_MS} ms)", s.last_skew_ms, s.samples)
        };
        vec![SelfCheck { name: "clock.skew", ok, detail }]
    }
}

fn midpoint(a: Instant, b: Instant) -> Instant {
    a + b.saturating_duration_since(a) / 2
}

fn signed_ms(a: SystemTime, b: SystemTime) -> i64 {
    match a.duration_since(b) {
        Ok(d) => d.as_millis() as i64,
        Err(e) => -(e.duration().as_millis() as i64),
    }
}

/// SQL that renders a `timestamptz` expression as RFC 3339 in UTC, with microseconds: how every
/// time leaves the database for the API.
pub fn rfc3339_sql(expr: &str) -> String {
    format!("to_char(({expr}) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn real_clock_at(t: SystemTime, at: Instant) -> Clock {
        Clock {
            state: Mutex::new(ClockState { anchor: Anchor { db_time: t, at }, simulated: false, last_skew_ms: 0, samples: 1 }),
        }
    }

    #[test]
    fn a_sample_that_matches_the_prediction_reports_no_skew() {
        let t0 = sim_epoch();
        let i0 = Instant::now();
        let clock = real_clock_at(t0, i0);
        let i1 = i0 + Duration::from_secs(10);
        let skew = clock.observe(t0 + Duration::from_secs(10) + Duration::from_millis(200), i1, i1);
        assert_eq!(skew, 200);
        assert!(clock.self_check()[0].ok);
    }

    #[test]
    fn a_jump_of_more_than_a_second_fails_the_clock_skew_check() {
        let t0 = sim_epoch();
        let i0 = Instant::now();
        let clock = real_clock_at(t0, i0);
        let i1 = i0 + Duration::from_secs(5);
        let skew = clock.observe(t0 + Duration::from_secs(3), i1, i1);
        assert_eq!(skew, -2000);
        let check = &clock.self_check()[0];
        assert_eq!(check.name, "clock.skew");
        assert!(!check.ok, "{check:?}");
        // The next good sample clears it.
        let i2 = i1 + Duration::from_secs(1);
        clock.observe(t0 + Duration::from_secs(4), i2, i2);
        assert!(clock.self_check()[0].ok);
    }

    #[test]
    fn a_fixed_clock_does_not_move_by_itself() {
        let clock = Clock::fixed(sim_epoch());
        assert_eq!(clock.now(), sim_epoch());
    }
}
