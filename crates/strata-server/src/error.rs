//! Errors in each API's own shape: OpenAI's `{"error": {message, type, param, code}}`
//! and Anthropic's `{"type": "error", "error": {type, message}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// Which API a route speaks, for the shape of its errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    OpenAi,
    Anthropic,
}

impl Flavor {
    /// The flavor of a request path: Anthropic's routes live under `/v1/messages`.
    pub fn of_path(path: &str) -> Self {
        if path.starts_with("/v1/messages") {
            Self::Anthropic
        } else {
            Self::OpenAi
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub code: Option<&'static str>,
    pub param: Option<String>,
    /// Seconds, for `Retry-After` (429).
    pub retry_after: Option<u64>,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), code: None, param: None, retry_after: None }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// A request body that is not valid JSON, or does not have the request's shape.
    pub fn invalid_body(e: serde_json::Error) -> Self {
        let what =
            if e.is_syntax() || e.is_eof() { "invalid JSON in the request body" } else { "invalid request body" };
        Self::bad_request(format!("{what}: {e}")).with_code("invalid_request_body")
    }

    pub fn queue_full(capacity: usize) -> Self {
        Self {
            retry_after: Some(1),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("the server is busy: {capacity} requests are already waiting; retry later"),
            )
            .with_code("rate_limit_exceeded")
        }
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid or missing API key (send `Authorization: Bearer KEY` or `x-api-key: KEY`)",
        )
        .with_code("invalid_api_key")
    }

    /// OpenAI's error `type` for this status.
    pub fn openai_type(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// Anthropic's error `type` for this status.
    pub fn anthropic_type(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            400..=499 => "invalid_request_error",
            _ => "api_error",
        }
    }

    pub fn body(&self, flavor: Flavor) -> Value {
        match flavor {
            Flavor::OpenAi => json!({
                "error": {
                    "message": self.message,
                    "type": self.openai_type(),
                    "param": self.param,
                    "code": self.code,
                }
            }),
            Flavor::Anthropic => json!({
                "type": "error",
                "error": { "type": self.anthropic_type(), "message": self.message },
            }),
        }
    }

    pub fn into_response(self, flavor: Flavor) -> Response {
        let mut resp = (self.status, axum::Json(self.body(flavor))).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> Self {
        Self::internal(format!("{e:#}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_follow_each_api() {
        let e = ApiError::bad_request("no messages").with_param("messages");
        assert_eq!(
            e.body(Flavor::OpenAi),
            json!({"error": {"message": "no messages", "type": "invalid_request_error",
                             "param": "messages", "code": null}})
        );
        assert_eq!(
            e.body(Flavor::Anthropic),
            json!({"type": "error", "error": {"type": "invalid_request_error",
                                              "message": "no messages"}})
        );
        let busy = ApiError::queue_full(4);
        assert_eq!(busy.anthropic_type(), "rate_limit_error");
        let resp = busy.into_response(Flavor::OpenAi);
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
    }

    #[test]
    fn body_errors_say_what_is_wrong() {
        let syntax = serde_json::from_str::<Value>("{oops").unwrap_err();
        assert!(ApiError::invalid_body(syntax).message.starts_with("invalid JSON"));
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct R {
            n: u32,
        }
        let shape = serde_json::from_str::<R>(r#"{"n": "x"}"#).unwrap_err();
        let e = ApiError::invalid_body(shape);
        assert!(e.message.contains("invalid type"), "{}", e.message);
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }
}
