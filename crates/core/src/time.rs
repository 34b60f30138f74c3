//! RFC 3339 for `SystemTime`, in UTC, without a calendar crate (Howard Hinnant's civil-date
//! algorithms), for the few places that format a time outside SQL.

use std::time::{Duration, SystemTime};

/// `2030-01-01T12:00:00.000001Z`: seconds and microseconds, as the database renders times.
pub fn rfc3339(t: SystemTime) -> String {
    let since = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let s = since.as_secs() as i64;
    let (days, rem) = (s.div_euclid(86_400), s.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:06}Z", rem / 3600, rem / 60 % 60, rem % 60, since.subsec_micros())
}

/// Parses what [`rfc3339`] writes (UTC, `Z`, optional fraction); `None` for anything else.
pub fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' || b[16] != b':' || !s.ends_with('Z') {
        return None;
    }
    let n = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, m, d) = (n(0..4)?, n(5..7)?, n(8..10)?);
    let secs = n(11..13)? * 3600 + n(14..16)? * 60 + n(17..19)?;
    let micros = match s.get(19..s.len() - 1)? {
        "" => 0,
        f => format!("{:0<6}", f.strip_prefix('.')?).get(..6)?.parse::<u64>().ok()?,
    };
    let y2 = if m <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs((days * 86_400 + secs) as u64) + Duration::from_micros(micros))
}

/// Checks the shape of an RFC 3339 timestamp from the API edge,
/// `YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)`. PostgreSQL would parse more, words like `now` among
/// them, which read the real clock behind `compute_now()`'s back.
pub fn check_rfc3339(field: &str, s: &str) -> Result<(), crate::Error> {
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
    // The values too: a shape PostgreSQL would refuse (a 13th month, a 30th of February, an
    // offset beyond ±15:59) is the caller's mistake, not the server's.
    if ok {
        let n = |r: std::ops::Range<usize>| s[r].parse::<u32>().unwrap_or(u32::MAX);
        let (year, month, day) = (n(0..4), n(5..7), n(8..10));
        let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
        let days = match month {
            1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
            4 | 6 | 9 | 11 => 30,
            2 if leap => 29,
            2 => 28,
            _ => 0,
        };
        ok = year >= 1 && (1..=days).contains(&day) && n(11..13) < 24 && n(14..16) < 60 && n(17..19) <= 60;
        if ok && matches!(b[b.len() - 6], b'+' | b'-') {
            ok = n(b.len() - 5..b.len() - 3) <= 15 && n(b.len() - 2..b.len()) < 60;
        }
    }
    if ok {
        Ok(())
    } else {
        Err(crate::Error::invalid_argument(format!("{field} must be an RFC 3339 timestamp like 2030-01-01T12:00:00Z, got {s:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_round_trip_through_rfc3339() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_micros(1_893_456_000_123_456);
        assert_eq!(rfc3339(t), "2030-01-01T00:00:00.123456Z");
        assert_eq!(parse_rfc3339(&rfc3339(t)), Some(t));
        assert_eq!(parse_rfc3339("2030-01-01T00:00:00Z"), Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_893_456_000)));
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400)), "2000-02-29T00:00:00.000000Z");
        assert!(parse_rfc3339("2030-01-01 00:00:00Z").is_none());
    }

    #[test]
    fn only_rfc3339_passes() {
        for good in ["2030-01-01T00:00:00Z", "2030-01-01T00:00:00.5+02:00", "2030-01-01t00:00:00.123456789z", "2028-02-29T23:59:59-15:59", "2000-02-29T00:00:00Z"] {
            assert!(check_rfc3339("t", good).is_ok(), "{good}");
        }
        for bad in ["now", "today", "2030-01-01", "2030-01-01 00:00:00Z", "2030-01-01T00:00:00", "2030-01-01T00:00:00.Z", "infinity", "2030-01-01T00:00:00+0200",
            "2026-12-30T06:15:45.84075-16:16", "2030-13-01T00:00:00Z", "2030-02-29T00:00:00Z", "1900-02-29T00:00:00Z", "0000-01-01T00:00:00Z", "2030-04-31T00:00:00Z", "2030-01-01T24:00:00Z", "2030-01-01T00:60:00Z", "2030-01-01T00:00:00+02:60"] {
            assert!(check_rfc3339("t", bad).is_err(), "{bad}");
        }
    }
}
