//! What a browser may make the server do: the `Host` allow-list (against DNS rebinding), the
//! `Origin` check with CORS (a page from another origin must not drive the server), and the
//! JSON content type of request bodies.
//!
//! A browser is a confused deputy: any page it shows may send requests to `127.0.0.1`. Two
//! attacks follow. DNS rebinding: `evil.example` first resolves to the attacker, then to
//! 127.0.0.1, and the page talks to a loopback server as its own origin; the `Host` header
//! still says `evil.example`, so a loopback server serves only loopback names. Cross-origin
//! requests: a page's `fetch` carries its `Origin`, and a request from an origin that is not
//! the server's own and not allowed with `--cors-origin` is refused before it reaches a
//! handler (CORS alone only hides the answer; the request would still run). Simple requests
//! (`text/plain` forms) skip the preflight, so bodies must say `application/json`.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// The names and origins the server answers. Built once at start from the configuration.
#[derive(Clone, Debug)]
pub struct BrowserPolicy {
    /// `None`: any `Host`. Otherwise the host names (lowercase, no port) served; IPv6
    /// literals keep their brackets.
    /// Loopback names (`localhost`, 127.0.0.0/8, `[::1]`) are served whenever it is a list.
    hosts: Option<Vec<String>>,
    /// Cross-origin callers allowed (`scheme://host[:port]`, lowercase).
    origins: Vec<String>,
    any_origin: bool,
}

impl BrowserPolicy {
    /// The policy for a server bound to `bind_host`. Bound to a loopback address, only
    /// loopback names are served unless `allowed_hosts` adds some (`*`: any); bound elsewhere,
    /// any `Host` unless `allowed_hosts` names them. `cors_origins`: origins allowed to call
    /// from a browser (`*`: any). Errors name the value that is not a host or an origin.
    pub fn new(bind_host: &str, allowed_hosts: &[String], cors_origins: &[String]) -> Result<Self, String> {
        let mut hosts = Vec::new();
        let mut any_host = false;
        for host in allowed_hosts {
            let host = host.trim().to_ascii_lowercase();
            if host == "*" {
                any_host = true;
            } else if host.is_empty() || host.contains(['/', ' ', '@']) || host_port(&host).1.is_some() {
                return Err(format!("--allowed-hosts: {host:?} is not a host name (give it without a port)"));
            } else {
                hosts.push(host);
            }
        }
        let loopback_bind = is_loopback_name(&bind_host.to_ascii_lowercase())
            || bind_host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
        let hosts = if any_host || (!loopback_bind && hosts.is_empty()) { None } else { Some(hosts) };

        let mut origins = Vec::new();
        let mut any_origin = false;
        for origin in cors_origins {
            let origin = origin.trim().trim_end_matches('/').to_ascii_lowercase();
            if origin == "*" {
                any_origin = true;
            } else if origin == "null" || is_origin(&origin) {
                origins.push(origin);
            } else {
                return Err(format!(
                    "--cors-origin: {origin:?} is not an origin (scheme://host[:port], `null` or `*`)"
                ));
            }
        }
        Ok(BrowserPolicy { hosts, origins, any_origin })
    }

    /// Whether a `Host` value (`name[:port]`) is served.
    pub fn host_allowed(&self, host: &str) -> bool {
        let Some(hosts) = &self.hosts else {
            return true;
        };
        let host = host.to_ascii_lowercase();
        let (name, _) = host_port(&host);
        is_loopback_name(name) || hosts.iter().any(|h| h == name)
    }

    /// Whether `origin` may call the server from another origin.
    fn cross_origin_allowed(&self, origin: &str) -> bool {
        self.any_origin || self.origins.iter().any(|o| o.eq_ignore_ascii_case(origin))
    }
}

/// `name[:port]` → (`name`, port text). IPv6 literals keep their brackets.
fn host_port(host: &str) -> (&str, Option<&str>) {
    if let Some(end) = host.strip_prefix('[').and_then(|rest| rest.find(']')) {
        let (name, rest) = host.split_at(end + 2);
        (name, rest.strip_prefix(':'))
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) => (name, Some(port)),
            None => (host, None),
        }
    }
}

/// `localhost`, a name under `.localhost` (RFC 6761 reserves them for loopback), an IPv4
/// literal in 127.0.0.0/8, or `[::1]`.
fn is_loopback_name(name: &str) -> bool {
    name == "localhost"
        || name.ends_with(".localhost")
        || name == "[::1]"
        || name == "::1"
        || name.parse::<std::net::Ipv4Addr>().is_ok_and(|ip| ip.is_loopback())
}

/// `scheme://host[:port]`, nothing after.
fn is_origin(origin: &str) -> bool {
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false;
    };
    !scheme.is_empty()
        && scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        && !authority.is_empty()
        && !authority.contains(['/', '?', '#', '@', ' '])
}

/// The `Origin` of a request when it is not the server's own: same-origin means the origin's
/// `host[:port]` is the request's `Host` (the scheme is not compared: behind a TLS proxy the
/// page is `https` and the server plain HTTP).
fn foreign_origin(headers: &HeaderMap) -> Option<&str> {
    let origin = headers.get(header::ORIGIN)?;
    let Ok(origin) = origin.to_str() else {
        return Some("(not ASCII)");
    };
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    let authority = origin.split_once("://").map(|(_, a)| a);
    match (authority, host) {
        (Some(a), Some(h)) if a.eq_ignore_ascii_case(h) => None,
        _ => Some(origin),
    }
}

/// The middleware in front of every route: refuses a `Host` that is not served (403) and a
/// foreign `Origin` that is not allowed (403), answers CORS preflights, and marks responses to
/// allowed foreign origins with `Access-Control-Allow-Origin`.
pub async fn check(
    State(policy): State<std::sync::Arc<BrowserPolicy>>,
    request: Request,
    next: Next,
) -> Response {
    // The `Host` header, or the authority of an absolute-form request target.
    let host = request
        .headers()
        .get(header::HOST)
        .map(|h| h.to_str().unwrap_or("(not ASCII)").to_owned())
        .or_else(|| request.uri().authority().map(|a| a.as_str().to_owned()));
    if let Some(host) = host {
        if !policy.host_allowed(&host) {
            return ApiError::host_not_allowed(&host).into_response();
        }
    }
    let origin = foreign_origin(request.headers()).map(str::to_owned);
    if let Some(origin) = &origin {
        if !policy.cross_origin_allowed(origin) {
            return ApiError::origin_not_allowed(origin).into_response();
        }
    }
    let preflight = request.method() == Method::OPTIONS
        && request.headers().contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut response = match (&origin, preflight) {
        (Some(_), true) => preflight_response(request.headers()),
        _ => next.run(request).await,
    };
    if let Some(origin) = origin {
        allow_origin(&policy, &origin, response.headers_mut());
    }
    response
}

/// 204 with the methods and headers a cross-origin caller may use. Requested headers are
/// granted as asked: the caller's origin is allowed, and clients such as OpenAI's JavaScript
/// library send headers of their own.
fn preflight_response(request: &HeaderMap) -> Response {
    let mut response = StatusCode::NO_CONTENT.into_response();
    let headers = response.headers_mut();
    headers.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, OPTIONS"));
    let asked = request
        .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("authorization, content-type"));
    headers.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
    headers.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    response
}

fn allow_origin(policy: &BrowserPolicy, origin: &str, headers: &mut HeaderMap) {
    // The origin passed the check, so it was a valid header value already.
    let value = if policy.any_origin {
        HeaderValue::from_static("*")
    } else {
        HeaderValue::from_str(origin).unwrap_or(HeaderValue::from_static("null"))
    };
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, value);
    headers.append(header::VARY, HeaderValue::from_static("Origin"));
}

/// Refuses a POST whose body is not declared `application/json` (415). Parameters such as
/// `; charset=utf-8` are fine.
pub async fn require_json(request: Request, next: Next) -> Response {
    if request.method() == Method::POST {
        let content_type = request.headers().get(header::CONTENT_TYPE);
        let essence = content_type
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or("").trim().to_ascii_lowercase());
        if essence.as_deref() != Some("application/json") {
            let given = content_type.map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
            return ApiError::unsupported_media_type(given.as_deref()).into_response();
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(bind: &str, hosts: &[&str], origins: &[&str]) -> BrowserPolicy {
        let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        BrowserPolicy::new(bind, &owned(hosts), &owned(origins)).unwrap()
    }

    #[test]
    fn a_loopback_server_serves_loopback_names_only() {
        let p = policy("127.0.0.1", &[], &[]);
        for ok in [
            "localhost",
            "localhost:8080",
            "127.0.0.1",
            "127.0.0.1:1",
            "127.5.6.7:80",
            "[::1]:8080",
            "[::1]",
            "LOCALHOST",
            "app.localhost:3000",
        ] {
            assert!(p.host_allowed(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8080",
            "127.0.0.1.evil.example",
            "localhost.evil.example",
            "10.0.0.1",
            "[::2]:80",
            "localhostx",
        ] {
            assert!(!p.host_allowed(bad), "{bad}");
        }
        assert!(!policy("::1", &[], &[]).host_allowed("evil.example"));
        assert!(!policy("localhost", &[], &[]).host_allowed("evil.example"));
    }

    #[test]
    fn allowed_hosts_widen_or_open_the_list() {
        let p = policy("127.0.0.1", &["My-Box.lan"], &[]);
        assert!(p.host_allowed("my-box.lan:8080") && p.host_allowed("localhost"));
        assert!(!p.host_allowed("other.lan"));
        assert!(policy("127.0.0.1", &["*"], &[]).host_allowed("anything.example"));
        // Bound to every interface: any name, unless a list is given.
        assert!(policy("0.0.0.0", &[], &[]).host_allowed("anything.example"));
        assert!(!policy("0.0.0.0", &["api.example"], &[]).host_allowed("anything.example"));
        assert!(BrowserPolicy::new("127.0.0.1", &["a.example:80".into()], &[]).is_err());
        assert!(BrowserPolicy::new("127.0.0.1", &["".into()], &[]).is_err());
    }

    #[test]
    fn origins_must_be_origins() {
        let p = policy("127.0.0.1", &[], &["https://App.example/", "null"]);
        assert!(p.cross_origin_allowed("https://app.example"));
        assert!(p.cross_origin_allowed("null"));
        assert!(!p.cross_origin_allowed("https://app.example:444"));
        assert!(policy("127.0.0.1", &[], &["*"]).cross_origin_allowed("http://x.example"));
        for bad in ["app.example", "https://a.example/path", "https://", "ftp//x"] {
            assert!(BrowserPolicy::new("127.0.0.1", &[], &[bad.into()]).is_err(), "{bad}");
        }
    }

    #[test]
    fn same_origin_is_the_host_header() {
        let headers = |origin: &str, host: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::ORIGIN, HeaderValue::from_str(origin).unwrap());
            h.insert(header::HOST, HeaderValue::from_str(host).unwrap());
            h
        };
        assert_eq!(foreign_origin(&headers("http://127.0.0.1:8080", "127.0.0.1:8080")), None);
        assert_eq!(foreign_origin(&headers("https://LocalHost:8080", "localhost:8080")), None);
        assert_eq!(
            foreign_origin(&headers("http://127.0.0.1:9999", "127.0.0.1:8080")),
            Some("http://127.0.0.1:9999")
        );
        assert_eq!(foreign_origin(&headers("null", "127.0.0.1:8080")), Some("null"));
        assert_eq!(foreign_origin(&HeaderMap::new()), None);
    }
}
