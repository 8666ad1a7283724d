use super::*;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::{ServerConfig, ServerConnection};
use std::net::TcpListener;

#[test]
fn private_addresses_are_named() {
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
    let e = fetch("https://127.0.0.1:9/x.png", false, &public_tls()).unwrap_err();
    assert!(e.contains("--allow-private-media"), "{e}");
    assert!(fetch("ftp://x/y", true, &public_tls()).unwrap_err().contains("http"));
    assert!(fetch("http://user@example.com/", true, &public_tls()).unwrap_err().contains("credentials"));
}

#[test]
fn authorities_split_into_host_and_port() {
    assert_eq!(split_authority("example.com", 443).unwrap(), ("example.com".into(), 443));
    assert_eq!(split_authority("example.com:8443", 443).unwrap(), ("example.com".into(), 8443));
    assert_eq!(split_authority("[::1]:81", 80).unwrap(), ("::1".into(), 81));
    assert_eq!(split_authority("[::1]", 80).unwrap(), ("::1".into(), 80));
    assert!(split_authority("example.com:http", 80).unwrap_err().contains("port"));
    assert!(split_authority("[::1", 80).is_err());
}

/// Serves one request on `l` with `reply` (plain TCP).
fn serve_plain(l: TcpListener, reply: &'static [u8]) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        read_request(&mut c);
        c.write_all(reply).unwrap();
    })
}

fn read_request(c: &mut impl Read) -> String {
    let mut req = Vec::new();
    let mut buf = [0u8; 256];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0, "the client closed before its request ended");
        req.extend_from_slice(&buf[..n]);
    }
    String::from_utf8(req).unwrap()
}

#[test]
fn an_allowed_private_http_fetch_reads_the_body() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let t = serve_plain(l, b"HTTP/1.0 200 OK\r\nContent-Type: image/png\r\nContent-Length: 6\r\n\r\nPIXELS");
    assert_eq!(fetch(&format!("http://127.0.0.1:{port}/a.png"), true, &public_tls()).unwrap(), b"PIXELS");
    t.join().unwrap();
}

#[test]
fn short_bodies_and_redirects_are_errors() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let t = serve_plain(l, b"HTTP/1.0 200 OK\r\nContent-Length: 10\r\n\r\nPIX");
    let e = fetch(&format!("http://127.0.0.1:{port}/a.png"), true, &public_tls()).unwrap_err();
    assert!(e.contains("3 of 10"), "{e}");
    t.join().unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let t = serve_plain(l, b"HTTP/1.0 302 Found\r\nLocation: http://10.0.0.1/\r\n\r\n");
    let e = fetch(&format!("http://127.0.0.1:{port}/a.png"), true, &public_tls()).unwrap_err();
    assert!(e.contains("302") && e.contains("redirects"), "{e}");
    t.join().unwrap();
}

/// A TLS server for "localhost" with a fresh self-signed certificate: serves one request.
fn serve_tls(body: &'static [u8]) -> (u16, CertificateDer<'static>, std::thread::JoinHandle<Option<String>>) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cert = ck.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.key_pair.serialize_der()));
    let cfg = ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let t = std::thread::spawn(move || {
        let (c, _) = l.accept().unwrap();
        let conn = ServerConnection::new(Arc::new(cfg)).unwrap();
        let mut s = StreamOwned::new(conn, c);
        // A client that rejects the certificate ends the handshake: no request.
        let mut req = Vec::new();
        let mut buf = [0u8; 256];
        while !req.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut buf) {
                Ok(n) if n > 0 => req.extend_from_slice(&buf[..n]),
                _ => return None,
            }
        }
        let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body).unwrap();
        s.conn.send_close_notify();
        s.flush().unwrap();
        Some(String::from_utf8(req).unwrap())
    });
    (port, cert, t)
}

#[test]
fn https_fetches_verify_the_certificate_and_read_the_body() {
    let (port, cert, t) = serve_tls(b"PNG BYTES");
    let mut roots = RootCertStore::empty();
    roots.add(cert).unwrap();
    let got = fetch(&format!("https://localhost:{port}/img.png?x=1"), true, &tls_with_roots(roots)).unwrap();
    assert_eq!(got, b"PNG BYTES");
    let req = t.join().unwrap().expect("the request arrived");
    assert!(req.starts_with("GET /img.png?x=1 HTTP/1.0\r\n") && req.contains("Host: localhost:"), "{req}");

    // The public roots do not trust a self-signed certificate.
    let (port, _, t) = serve_tls(b"x");
    let e = fetch(&format!("https://localhost:{port}/a.png"), true, &public_tls()).unwrap_err();
    assert!(e.to_lowercase().contains("certificate"), "{e}");
    assert!(t.join().unwrap().is_none());
}
