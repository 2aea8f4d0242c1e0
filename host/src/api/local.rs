//! An API without tokens answers this machine's own callers only, not the web pages a
//! browser on it has open.
//!
//! The configuration allows no tokens on a loopback address only, but loopback alone does
//! not keep a browser out: any page it shows may send `POST`s to `127.0.0.1` (a form needs
//! no CORS preflight), and a name of the page's own that its DNS later points at 127.0.0.1
//! (DNS rebinding) lets its scripts read the answers too. So, with no tokens configured:
//! - the `Host` a request names (and an absolute request target's authority) must be a
//!   loopback name: `localhost`, a name under `.localhost`, or a loopback address;
//! - an `Origin`, which browsers send with every `POST` and every cross-origin read, must be
//!   the host's own (its authority the `Host`): OBX serves no pages, so any other is a page
//!   of another origin, a local dev server's or a local page's among them; `Origin: null`
//!   (sandboxed frames, `file:` pages) is refused;
//! - a `Sec-Fetch-Site`, which browsers send with every request, even a no-cors `GET` that
//!   carries no `Origin`, must be `same-origin` or `none` (typed in by the user).
//!
//! Anything else gets 403 `local_only`, before the handler runs or a body is read. Health and
//! readiness stay open, for probes, as they do with tokens. With tokens configured this layer
//! is not installed: a browser does not attach bearer tokens on its own, and a host behind a
//! proxy sees the proxy's names.

use std::net::IpAddr;

use axum::extract::Request;
use axum::http::uri::Authority;
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::Response;

use super::error_response;

pub async fn only_local(request: Request, next: Next) -> Response {
    if from_this_machine(request.uri(), request.headers()) {
        return next.run(request).await;
    }
    error_response(
        StatusCode::FORBIDDEN,
        "local_only",
        "this host has no API tokens, so it serves callers on its own machine that are not web \
         pages: the Host must name localhost or a loopback address, an Origin must be the \
         host's own, and a Sec-Fetch-Site must be same-origin or none; configure http.auth \
         tokens to serve anyone else",
    )
}

/// Whether the request names only loopback targets and comes from no page of another origin.
fn from_this_machine(uri: &Uri, headers: &HeaderMap) -> bool {
    let target_local = uri.host().is_none_or(is_loopback_name);
    let host = match headers.get_all(header::HOST).iter().collect::<Vec<_>>()[..] {
        [] => None,
        [one] => match one.to_str().ok().and_then(|v| v.parse::<Authority>().ok()) {
            Some(a) if is_loopback_name(a.host()) => Some(a),
            _ => return false,
        },
        // Two Host headers: which one a proxy or a client library believed is unknowable.
        _ => return false,
    };
    let same_origin = headers.get_all(header::ORIGIN).iter().all(|origin| {
        let authority = origin.to_str().ok().and_then(|v| v.parse::<Uri>().ok());
        let authority = authority.as_ref().and_then(Uri::authority);
        matches!((authority, &host), (Some(a), Some(h)) if a.as_str().eq_ignore_ascii_case(h.as_str()))
    });
    let fetched_here = headers
        .get_all("sec-fetch-site")
        .iter()
        .all(|site| matches!(site.as_bytes(), b"same-origin" | b"none"));
    target_local && same_origin && fetched_here
}

/// `localhost`, a name under `.localhost` (RFC 6761 reserves them for loopback), or a
/// loopback address, IPv6 in brackets or not.
fn is_loopback_name(host: &str) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    if host == "localhost" || host.ends_with(".localhost") {
        return true;
    }
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    match bare.parse::<IpAddr>() {
        Ok(IpAddr::V4(ip)) => ip.is_loopback(),
        Ok(IpAddr::V6(ip)) => ip.is_loopback() || ip.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn only_loopback_names_and_origins_pass() {
        let path: Uri = "/v1/status".parse().unwrap();
        let passes = [
            vec![],
            vec![("host", "127.0.0.1:8080")],
            vec![("host", "localhost")],
            vec![("host", "LOCALHOST.:8080")],
            vec![("host", "app.localhost:8080")],
            vec![("host", "[::1]:8080")],
            vec![("host", "127.1.2.3")],
            vec![("host", "[::ffff:127.0.0.1]:80")],
            vec![("host", "localhost:8080"), ("origin", "http://localhost:8080")],
            vec![("host", "[::1]:8080"), ("origin", "http://[::1]:8080")],
            vec![("host", "localhost:8080"), ("sec-fetch-site", "same-origin")],
            vec![("host", "localhost:8080"), ("sec-fetch-site", "none")],
        ];
        for pairs in passes {
            assert!(from_this_machine(&path, &headers(&pairs)), "{pairs:?}");
        }
        let refused = [
            vec![("host", "evil.example:8080")],
            vec![("host", "localhost.evil.example")],
            vec![("host", "127.0.0.1.nip.io")],
            vec![("host", "10.0.0.1:8080")],
            vec![("host", "0.0.0.0:8080")],
            vec![("host", "")],
            vec![("host", "localhost"), ("host", "evil.example")],
            vec![("host", "localhost:8080"), ("origin", "https://evil.example")],
            vec![("host", "localhost:8080"), ("origin", "null")],
            // A local dev server's page, or any other local page: another origin.
            vec![("host", "localhost:8080"), ("origin", "http://localhost:3000")],
            vec![("host", "localhost:8080"), ("origin", "http://app.localhost:8080")],
            vec![("origin", "http://localhost:8080")],
            vec![("host", "localhost:8080"), ("sec-fetch-site", "same-site")],
            vec![("host", "localhost:8080"), ("sec-fetch-site", "cross-site")],
            vec![
                ("host", "localhost:8080"),
                ("origin", "http://localhost"),
                ("origin", "http://evil.example"),
            ],
        ];
        for pairs in refused {
            assert!(!from_this_machine(&path, &headers(&pairs)), "{pairs:?}");
        }
        let absolute: Uri = "http://evil.example/v1/status".parse().unwrap();
        assert!(!from_this_machine(&absolute, &headers(&[("host", "localhost")])));
    }
}
