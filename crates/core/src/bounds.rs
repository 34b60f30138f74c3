//! The bounds of what is stored: every string a client can write has a maximum length, and every
//! amount a maximum chosen so that no sum of them can overflow PostgreSQL's `bigint`. The API
//! reference (docs/api-and-iam.md, "Bounds") lists them; a value past one is `INVALID_ARGUMENT`
//! and changes nothing.

use std::borrow::Cow;

use crate::Error;

/// A key: a taint's, a toleration's, a node selector's.
pub const KEY_CHARS: usize = 253;
/// A short value: a taint's or toleration's value, a node selector's value, a GPU model.
pub const VALUE_CHARS: usize = 63;
/// A note people write: a quarantine reason, a webhook's description.
pub const NOTE_CHARS: usize = 500;
/// Entries of a reservation's node selector, and its tolerations.
pub const SELECTOR_ENTRIES: usize = 32;
/// A command's payload, as JSON.
pub const COMMAND_PAYLOAD_BYTES: usize = 16 * 1024;
/// vCPU of one reservation.
pub const MAX_VCPU: i32 = 1 << 20;
/// Memory of one reservation, in MiB (1 EiB).
pub const MAX_MEMORY_MIB: i64 = 1 << 40;
/// Disk of one reservation, in GiB (1 ZiB).
pub const MAX_DISK_GIB: i64 = 1 << 40;
/// A quota's limit. A quota's use never passes its limit, and one reservation adds at most
/// 2^40, so `used + amount` stays far below 2^63 (and exact in a JSON double).
pub const MAX_QUOTA: i64 = 1 << 53;
/// How much of a value a message repeats back.
pub const ECHO_CHARS: usize = 80;

/// `INVALID_ARGUMENT` unless `value` has at most `max` characters and no control character.
pub fn check_text(field: &str, value: &str, max: usize) -> Result<(), Error> {
    if value.chars().count() > max || value.chars().any(char::is_control) {
        return Err(Error::invalid_argument(format!("{field} must be at most {max} characters, none of them control characters")));
    }
    Ok(())
}

/// `INVALID_ARGUMENT` unless `0 <= value <= max`.
pub fn check_amount<T: PartialOrd + Default + std::fmt::Display>(field: &str, value: T, max: T) -> Result<(), Error> {
    if value < T::default() || value > max {
        return Err(Error::invalid_argument(format!("{field} must be between 0 and {max}")));
    }
    Ok(())
}

/// `value` as a message may repeat it: its first [`ECHO_CHARS`] characters, then `…`.
pub fn echo(value: &str) -> Cow<'_, str> {
    match value.char_indices().nth(ECHO_CHARS) {
        None => Cow::Borrowed(value),
        Some((cut, _)) => Cow::Owned(format!("{}…", &value[..cut])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_past_its_bound_or_with_a_control_character_is_refused_and_echoes_are_cut() {
        assert!(check_text("x", &"é".repeat(63), VALUE_CHARS).is_ok());
        assert!(check_text("x", &"é".repeat(64), VALUE_CHARS).is_err());
        assert!(check_text("x", "a\nb", VALUE_CHARS).is_err());
        assert!(check_amount("m", MAX_MEMORY_MIB, MAX_MEMORY_MIB).is_ok());
        assert!(check_amount("m", i64::MAX, MAX_MEMORY_MIB).is_err());
        assert!(check_amount("m", -1, MAX_MEMORY_MIB).is_err());
        assert_eq!(echo("short"), "short");
        let long = "ü".repeat(10_000);
        assert_eq!(echo(&long).chars().count(), ECHO_CHARS + 1);
    }
}
