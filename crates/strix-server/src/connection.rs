//! The connection loop: accepts TCP connections and serves each with hyper's HTTP/1.1, within
//! bounds a client cannot stretch.
//!
//! - A request head must arrive within `header_timeout` of its first byte, its body within
//!   `body_timeout` of its head ([`crate::wire::TimedBody`]); a connection with no request
//!   for `idle_timeout` is closed. A request in flight is never timed out: a streamed answer
//!   may run for minutes.
//! - At most `max_connections` are open, kept below the process's open-file limit. A new
//!   connection beyond that closes the oldest one with no request in flight (one still sending
//!   its head counts), so idle or slow connections cannot lock `/health` out; only when every
//!   connection has a request in flight is the new one refused, with a 503.
//! - Requests hyper cannot parse get the OpenAI error body (see [`crate::wire`]).
//! - Shutdown stops accepting, lets requests in flight finish and closes the rest.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWrite;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, Notify, Semaphore};
use tokio::time::Instant;

use crate::error::ApiError;
use crate::wire::{Activity, TimedBody, TrackedBody, Wire};

/// How long connections may take, and how many may be open.
#[derive(Clone, Debug)]
pub struct ConnectionLimits {
    /// From the first byte of a request to the end of its headers (`--header-timeout`).
    pub header_timeout: Duration,
    /// From the end of the headers to the end of the body (`--body-timeout`).
    pub body_timeout: Duration,
    /// A connection with no request in flight and nothing arriving is closed after this long
    /// (`--idle-timeout`).
    pub idle_timeout: Duration,
    /// Connections open at once (`--max-connections`); lowered at start to fit the
    /// process's open-file limit ([`connection_cap`]).
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    /// 10 s for a head, 60 s for a body (4 MiB at 70 KB/s), 30 s idle, 1024 connections.
    fn default() -> Self {
        ConnectionLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(30),
            max_connections: 1024,
        }
    }
}

impl ConnectionLimits {
    pub fn validate(&self) -> Result<(), String> {
        for (name, value) in [
            ("--header-timeout", self.header_timeout),
            ("--body-timeout", self.body_timeout),
            ("--idle-timeout", self.idle_timeout),
        ] {
            if value.is_zero() {
                return Err(format!("{name} must be more than 0"));
            }
        }
        if self.max_connections == 0 {
            return Err("--max-connections must be at least 1".into());
        }
        Ok(())
    }
}

/// Connections the kernel queues for `accept` (std's listener has 128: a burst overflows it,
/// and a `/health` probe in the burst waits a second for its handshake to be resent).
const LISTEN_BACKLOG: i32 = 1024;

/// Binds a listener on `host:port` (each address `host` resolves to, in turn, as std's
/// `TcpListener::bind` does) with a backlog of [`LISTEN_BACKLOG`].
pub fn bind(host: &str, port: u16) -> std::io::Result<std::net::TcpListener> {
    let mut last_error = None;
    for addr in std::net::ToSocketAddrs::to_socket_addrs(&(host, port))? {
        let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
        // As std does on unix: a restarted server binds while old connections linger.
        #[cfg(unix)]
        socket.set_reuse_address(true)?;
        match socket.bind(&addr.into()).and_then(|()| socket.listen(LISTEN_BACKLOG)) {
            Ok(()) => return Ok(socket.into()),
            Err(e) => last_error = Some(e),
        }
    }
    Err(last_error.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{host} resolves to no address"))
    }))
}

/// Largest request head (request line and headers) in bytes; larger gets 431.
pub const MAX_HEAD_BYTES: usize = 64 << 10;
/// hyper's per-connection read buffer: a head, or a slice of a body.
const MAX_BUF_BYTES: usize = 128 << 10;
/// Open files kept for everything that is not a connection (model files, the runtime, stdio).
const FILES_RESERVED: u64 = 64;
/// Connections being refused at once; more are closed without an answer.
const REFUSALS_AT_ONCE: usize = 64;
/// How long a closed connection may take to flush what it has been sent, and how long an error
/// answer may take to reach the client.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// How long a refused connection is kept for its client to read the 503.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);
/// What a connection is read for after an error answer, so that closing it with unread bytes
/// does not reset it before the client reads the answer.
const DRAIN_MAX_BYTES: usize = 1 << 20;

/// The connections served at once for a configured `max_connections` and the process's
/// open-file limit: every connection, the ones closing ([`closing_slack`]) and the refusals
/// in progress must fit below the limit with [`FILES_RESERVED`] to spare. 0: no room.
pub fn connection_cap(max_connections: usize, open_file_limit: Option<u64>) -> usize {
    let Some(limit) = open_file_limit else {
        return max_connections;
    };
    let budget =
        usize::try_from(limit.saturating_sub(FILES_RESERVED + REFUSALS_AT_ONCE as u64)).unwrap_or(usize::MAX);
    // cap + closing_slack(cap) ≤ budget.
    max_connections.min(budget / 9 * 8).min(budget.saturating_sub(MIN_CLOSING_SLACK))
}

/// See [`closing_slack`].
const MIN_CLOSING_SLACK: usize = 16;

/// Connections past the cap allowed to finish closing (an evicted one flushing its last
/// response) before new ones are refused: an eighth of the cap, at least 16, so that a fast
/// flood does not outrun the closing of the connections it evicts.
fn closing_slack(cap: usize) -> usize {
    (cap / 8).max(MIN_CLOSING_SLACK)
}

/// The process's soft limit on open files (`RLIMIT_NOFILE`); `None` where there is none to read.
pub fn open_file_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes the struct it is given and nothing else.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
            return None;
        }
        // rlim_t is not u64 on every unix.
        #[allow(clippy::unnecessary_cast)]
        (limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur as u64)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Raises the soft open-file limit to the hard one (often 1024 → 524288 on Linux), so that
/// `--max-connections` is not cut down to fit 1024 files. Returns the soft limit after.
pub fn raise_open_file_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit and setrlimit read or write the struct they are given.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max {
                let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
                // Fails where the hard limit is above what the kernel allows (macOS reports
                // "unlimited"); the soft limit then stays as it was.
                libc::setrlimit(libc::RLIMIT_NOFILE, &raised);
            }
        }
    }
    open_file_limit()
}

/// Why a connection is being closed.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Closing {
    /// Nothing arrived for `idle_timeout`.
    Idle,
    /// A head began and did not end within `header_timeout`.
    HeaderTimeout,
    /// Closed to make room for a new connection.
    Evicted,
    /// The server is shutting down.
    Shutdown,
}

impl Closing {
    fn from_u8(n: u8) -> Option<Closing> {
        match n {
            1 => Some(Closing::Evicted),
            2 => Some(Closing::Shutdown),
            _ => None,
        }
    }
}

/// One open connection, as the registry sees it.
struct Slot {
    activity: Arc<Activity>,
    /// 0, or why it was asked to close ([`Closing::from_u8`]).
    close_reason: AtomicU8,
    close: Notify,
}

impl Slot {
    /// Asks the connection to close; false when it was asked already.
    fn ask_to_close(&self, reason: u8) -> bool {
        let first =
            self.close_reason.compare_exchange(0, reason, Ordering::AcqRel, Ordering::Acquire).is_ok();
        if first {
            self.close.notify_one();
        }
        first
    }
}

/// The open connections, oldest first.
struct Registry {
    cap: usize,
    slack: usize,
    inner: Mutex<Open>,
    /// Signalled whenever a connection goes.
    freed: Notify,
}

enum Admission {
    Admitted(Registered),
    /// Every connection has a request in flight.
    Full,
    /// Too many connections asked to close have not closed yet.
    Closing,
}

struct Open {
    next_id: u64,
    slots: BTreeMap<u64, Arc<Slot>>,
    /// Slots asked to close that have not closed yet.
    closing: usize,
}

impl Registry {
    fn new(cap: usize) -> Arc<Registry> {
        Arc::new(Registry {
            cap,
            slack: closing_slack(cap),
            inner: Mutex::new(Open { next_id: 0, slots: BTreeMap::new(), closing: 0 }),
            freed: Notify::new(),
        })
    }

    fn open(&self) -> MutexGuard<'_, Open> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers a new connection, closing the oldest one without a request in flight when
    /// the cap is reached.
    fn admit(self: &Arc<Self>) -> Admission {
        let mut open = self.open();
        if open.slots.len() >= self.cap + self.slack {
            return Admission::Closing;
        }
        if open.slots.len() - open.closing >= self.cap {
            let victim = open
                .slots
                .values()
                .find(|s| s.close_reason.load(Ordering::Acquire) == 0 && s.activity.is_idle());
            let Some(victim) = victim else {
                return Admission::Full;
            };
            if victim.ask_to_close(1) {
                open.closing += 1;
            }
        }
        let id = open.next_id;
        open.next_id += 1;
        let slot = Arc::new(Slot {
            activity: Activity::new(),
            close_reason: AtomicU8::new(0),
            close: Notify::new(),
        });
        open.slots.insert(id, slot.clone());
        Admission::Admitted(Registered { registry: self.clone(), id, slot })
    }

    /// Waits until fewer connections than the cap and its slack are open.
    async fn wait_room(&self) {
        loop {
            let freed = self.freed.notified();
            if self.open().slots.len() < self.cap + self.slack {
                return;
            }
            freed.await;
        }
    }

    /// Asks every connection to close (shutdown).
    fn close_all(&self) {
        let mut open = self.open();
        let asked = open.slots.values().filter(|s| s.ask_to_close(2)).count();
        open.closing += asked;
    }

    async fn wait_empty(&self) {
        loop {
            let freed = self.freed.notified();
            if self.open().slots.is_empty() {
                return;
            }
            freed.await;
        }
    }
}

/// A connection's place in the registry, given up on drop.
struct Registered {
    registry: Arc<Registry>,
    id: u64,
    slot: Arc<Slot>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut open = self.registry.open();
        if open.slots.remove(&self.id).is_some() && self.slot.close_reason.load(Ordering::Acquire) != 0 {
            open.closing -= 1;
        }
        self.registry.freed.notify_waiters();
    }
}

/// Hands each request to the router, its body under a deadline, and keeps it in flight until
/// its response body is dropped.
#[derive(Clone)]
struct Dispatch {
    router: Router,
    activity: Arc<Activity>,
    body_timeout: Duration,
}

impl hyper::service::Service<hyper::Request<Incoming>> for Dispatch {
    type Response = hyper::Response<TrackedBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, request: hyper::Request<Incoming>) -> Self::Future {
        let in_flight = self.activity.begin_request();
        let request = request.map(|body| Body::new(TimedBody::new(body, self.body_timeout)));
        let mut router = self.router.clone();
        Box::pin(async move {
            let response = match tower_service::Service::call(&mut router, request).await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            Ok(response.map(|body| TrackedBody::new(body, in_flight)))
        })
    }
}

/// Serves `listener` with `router` until `shutdown` fires, then lets the connections finish
/// (the caller bounds how long). `cap` is the connection cap ([`connection_cap`]).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    cap: usize,
    mut shutdown: oneshot::Receiver<()>,
) {
    let registry = Registry::new(cap);
    let refusals = Arc::new(Semaphore::new(REFUSALS_AT_ONCE));
    let refusal = ApiError::too_many_connections(cap);
    let refusal_bytes = response_bytes(&refusal);
    let mut builder = http1::Builder::new();
    builder
        .keep_alive(true)
        .max_buf_size(MAX_BUF_BYTES)
        .max_header_size(MAX_HEAD_BYTES)
        // Ours are per state (idle, head, body) in `serve_connection`; hyper's would run from
        // the end of the previous response and so also cut idle connections.
        .header_read_timeout(None);
    let builder = Arc::new(builder);
    let out_of_files_said = AtomicBool::new(false);
    loop {
        let stream = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of files despite the cap (something else holds them): the connection
                    // waits in the backlog; retry shortly rather than spin.
                    if matches!(e.raw_os_error(), Some(code) if code == EMFILE || code == ENFILE) {
                        if !out_of_files_said.swap(true, Ordering::Relaxed) {
                            eprintln!("strix serve: cannot accept a connection: {e}");
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    continue;
                }
            },
        };
        // Streamed tokens are small writes that must not wait for Nagle's algorithm.
        let _ = stream.set_nodelay(true);
        let mut admission = registry.admit();
        if let Admission::Closing = admission {
            // The connections evicted for the last ones close at their tasks' next poll: wait
            // for them (the kernel queues new connections meanwhile) rather than refuse.
            let _ = tokio::time::timeout(CLOSE_GRACE, registry.wait_room()).await;
            admission = registry.admit();
        }
        match admission {
            Admission::Admitted(registered) => {
                tokio::spawn(serve_connection(
                    stream,
                    registered,
                    router.clone(),
                    builder.clone(),
                    limits.clone(),
                ));
            }
            Admission::Full | Admission::Closing => match refusals.clone().try_acquire_owned() {
                Ok(permit) => {
                    let refusal = refusal.clone();
                    tokio::spawn(async move {
                        answer(stream, &refusal, REFUSAL_LINGER).await;
                        drop(permit);
                    });
                }
                // Too many refusals lingering (clients that do not close): answer what the
                // socket takes at once and close, after reading what has arrived (closing
                // with unread bytes would reset the connection and could lose the answer).
                Err(_) => refuse_at_once(stream, &refusal_bytes),
            },
        }
    }
    drop(listener);
    registry.close_all();
    registry.wait_empty().await;
}

#[cfg(unix)]
const EMFILE: i32 = libc::EMFILE;
#[cfg(unix)]
const ENFILE: i32 = libc::ENFILE;
#[cfg(not(unix))]
const EMFILE: i32 = -1;
#[cfg(not(unix))]
const ENFILE: i32 = -1;

/// One connection, from accept to close.
async fn serve_connection(
    stream: TcpStream,
    registered: Registered,
    router: Router,
    builder: Arc<http1::Builder>,
    limits: ConnectionLimits,
) {
    let slot = registered.slot.clone();
    let activity = slot.activity.clone();
    let service = Dispatch { router, activity: activity.clone(), body_timeout: limits.body_timeout };
    let mut conn = builder.serve_connection(TokioIo::new(Wire::new(stream, activity.clone())), service);

    let close_asked = slot.close.notified();
    tokio::pin!(close_asked);
    let mut timer = Box::pin(tokio::time::sleep(limits.idle_timeout));
    let mut closing: Option<(Closing, Instant)> = None;
    let finished = poll_fn(|cx| loop {
        if let Poll::Ready(result) = conn.poll_without_shutdown(cx) {
            return Poll::Ready(Some(result));
        }
        let Some((reason, since)) = closing else {
            // Serving: close when asked, or when a timer runs out.
            let reason = if close_asked.as_mut().poll(cx).is_ready() {
                Closing::from_u8(slot.close_reason.load(Ordering::Acquire))
            } else {
                match activity.idle() {
                    // A request in flight is never timed out.
                    None => None,
                    Some((idle_since, head_started)) => {
                        let (deadline, reason) = match head_started {
                            Some(started) => (started + limits.header_timeout, Closing::HeaderTimeout),
                            None => (idle_since + limits.idle_timeout, Closing::Idle),
                        };
                        if timer.deadline() != deadline {
                            timer.as_mut().reset(deadline);
                        }
                        timer.as_mut().poll(cx).is_ready().then_some(reason)
                    }
                }
            };
            match reason {
                Some(reason) => {
                    closing = Some((reason, Instant::now()));
                    Pin::new(&mut conn).graceful_shutdown();
                    continue;
                }
                None => return Poll::Pending,
            }
        };
        // Closing. With nothing in flight and nothing left to flush, at once: hyper's own
        // graceful close would wait for a head begun on a new connection (it counts as busy
        // until its first response). A request that raced the close finishes (hyper closes
        // after it); at shutdown the server bounds the wait. Otherwise the last bytes of a
        // response get CLOSE_GRACE to reach a client that reads slowly.
        if activity.quiet() {
            return Poll::Ready(Some(Ok(())));
        }
        if reason == Closing::Shutdown {
            return Poll::Pending;
        }
        let Some((idle_since, _)) = activity.idle() else {
            return Poll::Pending;
        };
        let deadline = since.max(idle_since) + CLOSE_GRACE;
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        return match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        };
    })
    .await;

    let Some(result) = finished else {
        return; // Gave up on a client that does not read: drop it.
    };
    let (mut stream, held) = conn.into_parts().io.into_inner().into_parts();
    let reply = match (&result, closing) {
        // hyper answered a request it could not parse: the same status, with our body.
        (Err(e), _) if !held.is_empty() => Some(ApiError::protocol(held_status(&held), &e.to_string())),
        (_, Some((Closing::HeaderTimeout, _))) => Some(ApiError::header_timeout(limits.header_timeout)),
        _ => None,
    };
    match reply {
        Some(error) => answer(stream, &error, CLOSE_GRACE).await,
        None => {
            let _ = tokio::time::timeout(CLOSE_GRACE, async {
                if !held.is_empty() {
                    // Not expected (hyper wrote while quiet and did not fail): send it as written.
                    write_all(&stream, &held).await?;
                }
                shutdown(&mut stream).await
            })
            .await;
        }
    }
    drop(registered);
}

/// The status of a response head hyper wrote (`HTTP/1.1 431 ...`); 400 if unreadable.
fn held_status(head: &[u8]) -> StatusCode {
    head.get(9..12)
        .filter(|_| head.starts_with(b"HTTP/1."))
        .and_then(|code| StatusCode::from_bytes(code).ok())
        .unwrap_or(StatusCode::BAD_REQUEST)
}

/// Writes `error` as a whole HTTP/1.1 response and closes the connection: shuts down the
/// write side, then reads what the client still sends for a moment, since closing a socket
/// with unread bytes resets it and the client could lose the answer.
async fn answer(mut stream: TcpStream, error: &ApiError, linger: Duration) {
    let _ = tokio::time::timeout(linger, async {
        write_all(&stream, &response_bytes(error)).await?;
        shutdown(&mut stream).await?;
        let mut buf = [0u8; 4096];
        let mut drained = 0;
        while drained < DRAIN_MAX_BYTES {
            stream.readable().await?;
            match stream.try_read(&mut buf) {
                Ok(0) => break,
                Ok(n) => drained += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        Ok::<_, std::io::Error>(())
    })
    .await;
}

/// Writes `response` without waiting, reads what has arrived, and closes.
fn refuse_at_once(stream: TcpStream, response: &[u8]) {
    let _ = stream.try_write(response);
    let mut buf = [0u8; 4096];
    let mut drained = 0;
    while drained < DRAIN_MAX_BYTES {
        match stream.try_read(&mut buf) {
            Ok(n) if n > 0 => drained += n,
            _ => break,
        }
    }
    if let Ok(stream) = stream.into_std() {
        let _ = stream.shutdown(std::net::Shutdown::Write);
    }
}

/// `error` as a whole HTTP/1.1 response that closes the connection.
fn response_bytes(error: &ApiError) -> Vec<u8> {
    let body = error.body().to_string();
    let head = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        error.status.as_u16(),
        error.status.canonical_reason().unwrap_or(""),
        body.len()
    );
    [head.into_bytes(), body.into_bytes()].concat()
}

async fn write_all(stream: &TcpStream, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        stream.writable().await?;
        match stream.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Closes the write side (the client reads to the end of the answer).
async fn shutdown(stream: &mut TcpStream) -> std::io::Result<()> {
    poll_fn(|cx| Pin::new(&mut *stream).poll_shutdown(cx)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_fits_below_the_file_limit() {
        assert_eq!(connection_cap(1024, None), 1024);
        assert_eq!(connection_cap(1024, Some(1 << 20)), 1024);
        // 1024 files: 64 reserved, 64 for refusals, 896 for connections and their closing
        // slack (cap / 8, at least 16).
        let cap = connection_cap(1024, Some(1024));
        assert_eq!(cap, 792);
        assert_eq!(connection_cap(100, Some(200)), 56);
        assert!(56 + closing_slack(56) + REFUSALS_AT_ONCE + FILES_RESERVED as usize <= 200);
        assert!(cap + closing_slack(cap) + REFUSALS_AT_ONCE + FILES_RESERVED as usize <= 1024);
        assert_eq!(connection_cap(1024, Some(50)), 0);
    }

    #[test]
    fn held_heads_give_their_status() {
        assert_eq!(held_status(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), 431);
        assert_eq!(held_status(b"HTTP/1.1 414 URI Too Long\r\n"), 414);
        assert_eq!(held_status(b"garbage"), 400);
    }

    #[test]
    fn zero_limits_are_refused() {
        let mut limits = ConnectionLimits::default();
        assert!(limits.validate().is_ok());
        limits.body_timeout = Duration::ZERO;
        assert!(limits.validate().unwrap_err().contains("--body-timeout"));
        let limits = ConnectionLimits { max_connections: 0, ..ConnectionLimits::default() };
        assert!(limits.validate().is_err());
    }
}
