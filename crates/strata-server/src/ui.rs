//! The pages `strata serve` serves itself: the chat page at `/`, the dashboard at
//! `/dashboard` (see `dashboard.rs`) and their assets under `/ui/`, compiled into the binary (no CDN, no build step, nothing fetched at run time).
//! The pages are open (they hold no data); the API they call keeps the server's key, which
//! the page asks for when the server answers 401. A strict Content-Security-Policy allows
//! only the server's own scripts, styles and API: no inline script, no third-party code.

use axum::extract::Path;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("ui/index.html");
const DASHBOARD: &str = include_str!("ui/dashboard.html");

/// Every asset under `/ui/`: (name, content type, body).
const ASSETS: [(&str, &str, &str); 6] = [
    ("api.js", "text/javascript; charset=utf-8", include_str!("ui/api.js")),
    ("chat.js", "text/javascript; charset=utf-8", include_str!("ui/chat.js")),
    ("dashboard.js", "text/javascript; charset=utf-8", include_str!("ui/dashboard.js")),
    ("markdown.js", "text/javascript; charset=utf-8", include_str!("ui/markdown.js")),
    ("sse.js", "text/javascript; charset=utf-8", include_str!("ui/sse.js")),
    ("ui.css", "text/css; charset=utf-8", include_str!("ui/ui.css")),
];

/// Images may be data: or blob: URLs (attachments shown before sending).
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; \
                       connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'";

/// Whether `path` is one of the pages or assets (served without the API key).
pub fn is_page(path: &str) -> bool {
    matches!(path, "/" | "/dashboard" | "/atlas")
        || path.strip_prefix("/ui/").is_some_and(|name| ASSETS.iter().any(|(n, _, _)| *n == name))
}

fn page(content_type: &'static str, body: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    // The assets change with the binary: revalidate rather than keep a stale page.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

pub async fn index() -> Response {
    page("text/html; charset=utf-8", INDEX)
}

pub fn dashboard() -> Response {
    page("text/html; charset=utf-8", DASHBOARD)
}

pub async fn asset(Path(name): Path<String>) -> Response {
    match ASSETS.iter().find(|(n, _, _)| *n == name) {
        Some((_, kind, body)) => page(kind, body),
        None => (StatusCode::NOT_FOUND, format!("no asset `{name}`")).into_response(),
    }
}
