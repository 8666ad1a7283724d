//! The live dashboard: its page (`/dashboard`, open like the chat page), the telemetry it
//! reads (`/stats/stream`: `/stats`, the cumulative expert counters and every routed
//! expert's residency, once a second as server-sent events, behind the API key like the
//! rest of the API), and the model's Expert Atlas where it has one (`<model>/atlas/atlas.json`
//! rendered by `strata atlas render` as `<model>/atlas/atlas.html`: the page at `/atlas`, the
//! experts' topics for the map's tooltips at `/stats/atlas`).

use crate::common::Shared;
use crate::error::{ApiError, Flavor};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::path::PathBuf;
use std::time::Duration;

/// How often the stream sends.
pub const PERIOD: Duration = Duration::from_secs(1);

pub async fn page() -> Response {
    crate::ui::dashboard()
}

/// One message of the stream.
pub fn snapshot(st: &crate::common::AppState) -> Value {
    json!({
        "stats": crate::stats_value(st),
        "expert_totals": *st.metrics.experts.lock().unwrap(),
        "residency": st.model.expert_residency(),
        "atlas": atlas_dir(st).join("atlas.json").is_file(),
    })
}

pub async fn stream(State(st): State<Shared>) -> Response {
    let events = stream::unfold((st, true), |(st, first)| async move {
        if !first {
            tokio::time::sleep(PERIOD).await;
        }
        let data = snapshot(&st).to_string();
        Some((Ok::<_, Infallible>(Event::default().data(data)), (st, false)))
    });
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

fn atlas_dir(st: &crate::common::AppState) -> PathBuf {
    st.model.dir.join("atlas")
}

fn no_atlas(st: &crate::common::AppState, file: &str) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "this model has no Expert Atlas: no {} (build one with `strata atlas build` and `strata atlas render`)",
            atlas_dir(st).join(file).display()
        ),
    )
    .into_response(Flavor::OpenAi)
}

/// The rendered atlas page, under its own policy: `atlas render` writes one self-contained
/// page (inline style and script, images as data: URLs), which calls nothing.
pub async fn atlas_page(State(st): State<Shared>) -> Response {
    let path = atlas_dir(&st).join("atlas.html");
    let Ok(html) = std::fs::read_to_string(&path) else { return no_atlas(&st, "atlas.html") };
    let mut r = html.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; \
             connect-src 'none'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'",
        ),
    );
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    r
}

/// Per expert the atlas kept: `[layer, expert, top topic, specialization]`.
pub async fn atlas_topics(State(st): State<Shared>) -> Response {
    let path = atlas_dir(&st).join("atlas.json");
    let Ok(text) = std::fs::read_to_string(&path) else { return no_atlas(&st, "atlas.json") };
    let parsed: Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{}: not JSON: {e}", path.display()))
                .into_response(Flavor::OpenAi)
        }
    };
    let experts: Vec<Value> = parsed["experts"]
        .as_array()
        .map(|list| {
            list.iter()
                .filter_map(|e| {
                    Some(json!([
                        e["layer"].as_u64()?,
                        e["expert"].as_u64()?,
                        e["top_topic"].as_str()?,
                        e["specialization"].as_f64().unwrap_or(0.0)
                    ]))
                })
                .collect()
        })
        .unwrap_or_default();
    Json(json!({"categories": parsed["categories"], "experts": experts})).into_response()
}
