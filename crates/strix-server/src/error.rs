//! The one error type of the HTTP layer, rendered as OpenAI's error body
//! (`{"error": {"message", "type", "param", "code"}}`) with the status that goes with it.
//! Every failure a client can see goes through here, so clients written against OpenAI
//! (which read `error.message`) get a readable reason whatever went wrong.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `rate_limit_error`, `server_error`...
    pub kind: &'static str,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: None }
    }

    /// 400 naming the field at fault.
    pub fn invalid_param(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError { param: Some(param.into()), ..Self::bad_request(message) }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn unauthorized() -> Self {
        ApiError {
            code: Some("invalid_api_key"),
            ..Self::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "missing or invalid API key: send `Authorization: Bearer <key>`",
            )
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError { code: Some("not_found"), ..Self::new(StatusCode::NOT_FOUND, "not_found_error", message) }
    }

    pub fn method_not_allowed() -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method not allowed on this route")
    }

    pub fn too_large(limit: usize) -> Self {
        ApiError {
            code: Some("request_too_large"),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("request body exceeds the server's limit of {limit} bytes (--max-body)"),
            )
        }
    }

    pub fn queue_full(limit: usize) -> Self {
        ApiError {
            code: Some("rate_limit_exceeded"),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!(
                    "the server is busy: {limit} requests are already waiting (--max-queue); retry later"
                ),
            )
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// 403: the `Host` names a server this one is not (DNS rebinding, or a name not listed
    /// with `--allowed-hosts`).
    pub fn host_not_allowed(host: &str) -> Self {
        ApiError {
            code: Some("host_not_allowed"),
            ..Self::new(
                StatusCode::FORBIDDEN,
                "permission_error",
                format!("Host {} is not served here (allow it with --allowed-hosts)", quoted(host)),
            )
        }
    }

    /// 403: a browser page from another origin, not allowed with `--cors-origin`.
    pub fn origin_not_allowed(origin: &str) -> Self {
        ApiError {
            code: Some("origin_not_allowed"),
            ..Self::new(
                StatusCode::FORBIDDEN,
                "permission_error",
                format!(
                    "requests from origin {} are not allowed (allow it with --cors-origin)",
                    quoted(origin)
                ),
            )
        }
    }

    /// 415: a body that is not declared `application/json`.
    pub fn unsupported_media_type(given: Option<&str>) -> Self {
        ApiError {
            code: Some("unsupported_media_type"),
            ..Self::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                format!(
                    "the request body must be sent as Content-Type: application/json (got {})",
                    given.map_or("none".into(), quoted)
                ),
            )
        }
    }

    /// 503: every connection slot holds a request in flight (`--max-connections`).
    pub fn too_many_connections(limit: usize) -> Self {
        ApiError {
            code: Some("too_many_connections"),
            ..Self::unavailable(format!(
                "the server has {limit} connections open, each with a request in flight \
                 (--max-connections); retry later"
            ))
        }
    }

    /// 408: the request head did not arrive in time.
    pub fn header_timeout(limit: std::time::Duration) -> Self {
        ApiError {
            code: Some("request_timeout"),
            ..Self::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request line and headers did not arrive within {} s (--header-timeout)",
                    limit.as_secs_f64()
                ),
            )
        }
    }

    /// 408: the request body did not arrive in time (see [`crate::wire::body_timeout_of`]).
    pub fn body_timeout(limit: std::time::Duration) -> Self {
        ApiError {
            code: Some("request_timeout"),
            ..Self::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!("the request body did not arrive within {} s (--body-timeout)", limit.as_secs_f64()),
            )
        }
    }

    /// A request the HTTP parser refused before any route saw it: 400 (malformed request line,
    /// header, `Content-Length`, `Transfer-Encoding`), 414 (target too long), 431 (head too
    /// large). `problem` is the parser's word for it.
    pub fn protocol(status: StatusCode, problem: &str) -> Self {
        let message = match status {
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => {
                format!("the request head is too large ({problem}): keep the request line and headers small")
            }
            StatusCode::URI_TOO_LONG => format!("the request target is too long ({problem})"),
            _ => format!("malformed HTTP/1.1 request: {problem}"),
        };
        ApiError { code: Some("malformed_request"), ..Self::new(status, "invalid_request_error", message) }
    }

    pub fn context_length(message: impl Into<String>) -> Self {
        ApiError { code: Some("context_length_exceeded"), ..Self::invalid_param("messages", message) }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// A client's string in a message: quoted, control characters escaped, at most 100 characters.
fn quoted(text: &str) -> String {
    const MAX: usize = 100;
    let mut out = format!("{:?}", text.chars().take(MAX).collect::<String>());
    if text.chars().nth(MAX).is_some() {
        out.push_str("...");
    }
    out
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = axum::Json(self.body()).into_response();
        *response.status_mut() = self.status;
        response
    }
}
