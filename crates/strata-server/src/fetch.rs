//! Fetching a media URL for a client: `http://` and `https://` (rustls, Mozilla's roots),
//! with a timeout and a size cap, from public addresses only unless the server allows
//! private ones. The host is resolved once and the checked address is the one connected
//! to (no second lookup a DNS answer could change); TLS verifies the certificate against
//! the URL's host name. Redirects are not followed: a redirect could lead anywhere.

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Largest body accepted, in bytes.
pub const MAX_BODY_BYTES: usize = 20 << 20;
/// Connect, read and write timeout of a fetch.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether `ip` is an address a server should not fetch from on a client's behalf:
/// private, loopback, link-local, shared (CGNAT), unspecified, broadcast, multicast.
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

/// TLS settings with the web's public roots (built once).
pub fn public_tls() -> Arc<ClientConfig> {
    static CFG: OnceLock<Arc<ClientConfig>> = OnceLock::new();
    CFG.get_or_init(|| {
        let roots = RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
        tls_with_roots(roots)
    })
    .clone()
}

/// TLS settings trusting `roots` (ring as the crypto provider).
pub fn tls_with_roots(roots: RootCertStore) -> Arc<ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    Arc::new(cfg)
}

/// The body of `url` (`http://` or `https://`).
pub fn fetch(url: &str, allow_private: bool, tls: &Arc<ClientConfig>) -> Result<Vec<u8>, String> {
    let (secure, rest) = match (url.strip_prefix("https://"), url.strip_prefix("http://")) {
        (Some(r), _) => (true, r),
        (None, Some(r)) => (false, r),
        _ => return Err("only http:// and https:// URLs are fetched".into()),
    };
    let (authority, path) = match rest.find(['/', '?', '#']) {
        Some(i) if rest.as_bytes()[i] == b'/' => (&rest[..i], &rest[i..]),
        Some(i) => (&rest[..i], "/"),
        None => (rest, "/"),
    };
    let path = path.split('#').next().unwrap_or("/");
    if authority.contains('@') || authority.is_empty() {
        return Err("the URL needs a host (and no credentials)".into());
    }
    let (host, port) = split_authority(authority, if secure { 443 } else { 80 })?;
    let addrs: Vec<SocketAddr> =
        (host.as_str(), port).to_socket_addrs().map_err(|e| format!("cannot resolve {host}: {e}"))?.collect();
    if addrs.is_empty() {
        return Err(format!("{host} has no address"));
    }
    if let (false, Some(a)) = (allow_private, addrs.iter().find(|a| is_private(a.ip()))) {
        return Err(format!(
            "{} is a private, loopback or link-local address (the server refuses those without --allow-private-media)",
            a.ip()
        ));
    }
    let mut last = String::new();
    let stream = addrs.iter().find_map(|a| match TcpStream::connect_timeout(a, FETCH_TIMEOUT) {
        Ok(s) => Some(s),
        Err(e) => {
            last = format!("cannot connect to {a}: {e}");
            None
        }
    });
    let stream = stream.ok_or(last)?;
    stream.set_read_timeout(Some(FETCH_TIMEOUT)).map_err(|e| e.to_string())?;
    stream.set_write_timeout(Some(FETCH_TIMEOUT)).map_err(|e| e.to_string())?;
    let req = format!(
        "GET {path} HTTP/1.0\r\nHost: {authority}\r\nUser-Agent: strata\r\nAccept: image/*\r\nConnection: close\r\n\r\n"
    );
    if !secure {
        return exchange(stream, &req);
    }
    let name = ServerName::try_from(host.clone()).map_err(|e| format!("{host} is not a TLS server name: {e}"))?;
    let conn = ClientConnection::new(tls.clone(), name).map_err(|e| format!("TLS: {e}"))?;
    exchange(StreamOwned::new(conn, stream), &req)
}

/// `host[:port]` or `[v6]:port`.
fn split_authority(authority: &str, default_port: u16) -> Result<(String, u16), String> {
    if let Some(v6) = authority.strip_prefix('[') {
        let (h, tail) = v6.split_once(']').ok_or("an IPv6 host needs its closing `]`")?;
        let port = match tail.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| format!("bad port `{p}`"))?,
            None if tail.is_empty() => default_port,
            None => return Err(format!("unexpected `{tail}` after the host")),
        };
        return Ok((h.to_string(), port));
    }
    match authority.rsplit_once(':') {
        Some((h, p)) => Ok((h.to_string(), p.parse().map_err(|_| format!("bad port `{p}`"))?)),
        None => Ok((authority.to_string(), default_port)),
    }
}

/// Sends `req` and reads a 200 reply's body (at most [`MAX_BODY_BYTES`]).
fn exchange(mut s: impl Read + Write, req: &str) -> Result<Vec<u8>, String> {
    s.write_all(req.as_bytes()).and_then(|_| s.flush()).map_err(|e| e.to_string())?;
    let cap = MAX_BODY_BYTES + 64 * 1024;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            // A TLS peer that closes without close_notify: what arrived is checked below.
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.to_string()),
        }
        if buf.len() > cap {
            return Err(format!("the body is larger than {MAX_BODY_BYTES} bytes"));
        }
    }
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n").ok_or("the reply has no headers")?;
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        return Err(format!("the server answered {status} (redirects are not followed)"));
    }
    let body = buf.split_off(end + 4);
    let declared = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case("content-length").then(|| v.trim().parse::<usize>().ok()).flatten()
    });
    if let Some(n) = declared.filter(|&n| n != body.len()) {
        return Err(format!("the body ended after {} of {n} bytes", body.len()));
    }
    if body.len() > MAX_BODY_BYTES {
        return Err(format!("the body is larger than {MAX_BODY_BYTES} bytes"));
    }
    Ok(body)
}

#[cfg(test)]
#[path = "fetch_tests.rs"]
mod tests;
