//! Images in chat requests (`image_url` parts): `data:` URLs decoded in place, `http://`
//! and `https://` URLs fetched by [`crate::fetch`] (timeout, size cap, public addresses
//! only unless the server runs with `--allow-private-media`, no redirects).

use crate::common::AppState;
use crate::error::{ApiError, ApiResult};
use serde_json::Value;
use strata_engine::image::{ImageProcessor, Rgb8};

/// Largest image accepted, in bytes (encoded).
pub const MAX_IMAGE_BYTES: usize = crate::fetch::MAX_BODY_BYTES;

fn bad(param: &str, msg: impl std::fmt::Display) -> ApiError {
    ApiError::bad_request(format!("{param}: {msg}")).with_param(param)
}

/// The bytes of the image at `url`.
pub fn load(url: &str, allow_private: bool, param: &str) -> ApiResult<Vec<u8>> {
    if let Some(rest) = url.strip_prefix("data:") {
        let (meta, data) = rest.split_once(',').ok_or_else(|| bad(param, "a data: URL needs a `,`"))?;
        if !meta.ends_with(";base64") {
            return Err(bad(param, "only base64 data: URLs are accepted"));
        }
        if data.len() > MAX_IMAGE_BYTES / 3 * 4 + 4 {
            return Err(bad(param, format!("the image is larger than {} bytes", MAX_IMAGE_BYTES)));
        }
        return base64(data).ok_or_else(|| bad(param, "the data: URL is not valid base64"));
    }
    if !url.starts_with("http://") && !url.starts_with("https://") {
        return Err(bad(param, "an image URL must be a data: or http(s):// URL"));
    }
    crate::fetch::fetch(url, allow_private, &crate::fetch::public_tls())
        .map_err(|e| bad(param, format!("fetching {url}: {e}")))
}

/// The URL of an image part: OpenAI's `image_url` (`{"url"}` or a string), the Responses
/// API's `input_image`, Anthropic's `image` block (`source`: base64 or url).
pub fn image_url(p: &Value) -> Option<String> {
    let url = |v: &Value| v.get("url").or(Some(v)).and_then(Value::as_str).map(String::from);
    match p.get("type").and_then(Value::as_str)? {
        "image_url" => url(p.get("image_url")?),
        "input_image" => url(p.get("image_url")?),
        "image" => {
            let s = p.get("source")?;
            match s.get("type").and_then(Value::as_str)? {
                "base64" => Some(format!(
                    "data:{};base64,{}",
                    s.get("media_type").and_then(Value::as_str).unwrap_or("image/png"),
                    s.get("data").and_then(Value::as_str)?
                )),
                "url" => s.get("url").and_then(Value::as_str).map(String::from),
                _ => None,
            }
        }
        _ => None,
    }
}

/// A request's images, the processor for them and each one's soft-token count.
pub type LoadedImages = (Vec<Rgb8>, ImageProcessor, Vec<usize>);

/// Loads every image part of `messages` in order (leaving `{"type": "image"}` for
/// the template) with the processor and each image's soft-token count; a model
/// without a vision tower answers 400.
pub fn load_images(st: &AppState, messages: &mut [Value]) -> ApiResult<Option<LoadedImages>> {
    let mut urls = Vec::new();
    for (i, m) in messages.iter_mut().enumerate() {
        if let Some(Value::Array(parts)) = m.get_mut("content") {
            for p in parts.iter_mut().filter(|p| p.get("type").and_then(Value::as_str) == Some("image")) {
                if let Some(Value::String(u)) = p.as_object_mut().and_then(|o| o.remove("url")) {
                    urls.push((format!("messages[{i}].content"), u));
                }
            }
        }
    }
    if urls.is_empty() {
        return Ok(None);
    }
    let param = urls[0].0.clone();
    let spec = strata_engine::media::vision_spec(&st.model)
        .map_err(|e| ApiError::bad_request(format!("{param}: {e:#}")).with_param(&param))?;
    let processor = strata_engine::media::processor(&st.model, &spec).map_err(ApiError::from)?;
    let (mut images, mut counts) = (Vec::new(), Vec::new());
    for (param, url) in urls {
        let bytes = crate::media::load(&url, st.allow_private_media, &param)?;
        let img =
            Rgb8::decode(&bytes).map_err(|e| ApiError::bad_request(format!("{param}: {e:#}")).with_param(&param))?;
        let n = strata_engine::media::soft_tokens(&spec, &processor, &img)
            .map_err(|e| ApiError::bad_request(format!("{param}: {e:#}")).with_param(&param))?;
        counts.push(n);
        images.push(img);
    }
    Ok(Some((images, processor, counts)))
}

/// Standard base64 (padding optional, whitespace ignored).
fn base64(s: &str) -> Option<Vec<u8>> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        } as u32)
    };
    let bytes: Vec<u8> = s.bytes().filter(|c| !c.is_ascii_whitespace()).collect();
    let trimmed = bytes.strip_suffix(b"==").or_else(|| bytes.strip_suffix(b"=")).unwrap_or(&bytes);
    let mut out = Vec::with_capacity(trimmed.len() * 3 / 4);
    for chunk in trimmed.chunks(4) {
        if chunk.len() == 1 {
            return None;
        }
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= val(c)? << (18 - 6 * i);
        }
        let b = n.to_be_bytes();
        out.extend_from_slice(&b[1..chunk.len()]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_decodes_with_and_without_padding() {
        assert_eq!(base64("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64("aGVsbG8").unwrap(), b"hello");
        assert_eq!(base64("aGk=\n").unwrap(), b"hi");
        assert!(base64("a").is_none() && base64("a*bc").is_none());
    }

    #[test]
    fn urls_load_by_scheme() {
        let e = load("http://127.0.0.1:9/x.png", false, "m").unwrap_err();
        assert!(e.message.contains("--allow-private-media"), "{}", e.message);
        let e = load("https://10.0.0.1/x.png", false, "m").unwrap_err();
        assert!(e.message.contains("--allow-private-media"), "{}", e.message);
        assert!(load("ftp://x/y", false, "m").unwrap_err().message.contains("data: or http(s)://"));
        assert_eq!(load("data:image/png;base64,aGk=", false, "m").unwrap(), b"hi");
    }
}
