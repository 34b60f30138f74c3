//! The one error type that crosses module boundaries, and its stable codes.

use serde::{Deserialize, Serialize};

/// Stable error codes. They are part of the API: a client may match on them, so they never change
/// meaning. Each maps to one HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    /// The request is malformed or a field is out of range; nothing was changed.
    InvalidArgument,
    /// No valid credentials were presented.
    Unauthenticated,
    /// The caller is known but lacks the permission.
    PermissionDenied,
    /// The resource does not exist, or the caller may not know that it does.
    NotFound,
    /// Someone else changed the record first (stale version), or a key was reused differently.
    Conflict,
    /// The tenant's quota does not allow the request; final for that request.
    QuotaExceeded,
    /// The operation or kind is not supported here.
    Unsupported,
    /// The system is not in a state that allows the operation (an illegal transition, say).
    FailedPrecondition,
    /// A dependency is temporarily unavailable; retry with back-off.
    Unavailable,
    /// Too many requests from this token or tenant; retry after the `Retry-After` seconds.
    RateLimited,
    /// A bug or an unexpected failure; the message says no more than is safe.
    Internal,
}

impl ErrorCode {
    /// Every code, in declaration order.
    pub const ALL: [ErrorCode; 11] = [
        ErrorCode::InvalidArgument,
        ErrorCode::Unauthenticated,
        ErrorCode::PermissionDenied,
        ErrorCode::NotFound,
        ErrorCode::Conflict,
        ErrorCode::QuotaExceeded,
        ErrorCode::Unsupported,
        ErrorCode::FailedPrecondition,
        ErrorCode::Unavailable,
        ErrorCode::RateLimited,
        ErrorCode::Internal,
    ];

    /// The wire name, e.g. `INVALID_ARGUMENT`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "INVALID_ARGUMENT",
            ErrorCode::Unauthenticated => "UNAUTHENTICATED",
            ErrorCode::PermissionDenied => "PERMISSION_DENIED",
            ErrorCode::NotFound => "NOT_FOUND",
            ErrorCode::Conflict => "CONFLICT",
            ErrorCode::QuotaExceeded => "QUOTA_EXCEEDED",
            ErrorCode::Unsupported => "UNSUPPORTED",
            ErrorCode::FailedPrecondition => "FAILED_PRECONDITION",
            ErrorCode::Unavailable => "UNAVAILABLE",
            ErrorCode::RateLimited => "RATE_LIMITED",
            ErrorCode::Internal => "INTERNAL",
        }
    }

    /// The HTTP status the API answers with for this code.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidArgument => 400,
            ErrorCode::Unauthenticated => 401,
            ErrorCode::PermissionDenied => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::Conflict => 409,
            ErrorCode::QuotaExceeded => 409,
            ErrorCode::Unsupported => 422,
            ErrorCode::FailedPrecondition => 412,
            ErrorCode::Unavailable => 503,
            ErrorCode::RateLimited => 429,
            ErrorCode::Internal => 500,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error with a stable code, a human message, and machine-readable details.
/// Rendered by the API as `{ code, message, details }`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema, thiserror::Error)]
#[error("{code}: {message}")]
pub struct Error {
    /// The stable code.
    pub code: ErrorCode,
    /// What went wrong and, where possible, what to do next.
    pub message: String,
    /// Structured details (`{"reason": "...", ...}`); `null` when there are none.
    #[serde(default)]
    pub details: serde_json::Value,
}

impl Error {
    /// An error with no details.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Error { code, message: message.into(), details: serde_json::Value::Null }
    }

    /// Adds structured details.
    pub fn with_details(mut self, details: serde_json::Value) -> Self {
        self.details = details;
        self
    }

    /// `INVALID_ARGUMENT`.
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, message)
    }

    /// `NOT_FOUND` for a resource of a kind with an id.
    pub fn not_found(kind: &str, id: &str) -> Self {
        Self::new(ErrorCode::NotFound, format!("{kind} {} not found", crate::bounds::echo(id)))
    }

    /// `CONFLICT`.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Conflict, message)
    }

    /// `FAILED_PRECONDITION`.
    pub fn failed_precondition(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::FailedPrecondition, message)
    }

    /// `INTERNAL`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_serialize_as_their_wire_names() {
        for code in ErrorCode::ALL {
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{}\"", code.as_str()));
            let back: ErrorCode = serde_json::from_str(&json).unwrap();
            assert_eq!(back, code);
        }
    }

    #[test]
    fn every_code_has_an_error_status() {
        for code in ErrorCode::ALL {
            assert!((400..600).contains(&code.http_status()), "{code}");
        }
    }

    #[test]
    fn an_error_renders_code_message_and_details() {
        let e = Error::conflict("stale").with_details(serde_json::json!({"version": 3}));
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v, serde_json::json!({"code": "CONFLICT", "message": "stale", "details": {"version": 3}}));
    }
}
