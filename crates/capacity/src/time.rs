//! Timestamps at the API edge: RFC 3339 only. PostgreSQL parses them, but it would also accept
//! words like `now` that read the real clock behind `compute_now()`'s back, so the shape is checked
//! here first.

use better_compute_core::Error;

/// Checks `YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)`.
pub fn check_rfc3339(field: &str, s: &str) -> Result<(), Error> {
    let b = s.as_bytes();
    let digits = |r: std::ops::Range<usize>| b.get(r.clone()).is_some_and(|x| x.iter().all(u8::is_ascii_digit));
    let mut ok = b.len() >= 20
        && digits(0..4)
        && b[4] == b'-'
        && digits(5..7)
        && b[7] == b'-'
        && digits(8..10)
        && matches!(b[10], b'T' | b't')
        && digits(11..13)
        && b[13] == b':'
        && digits(14..16)
        && b[16] == b':'
        && digits(17..19);
    if ok {
        let mut i = 19;
        if b.get(i) == Some(&b'.') {
            i += 1;
            let start = i;
            while b.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
            ok = i > start && i - start <= 9;
        }
        ok = ok
            && match b.get(i) {
                Some(b'Z' | b'z') => i + 1 == b.len(),
                Some(b'+' | b'-') => i + 6 == b.len() && digits(i + 1..i + 3) && b[i + 3] == b':' && digits(i + 4..i + 6),
                _ => false,
            };
    }
    if ok {
        Ok(())
    } else {
        Err(Error::invalid_argument(format!("{field} must be an RFC 3339 timestamp like 2030-01-01T12:00:00Z, got {s:?}")))
    }
}

pub use better_compute_db::clock::rfc3339_sql;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_rfc3339_passes() {
        for good in ["2030-01-01T00:00:00Z", "2030-01-01T00:00:00.5+02:00", "2030-01-01t00:00:00.123456789z"] {
            assert!(check_rfc3339("t", good).is_ok(), "{good}");
        }
        for bad in ["now", "today", "2030-01-01", "2030-01-01 00:00:00Z", "2030-01-01T00:00:00", "2030-01-01T00:00:00.Z", "infinity", "2030-01-01T00:00:00+0200"] {
            assert!(check_rfc3339("t", bad).is_err(), "{bad}");
        }
    }
}
