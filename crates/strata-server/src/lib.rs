//! `strata serve`: an OpenAI- and Anthropic-compatible HTTP server over one model.
//!
//! Routes: `POST /v1/chat/completions`, `/v1/completions`, `/v1/messages`,
//! `/v1/messages/count_tokens`, `/v1/responses`, `/tokenize`; `GET /v1/models`,
//! `/v1/models/{id}`, `/health`, `/stats`, `/metrics`. Generations run together in one
//! continuously batched engine on a worker thread (strata_engine::serving), behind a
//! bounded queue (429 with `Retry-After` beyond it); a client that disconnects cancels
//! its generation.
//!
//! Bad input is refused before it costs much: request bodies are bounded
//! ([`ServeOptions::max_body`], 413 naming the limit, read at most that far), and prompt
//! text longer than the context could possibly hold (more bytes than `context` tokens of
//! the tokenizer's longest token, twice over) is refused with 400 before tokenizing.
//!
//! SIGTERM or SIGINT shuts down gracefully: no new connections; generations running or
//! queued stop at their next token and end properly (final events, finish reason
//! `stop`); the expert runtime's end of turn flushes the usage ledger; exit status 0.

pub mod anthropic;
pub mod common;
pub mod dashboard;
pub mod error;
pub mod fetch;
pub mod grammar;
pub mod harmony;
pub mod media;
pub mod metrics;
pub mod openai;
pub mod output;
pub mod params;
pub mod responses;
pub mod structured;
pub mod syntax;
pub mod tools;
pub mod ui;
pub mod worker;

use crate::common::{parse_body, AppState, Body, Shared};
use crate::error::{ApiError, Flavor};
use crate::metrics::Metrics;
use crate::worker::Worker;
use anyhow::{bail, Context, Result};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use strata_engine::model_dir::display_name;
use strata_engine::{LoadOptions, LoadedModel};

/// Largest request body accepted (long prompts are large).
/// Default largest request body accepted (`--max-body`).
pub const MAX_BODY_BYTES: usize = 4 << 20;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub model_dir: PathBuf,
    pub host: String,
    pub port: u16,
    /// Memory budget and expert-runtime options.
    pub load: LoadOptions,
    pub serve: ServeOptions,
}

/// How the server runs its model.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub api_key: Option<String>,
    /// Requests that may wait beyond the running batch.
    pub queue: usize,
    /// Requests running at once (rows of one decode step).
    pub max_batch: usize,
    /// KV positions for every running sequence and the prompt cache (default: the
    /// context).
    pub kv_tokens: Option<usize>,
    /// Rows one forward may carry (decode rows plus prompt chunks; default: the model's
    /// prefill chunk, which holds one image of the most soft tokens its processor makes).
    pub step_tokens: Option<usize>,
    /// Bytes of KV the prompt cache may keep (default: the whole pool; running requests
    /// take blocks from it as they need them).
    pub prompt_cache_bytes: Option<u64>,
    /// Longest prompt plus answer (default: the model's context, or `--context` under a
    /// budget).
    pub context_limit: Option<usize>,
    /// Origins allowed by CORS (`*` for any); empty: no CORS headers.
    pub cors: Vec<String>,
    /// Image URLs may point at private, loopback and link-local addresses.
    pub allow_private_media: bool,
    /// Largest request body accepted, in bytes.
    pub max_body: usize,
    /// Tokens the draft (MTP) layer proposes per step of a decoding request (default:
    /// 3 where the model's draft layer is loaded, else 0; 0 turns speculation off).
    pub draft_tokens: Option<usize>,
    pub draft_policy: strata_engine::DraftPolicy,
    /// Keep what the engine measures about speculating in the model directory, and start
    /// from what earlier runs kept (`strata serve` does; off by default).
    pub remember_speculation: bool,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            api_key: None,
            queue: 64,
            max_batch: 16,
            kv_tokens: None,
            step_tokens: None,
            prompt_cache_bytes: None,
            context_limit: None,
            cors: Vec::new(),
            allow_private_media: false,
            max_body: MAX_BODY_BYTES,
            draft_tokens: None,
            draft_policy: strata_engine::DraftPolicy::Adaptive,
            remember_speculation: false,
        }
    }
}

/// The server's state around an opened model; starts the generation worker.
pub fn state(model: LoadedModel, api_key: Option<String>, queue: usize) -> Shared {
    state_with(model, api_key, queue, None)
}

/// [`state`], serving at most `context_limit` tokens of prompt and answer.
pub fn state_with(model: LoadedModel, api_key: Option<String>, queue: usize, context_limit: Option<usize>) -> Shared {
    state_opts(model, &ServeOptions { api_key, queue, context_limit, ..Default::default() })
}

/// The server's state under `opts`.
pub fn state_opts(model: LoadedModel, opts: &ServeOptions) -> Shared {
    let model = Arc::new(model);
    let context =
        opts.context_limit.map_or(model.context, |c| c.min(model.context)).min(model.model.info().max_context);
    let metrics = Arc::new(Metrics::default());
    let tok = model.tokenizer.as_ref();
    // A marker that a decode skipping special tokens would drop.
    let special = |m: &str| {
        tok.and_then(|t| t.token_id(m).map(|id| t.decode(&[id], true).is_ok_and(|s| s.is_empty()))).unwrap_or(false)
    };
    let syntax = syntax::Syntax::of(model.arch.family().chat);
    let markers_special = syntax.markers().into_iter().any(special);
    let reasoning = tok.is_some_and(|t| t.token_id(syntax.think().1).is_some());
    let kv_bytes_per_token = model.arch.kv_bytes_per_token();
    let kv_tokens = opts.kv_tokens.unwrap_or(context).max(context);
    let engine = strata_engine::serving::EngineOptions {
        max_batch: opts.max_batch.max(1),
        kv_tokens,
        context,
        step_tokens: step_tokens(&model, opts),
        prompt_cache_bytes: opts.prompt_cache_bytes.unwrap_or(u64::MAX),
        kv_bytes_per_token,
        draft_tokens: draft_tokens(&model, opts),
    };
    let grammars = grammar::Grammars::new(model.clone()).map_err(|e| format!("{e:#}"));
    // Bytes per token, twice over: slack for normalizers that shrink text.
    let max_prompt_bytes =
        tok.map_or(usize::MAX, |t| context.saturating_mul(t.max_token_bytes().max(1)).saturating_mul(2));
    Arc::new(AppState {
        model_id: display_name(&model.dir),
        worker: Worker::start(model.clone(), opts.queue, engine, metrics.clone(), opts.remember_speculation),
        model,
        api_key: opts.api_key.clone().filter(|k| !k.is_empty()),
        metrics,
        started: Instant::now(),
        created: common::now_unix(),
        markers_special,
        reasoning,
        allow_private_media: opts.allow_private_media,
        syntax,
        context,
        grammars,
        cors: opts.cors.clone(),
        max_body: opts.max_body,
        max_prompt_bytes,
        draft_tokens: engine.draft_tokens,
        draft_policy: opts.draft_policy,
    })
}

/// Constant-time comparison, so the key cannot be guessed byte by byte from timings.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether the headers carry `key` as `Authorization: Bearer KEY` or `x-api-key: KEY`.
pub fn authorized(headers: &HeaderMap, key: &str) -> bool {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' ').filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer")).map(|(_, k)| k))
        .is_some_and(|v| same(v.trim().as_bytes(), key.as_bytes()));
    let x_api_key = headers.get("x-api-key").is_some_and(|v| same(v.as_bytes(), key.as_bytes()));
    bearer || x_api_key
}

async fn auth(State(st): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        let path = req.uri().path();
        let open = path == "/health" || (req.method() == axum::http::Method::GET && ui::is_page(path));
        if !open && !authorized(req.headers(), key) {
            return ApiError::unauthorized().into_response(Flavor::of_path(path));
        }
    }
    next.run(req).await
}

async fn count(State(st): State<Shared>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let resp = next.run(req).await;
    st.metrics.record_http(&path, resp.status().as_u16());
    resp
}

/// Reads the request body, at most `max_body` bytes: a larger one is refused with 413
/// naming the limit as soon as its length (declared or read so far) passes it.
async fn limit_body(State(st): State<Shared>, req: Request, next: Next) -> Response {
    use futures_util::StreamExt;
    let limit = st.max_body;
    let flavor = Flavor::of_path(req.uri().path());
    let too_large = |len: String| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is {len} bytes, over this server's limit of {limit} bytes; send less, or start \
                 the server with a larger --max-body"
            ),
        )
        .into_response(flavor)
    };
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(len) = declared.filter(|&len| len > limit as u64) {
        return too_large(len.to_string());
    }
    let (parts, body) = req.into_parts();
    let mut stream = body.into_data_stream();
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => return ApiError::bad_request(format!("cannot read the request body: {e}")).into_response(flavor),
        };
        if bytes.len() + chunk.len() > limit {
            return too_large(format!("more than {}", bytes.len() + chunk.len() - 1));
        }
        bytes.extend_from_slice(&chunk);
    }
    next.run(Request::from_parts(parts, axum::body::Body::from(bytes))).await
}

async fn method_not_allowed(req: Request) -> Response {
    let path = req.uri().path();
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, format!("{path} does not take {}", req.method()))
        .into_response(Flavor::of_path(path))
}

async fn not_found(req: Request) -> Response {
    let path = req.uri().path();
    ApiError::new(StatusCode::NOT_FOUND, format!("no route for {} {path}", req.method()))
        .into_response(Flavor::of_path(path))
}

async fn health() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn metrics(State(st): State<Shared>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], st.metrics.render(st.worker.capacity()))
        .into_response()
}

async fn stats(State(st): State<Shared>) -> Response {
    Json(stats_value(&st)).into_response()
}

/// What `/stats` answers (the dashboard's stream sends it too).
pub fn stats_value(st: &AppState) -> Value {
    let m = &st.metrics;
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    json!({
        "model": {
            "id": st.model_id,
            "dir": st.model.dir.display().to_string(),
            "model_type": st.model.model_type,
            "max_context": st.max_context(),
            "vocab_size": st.model.model.info().vocab_size,
            "eos_token_ids": st.model.eos_token_ids,
            "chat_template": st.model.chat_template.is_some(),
            "default_sampling": st.model.generation.sampling,
        },
        // (`fit`: the host's plan; `gpu_fit`: the GPU's, where a GPU tier holds experts.)
        "plan": match &st.model.fit {
            Some(fit) => json!({"device": st.model.model.device(), "expert_streaming": fit.streamed, "fit": fit,
                                "gpu_fit": st.model.gpu_fit, "experts_dir": st.model.experts_dir}),
            None => json!({"device": st.model.model.device(), "expert_streaming": false}),
        },
        "experts": *m.last_experts.lock().unwrap(),
        "draft_experts": *m.last_draft_experts.lock().unwrap(),
        "queue": {
            "capacity": st.worker.capacity(),
            "depth": m.queue_depth.load(Ordering::Relaxed),
            "active": m.active.load(Ordering::Relaxed),
            "max_batch": st.worker.max_batch(),
        },
        "engine": *m.engine.lock().unwrap(),
        "totals": {
            "generations": load(&m.generations),
            "generation_errors": load(&m.generation_errors),
            "cancelled": load(&m.cancelled),
            "rejected": load(&m.rejected),
            "prompt_tokens": load(&m.prompt_tokens),
            "prefill_tokens": load(&m.prefill_tokens),
            "generated_tokens": load(&m.generated_tokens),
        },
        "last_generation": *m.last.lock().unwrap(),
        "uptime_s": st.started.elapsed().as_secs_f64(),
    })
}

#[derive(Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<openai::ChatMessage>>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(flatten)]
    template: openai::TemplateFields,
}

/// Tokenizes a raw prompt, or renders chat messages (and tools) through the chat
/// template first; answers the text that was tokenized, for checking what the model sees.
async fn tokenize(State(st): State<Shared>, body: Body) -> Response {
    let run = move || -> Result<(Value, Option<&'static str>), ApiError> {
        let req: TokenizeRequest = parse_body(&body)?;
        let (text, ids, fallback) = match (req.prompt, req.messages) {
            (Some(p), None) => {
                let ids = st.tokenize(&p, req.add_special_tokens.unwrap_or(true))?;
                (p, ids, None)
            }
            (None, Some(msgs)) => {
                let tools = openai::tool_schemas(req.tools, None)?;
                let p = st.chat_prompt(req.template.input(openai::chat_messages(msgs)?, tools)?)?;
                (p.text, p.ids, p.tools_fallback)
            }
            _ => return Err(ApiError::bad_request("send either `prompt` or `messages`")),
        };
        Ok((
            json!({"tokens": ids, "count": ids.len(), "max_model_len": st.max_context(),
                  "prompt": text, "tools_fallback": fallback}),
            fallback,
        ))
    };
    match common::blocking(run).await {
        Ok((v, fallback)) => common::Prompt { text: String::new(), ids: vec![], media: None, tools_fallback: fallback }
            .mark(Json(v).into_response()),
        Err(e) => e.into_response(Flavor::OpenAi),
    }
}

/// The CORS layer for `origins` (`*`: any origin).
fn cors(origins: &[String]) -> tower_http::cors::CorsLayer {
    use tower_http::cors::{AllowOrigin, Any, CorsLayer};
    let layer = CorsLayer::new().allow_methods(Any).allow_headers(Any).expose_headers(Any);
    if origins.iter().any(|o| o == "*") {
        layer.allow_origin(Any)
    } else {
        let list = origins.iter().filter_map(|o| axum::http::HeaderValue::from_str(o).ok()).collect::<Vec<_>>();
        layer.allow_origin(AllowOrigin::list(list))
    }
}

pub fn router(st: Shared) -> Router {
    let origins = st.cors.clone();
    let app = Router::new()
        .route("/", get(ui::index))
        .route("/ui/{name}", get(ui::asset))
        .route("/dashboard", get(dashboard::page))
        .route("/atlas", get(dashboard::atlas_page))
        .route("/stats/stream", get(dashboard::stream))
        .route("/stats/atlas", get(dashboard::atlas_topics))
        .route("/health", get(health))
        .route("/stats", get(stats))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/v1/models", get(openai::list_models))
        .route("/v1/models/{id}", get(openai::get_model))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::responses))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(st.max_body))
        .layer(from_fn_with_state(st.clone(), limit_body))
        .layer(from_fn_with_state(st.clone(), auth))
        .layer(from_fn_with_state(st.clone(), count))
        .with_state(st);
    // Outermost, so preflights (OPTIONS) are answered before auth.
    if origins.is_empty() {
        app
    } else {
        app.layer(cors(&origins))
    }
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        eprintln!("warning: cannot listen for SIGTERM/SIGINT; stop the server with SIGKILL");
        return std::future::pending().await;
    };
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    eprintln!("strata serve: {name}: shutting down (no new connections; running generations end at their next token)");
}

/// Rows a step carries: as asked, or the model's prefill chunk.
fn step_tokens(model: &LoadedModel, opts: &ServeOptions) -> usize {
    opts.step_tokens.unwrap_or(model.prefill_rows).max(1)
}

/// Draft tokens a decoding request's step verifies: as asked, or the default where the
/// model's draft layer is loaded.
fn draft_tokens(model: &LoadedModel, opts: &ServeOptions) -> usize {
    // The default fits what a step holds beside every decoding request's own row.
    let room = (step_tokens(model, opts) / opts.max_batch.max(1)).saturating_sub(1);
    let default = strata_engine::generate::DEFAULT_DRAFT_TOKENS.min(room);
    opts.draft_tokens.unwrap_or(if model.draft { default } else { 0 })
}

/// Opens the model, binds, and serves until SIGTERM or SIGINT, then shuts down
/// gracefully (see the crate docs).
pub fn serve(cfg: ServerConfig) -> Result<()> {
    let model = LoadedModel::open_with(&cfg.model_dir, &cfg.load)?;
    model.tokenizer()?;
    if let (Some(n), Some(v)) = (cfg.serve.step_tokens, model.model.vision()) {
        if v.spec().bidirectional && n < model.image_rows {
            bail!(
                "--step-tokens {n}: an image of up to {} soft tokens (preprocessor_config.json max_soft_tokens) attends to itself in one forward; give at least {}",
                model.image_rows,
                model.image_rows
            );
        }
    }
    if let (Some(n @ 1..), false) = (cfg.serve.draft_tokens, model.draft) {
        bail!("--draft-tokens {n}: {} has no draft (MTP) layer loaded (or --mtp off)", cfg.model_dir.display());
    }
    let gamma = draft_tokens(&model, &cfg.serve);
    // Under a budget the plan reserved KV cache for `--context` tokens: serve no more.
    let st = state_opts(model, &cfg.serve);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", cfg.host, cfg.port);
        let listener =
            tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        let local = listener.local_addr()?;
        let experts = match &st.model.fit {
            Some(f) if f.streamed => {
                format!(", experts streamed ({} slots)", f.plan.as_ref().map_or(0, |p| p.total_slots))
            }
            _ => String::new(),
        };
        let mtp = match gamma {
            0 => String::new(),
            g => format!(", MTP {g} drafts ({})", cfg.serve.draft_policy.as_str()),
        };
        eprintln!(
            "strata serve: {} ({}, context {}{experts}{mtp}), batch {}, queue {}, auth {}; listening on http://{local}",
            st.model_id,
            st.model.model_type,
            st.max_context(),
            st.worker.max_batch(),
            st.worker.capacity(),
            if st.api_key.is_some() { "on" } else { "off" },
        );
        if st.api_key.is_none() && !local.ip().is_loopback() {
            eprintln!("warning: serving {local} without --api-key: anyone who can reach it can use the model");
        }
        let stopping = st.clone();
        axum::serve(listener, router(st.clone()))
            .with_graceful_shutdown(async move {
                shutdown_signal().await;
                stopping.worker.shut_down();
            })
            .await?;
        // Every connection is closed: the last generation's answer is out. Its end of turn
        // may still be running on the worker; this one waits for it (the runtime's lock)
        // and flushes whatever is left, so the ledger is saved before the process exits.
        for experts in st.model.experts.iter().chain(&st.model.draft_experts) {
            if let Err(e) = experts.end_turn() {
                eprintln!("warning: expert runtime: end of turn at shutdown: {e:#}");
            }
        }
        eprintln!("strata serve: stopped");
        Ok(())
    })
}
