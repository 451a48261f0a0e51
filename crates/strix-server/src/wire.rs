//! One connection's bytes and bodies, watched for the connection loop ([`crate::connection`]):
//! whether a request is in flight or a new one has begun to arrive ([`Activity`]), the socket
//! wrapper that reports reads and holds back hyper's bare error responses ([`Wire`]), the
//! request body with a deadline ([`TimedBody`]) and the response body that marks the end of
//! its request ([`TrackedBody`]).
//!
//! hyper answers a request it cannot parse (bad `Content-Length`, a head too large...) itself,
//! with a status and an empty body, and offers no hook to change that. It writes that answer
//! only when no response is being written, so a write made while no request is in flight
//! and every response has been flushed can only be it: [`Wire`] holds such bytes back instead
//! of sending them, and the connection loop answers with the OpenAI error body once hyper
//! reports what it could not parse.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

/// What a connection is doing, shared by its socket wrapper, its service and its bodies. All
/// of them run on the connection's task, so the lock is never contended.
pub struct Activity {
    state: Mutex<ActivityState>,
}

struct ActivityState {
    /// Requests handed to the router whose response body hyper has not yet dropped.
    in_flight: usize,
    /// When `in_flight` last fell to 0 (or the connection was accepted).
    idle_since: Instant,
    /// When the first byte arrived while no request was in flight: a request head begun.
    head_started: Option<Instant>,
    /// A response ended and its last bytes may still sit in hyper's buffer.
    awaiting_flush: bool,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            state: Mutex::new(ActivityState {
                in_flight: 0,
                idle_since: Instant::now(),
                head_started: None,
                awaiting_flush: false,
            }),
        })
    }

    fn state(&self) -> MutexGuard<'_, ActivityState> {
        // A panic elsewhere cannot leave these plain numbers inconsistent.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A request was parsed and goes to the router; in flight until the returned guard drops.
    pub fn begin_request(self: &Arc<Self>) -> InFlight {
        let mut state = self.state();
        state.in_flight += 1;
        state.head_started = None;
        InFlight(self.clone())
    }

    /// Whether no request is in flight (the connection may be closed without losing work).
    pub fn is_idle(&self) -> bool {
        self.state().in_flight == 0
    }

    /// No request in flight: since when, and since when a new head has been arriving.
    pub fn idle(&self) -> Option<(Instant, Option<Instant>)> {
        let state = self.state();
        (state.in_flight == 0).then_some((state.idle_since, state.head_started))
    }

    fn on_read(&self) {
        let mut state = self.state();
        if state.in_flight == 0 && state.head_started.is_none() {
            state.head_started = Some(Instant::now());
        }
    }

    fn on_flushed(&self) {
        let mut state = self.state();
        if state.in_flight == 0 {
            state.awaiting_flush = false;
        }
    }

    /// Whether every response has been handed to the socket and no request is in flight.
    pub fn quiet(&self) -> bool {
        let state = self.state();
        state.in_flight == 0 && !state.awaiting_flush
    }
}

/// A request in flight; dropping it (with the response body) ends it.
pub struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut state = self.0.state();
        state.in_flight -= 1;
        if state.in_flight == 0 {
            state.idle_since = Instant::now();
            state.head_started = None;
            state.awaiting_flush = true;
        }
    }
}

/// Enough for any of hyper's bare error responses (a status line, `content-length: 0`, a date).
const HELD_MAX: usize = 1024;

/// The socket of a connection: reports reads to the [`Activity`] and holds back what hyper
/// writes while the connection is quiet (see the module documentation).
pub struct Wire {
    stream: TcpStream,
    activity: Arc<Activity>,
    held: Vec<u8>,
}

impl Wire {
    pub fn new(stream: TcpStream, activity: Arc<Activity>) -> Wire {
        Wire { stream, activity, held: Vec::new() }
    }

    /// The socket, and the bytes held back (empty when hyper wrote no answer of its own).
    pub fn into_parts(self) -> (TcpStream, Vec<u8>) {
        (self.stream, self.held)
    }

    fn hold(&mut self, bytes: &[u8]) -> usize {
        let room = HELD_MAX.saturating_sub(self.held.len());
        self.held.extend_from_slice(&bytes[..bytes.len().min(room)]);
        bytes.len()
    }
}

impl AsyncRead for Wire {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        ready!(Pin::new(&mut self.stream).poll_read(cx, buf))?;
        if buf.filled().len() > before {
            self.activity.on_read();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Wire {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.activity.quiet() {
            return Poll::Ready(Ok(self.hold(buf)));
        }
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.activity.quiet() {
            return Poll::Ready(Ok(bufs.iter().map(|b| self.hold(b)).sum()));
        }
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(Pin::new(&mut self.stream).poll_flush(cx))?;
        self.activity.on_flushed();
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Why a request body could not be read.
#[derive(Debug)]
pub enum BodyError {
    /// The whole body did not arrive within the limit (`--body-timeout`).
    Timeout(Duration),
    /// The body broke off or its framing was wrong (a bad chunk size, fewer bytes than
    /// `Content-Length`...).
    Read(hyper::Error),
}

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BodyError::Timeout(limit) => {
                write!(f, "the body did not arrive within {} s (--body-timeout)", limit.as_secs_f64())
            }
            // hyper's own message is generic ("error reading a body from connection"); the
            // cause says what was wrong ("Invalid chunk size line: Invalid Size").
            BodyError::Read(e) => {
                write!(f, "{e}")?;
                let mut source = e.source();
                while let Some(cause) = source {
                    write!(f, ": {cause}")?;
                    source = cause.source();
                }
                Ok(())
            }
        }
    }
}

impl StdError for BodyError {}

/// The limit a request body missed, when `error` (from reading a request body, as axum
/// reports it) is a [`BodyError::Timeout`]: the caller answers 408 rather than 400.
pub fn body_timeout_of(error: &axum::Error) -> Option<Duration> {
    let mut source = error.source();
    while let Some(cause) = source {
        if let Some(BodyError::Timeout(limit)) = cause.downcast_ref::<BodyError>() {
            return Some(*limit);
        }
        source = cause.source();
    }
    None
}

/// A request body that must arrive in full before a deadline, counted from the end of the
/// request head. Past it, reading fails with [`BodyError::Timeout`].
pub struct TimedBody {
    inner: Incoming,
    deadline: Instant,
    limit: Duration,
    /// Started on the first read that has to wait.
    timer: Option<Pin<Box<Sleep>>>,
    expired: bool,
}

impl TimedBody {
    pub fn new(inner: Incoming, limit: Duration) -> TimedBody {
        TimedBody { inner, deadline: Instant::now() + limit, limit, timer: None, expired: false }
    }
}

impl HttpBody for TimedBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if this.expired {
            return Poll::Ready(None);
        }
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(BodyError::Read)));
        }
        let deadline = this.deadline;
        let timer = this.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        ready!(timer.as_mut().poll(cx));
        this.expired = true;
        Poll::Ready(Some(Err(BodyError::Timeout(this.limit))))
    }

    fn is_end_stream(&self) -> bool {
        self.expired || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that keeps its request in flight until hyper drops it (after the last
/// byte, or when the client goes away): a streamed answer keeps its connection busy.
pub struct TrackedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl TrackedBody {
    pub fn new(inner: Body, in_flight: InFlight) -> TrackedBody {
        TrackedBody { inner, _in_flight: in_flight }
    }
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_timeout_is_told_apart() {
        let limit = Duration::from_secs(60);
        let timeout = axum::Error::new(BodyError::Timeout(limit));
        assert_eq!(body_timeout_of(&timeout), Some(limit));
        assert!(timeout.to_string().contains("--body-timeout"), "{timeout}");
        let other = axum::Error::new(std::io::Error::other("broken"));
        assert_eq!(body_timeout_of(&other), None);
    }
}
