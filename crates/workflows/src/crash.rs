//! Test hooks (feature `testing`): make the next run fail at a named point, as a crash there
//! would, so tests show that a crash between any two statements repeats at most the read and the
//! enqueue. Without the feature, a run passes its points without a look.

use better_compute_runtime::RunError;

#[cfg(feature = "testing")]
static ARMED: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());

/// The points a run passes, in order: after it locked the workflow, after the step acted, after
/// the step's row was written, after its events, just before commit.
pub const POINTS: &[&str] = &["locked", "advanced", "step-written", "events-emitted", "before-commit"];

/// The next run that passes `point` fails there (once).
#[cfg(feature = "testing")]
pub fn arm(point: &'static str) {
    ARMED.lock().expect("crash points").push(point);
}

/// Disarms `point` once.
#[cfg(feature = "testing")]
pub fn arm_clear(point: &'static str) {
    hit(point);
}

/// Whether `point` is still armed (no run passed it yet).
#[cfg(feature = "testing")]
pub fn armed(point: &'static str) -> bool {
    ARMED.lock().expect("crash points").contains(&point)
}

#[cfg(feature = "testing")]
fn hit(point: &'static str) -> bool {
    let mut armed = ARMED.lock().expect("crash points");
    match armed.iter().position(|p| *p == point) {
        Some(i) => {
            armed.remove(i);
            true
        }
        None => false,
    }
}

/// A run passes `point`: with the feature, an armed point fails the run here.
pub(crate) fn crash_point(_point: &'static str) -> Result<(), RunError> {
    debug_assert!(POINTS.contains(&_point), "{_point} is not a crash point");
    #[cfg(feature = "testing")]
    if hit(_point) {
        return Err(format!("test crash at {_point}").into());
    }
    Ok(())
}
