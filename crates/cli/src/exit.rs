//! Exit statuses: what a script can tell from how a command failed, without parsing its message.
//!
//! | status | meaning |
//! |---|---|
//! | 0 | done |
//! | 1 | failed otherwise (the message says why) |
//! | 2 | usage: a bad flag or argument, or a request the API found malformed (`INVALID_ARGUMENT`) |
//! | 3 | not found (`NOT_FOUND`) |
//! | 4 | conflict or precondition (`CONFLICT`, `FAILED_PRECONDITION`, `ALREADY_EXISTS`, `QUOTA_EXCEEDED`) |
//! | 5 | `--wait` gave up before the thing finished |
//! | 69 | the server or database cannot be reached (`EX_UNAVAILABLE`, or the API answered `UNAVAILABLE`) |

/// Usage.
pub const USAGE: u8 = 2;
/// Not found.
pub const NOT_FOUND: u8 = 3;
/// Conflict or precondition.
pub const CONFLICT: u8 = 4;
/// A wait timed out.
pub const WAIT_TIMEOUT: u8 = 5;
/// Unreachable.
pub const UNREACHABLE: u8 = 69;

/// A failure with the status it exits with.
#[derive(Debug)]
pub struct Exit {
    /// The status.
    pub status: u8,
    /// What to print.
    pub message: String,
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Exit {}

/// Fails with `status`.
pub fn fail(status: u8, message: impl Into<String>) -> anyhow::Error {
    Exit { status, message: message.into() }.into()
}

/// The status of an API answer's `code`.
pub fn of_api_code(code: &str) -> u8 {
    match code {
        "INVALID_ARGUMENT" => USAGE,
        "NOT_FOUND" => NOT_FOUND,
        "CONFLICT" | "FAILED_PRECONDITION" | "ALREADY_EXISTS" | "QUOTA_EXCEEDED" => CONFLICT,
        "UNAVAILABLE" => UNREACHABLE,
        _ => 1,
    }
}

/// Fails as the API answered: `CODE: message`, with the code's status.
pub fn api(code: &str, message: impl std::fmt::Display) -> anyhow::Error {
    fail(of_api_code(code), format!("{code}: {message}"))
}

/// The status `e` exits with: the first [`Exit`] in its chain, a connection refused or timed out
/// anywhere in it (unreachable), else 1.
pub fn status_of(e: &anyhow::Error) -> u8 {
    if let Some(x) = e.chain().find_map(|c| c.downcast_ref::<Exit>()) {
        return x.status;
    }
    let unreachable = e.chain().any(|c| {
        c.downcast_ref::<reqwest::Error>().is_some_and(|r| r.is_connect() || r.is_timeout())
            || c.downcast_ref::<std::io::Error>().is_some_and(|io| {
                matches!(io.kind(), std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::TimedOut | std::io::ErrorKind::NotFound)
                    && io.raw_os_error().is_some()
            })
    });
    if unreachable { UNREACHABLE } else { 1 }
}
