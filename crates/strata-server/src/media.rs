//! Images in chat requests (`image_url` parts): `data:` URLs decoded in place, `http://`
//! URLs fetched with a timeout and a size cap, from public addresses only (private,
//! loopback, link-local, shared and unspecified addresses are refused unless the server
//! runs with `--allow-private-media`; the host is resolved once and the checked address
//! is the one connected to; redirects are not followed). `https://` needs TLS, which this
//! build does not carry: such URLs are refused by name (send a `data:` URL).

use crate::common::AppState;
use crate::error::{ApiError, ApiResult};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;
use strata_engine::image::{ImageProcessor, Rgb8};

/// Largest image accepted, in bytes (encoded).
pub const MAX_IMAGE_BYTES: usize = 20 << 20;
/// Connect and read timeout of a fetch.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

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
    if url.starts_with("https://") {
        return Err(bad(
            param,
            "https image URLs are not fetched by this build (no TLS); send the image as a data: URL",
        ));
    }
    let Some(rest) = url.strip_prefix("http://") else {
        return Err(bad(param, "an image URL must be a data: or http(s):// URL"));
    };
    fetch_http(rest, allow_private).map_err(|e| bad(param, format!("fetching {url}: {e}")))
}

/// Whether `ip` is an address a server should not fetch from on a client's behalf.
pub fn is_private(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v) => {
            let o = v.octets();
            v.is_private()
                || v.is_loopback()
                || v.is_link_local()
                || v.is_unspecified()
                || v.is_broadcast()
                || v.is_multicast()
                || o[0] == 0
                || (o[0] == 100 && (o[1] & 0xc0) == 64)
        }
        IpAddr::V6(v) => {
            let s = v.segments();
            if let Some(v4) = v.to_ipv4_mapped() {
                return is_private(IpAddr::V4(v4));
            }
            v.is_loopback()
                || v.is_unspecified()
                || v.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
        }
    }
}

fn fetch_http(rest: &str, allow_private: bool) -> Result<Vec<u8>, String> {
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if authority.contains('@') || authority.is_empty() {
        return Err("the URL needs a host (and no credentials)".into());
    }
    let host =
        authority.rsplit_once(':').map_or(authority, |(h, p)| if p.parse::<u16>().is_ok() { h } else { authority });
    let with_port = if host.len() == authority.len() { format!("{authority}:80") } else { authority.to_string() };
    let addrs: Vec<SocketAddr> =
        with_port.to_socket_addrs().map_err(|e| format!("cannot resolve the host: {e}"))?.collect();
    let addr = addrs.first().copied().ok_or("the host has no address")?;
    if !allow_private && addrs.iter().any(|a| is_private(a.ip())) {
        return Err(format!(
            "{} is a private, loopback or link-local address (the server refuses those without --allow-private-media)",
            addr.ip()
        ));
    }
    let mut s = TcpStream::connect_timeout(&addr, FETCH_TIMEOUT).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(FETCH_TIMEOUT)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(FETCH_TIMEOUT)).map_err(|e| e.to_string())?;
    let req = format!("GET {path} HTTP/1.0\r\nHost: {authority}\r\nUser-Agent: strata\r\nAccept: image/*\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    s.take((MAX_IMAGE_BYTES + 64 * 1024) as u64).read_to_end(&mut buf).map_err(|e| e.to_string())?;
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n").ok_or("the reply has no headers")?;
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        return Err(format!("the server answered {status} (redirects are not followed)"));
    }
    let body = buf[end + 4..].to_vec();
    if body.len() > MAX_IMAGE_BYTES {
        return Err(format!("the image is larger than {MAX_IMAGE_BYTES} bytes"));
    }
    Ok(body)
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
        let (h, w) = processor
            .target_size(img.height, img.width)
            .map_err(|e| ApiError::bad_request(format!("{param}: {e:#}")).with_param(&param))?;
        counts.push(processor.soft_tokens((h / spec.patch_size) * (w / spec.patch_size)));
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
    fn private_addresses_are_refused_unless_allowed() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
        ] {
            assert!(is_private(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["8.8.8.8", "1.1.1.1", "2606:4700::1111"] {
            assert!(!is_private(ip.parse().unwrap()), "{ip}");
        }
        let e = load("http://127.0.0.1:9/x.png", false, "m").unwrap_err();
        assert!(e.message.contains("--allow-private-media"), "{}", e.message);
        assert!(load("https://example.com/x.png", false, "m").unwrap_err().message.contains("data: URL"));
        assert!(load("ftp://x/y", false, "m").is_err());
        assert_eq!(load("data:image/png;base64,aGk=", false, "m").unwrap(), b"hi");
    }

    #[test]
    fn an_allowed_private_fetch_reads_the_body() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut req = Vec::new();
            let mut buf = [0u8; 256];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = c.read(&mut buf).unwrap();
                req.extend_from_slice(&buf[..n]);
            }
            c.write_all(b"HTTP/1.0 200 OK\r\nContent-Type: image/png\r\n\r\nPIXELS").unwrap();
        });
        assert_eq!(load(&format!("http://127.0.0.1:{port}/a.png"), true, "m").unwrap(), b"PIXELS");
        t.join().unwrap();
    }
}
