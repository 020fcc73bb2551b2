//! When an HTTP connection has waited too long: the header timeout and the
//! idle timeout of `[http]`.
//!
//! hyper's own `header_read_timeout` is not used: it also starts when a
//! keep-alive connection goes idle, so a connection could never stay idle
//! longer than a request's headers may take. Instead each connection has
//! a [`Watch`], fed by its socket ([`Watched`]: bytes moved), its service
//! (a request's headers are complete when hyper hands it over) and its
//! response body ([`Finishing`]: the response is done when hyper drops
//! it), and its task closes it at [`Watch::deadline`]:
//!
//! - headers (from the connection's start for the first request, from the
//!   first byte of each next one) must be complete within
//!   `header_timeout`;
//! - a connection on which no byte moved either way for `idle_timeout` is
//!   closed, between requests as in the middle of one (a request body or
//!   a response the peer stopped sending or reading). The web view's
//!   event stream sends a keep-alive often enough never to be idle.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

/// What a connection is doing, as far as its timeouts go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for a request's headers, since then.
    Head(Instant),
    /// This many requests handed to the service whose responses are not
    /// done.
    Busy(u32),
    /// Between requests (no byte of the next one yet).
    Idle,
}

#[derive(Debug)]
struct State {
    phase: Phase,
    last_io: Instant,
}

/// The two bounds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub header: Duration,
    pub idle: Duration,
}

/// Why a connection was closed.
pub(crate) const HEADER_TIMEOUT: &str = "header_timeout";
/// See [`HEADER_TIMEOUT`].
pub(crate) const IDLE_TIMEOUT: &str = "idle_timeout";

/// One connection's timing, shared by its socket, service, bodies and task.
#[derive(Debug)]
pub(crate) struct Watch {
    state: Mutex<State>,
}

impl Watch {
    /// A connection accepted at `now`: its first request's headers are due.
    pub(crate) fn new(now: Instant) -> Arc<Watch> {
        Arc::new(Watch {
            state: Mutex::new(State {
                phase: Phase::Head(now),
                last_io: now,
            }),
        })
    }

    /// When the connection is to be closed unless something happens
    /// before, and why.
    pub(crate) fn deadline(&self, limits: Limits) -> (Instant, &'static str) {
        let state = self.state.lock();
        let idle = (state.last_io + limits.idle, IDLE_TIMEOUT);
        match state.phase {
            Phase::Head(since) if since + limits.header <= idle.0 => {
                (since + limits.header, HEADER_TIMEOUT)
            }
            _ => idle,
        }
    }

    fn moved(&self, read: bool) {
        let now = Instant::now();
        let mut state = self.state.lock();
        state.last_io = now;
        if read && state.phase == Phase::Idle {
            state.phase = Phase::Head(now);
        }
    }

    /// A request's headers arrived: the service has it until the returned
    /// guard (moved into the response body) is dropped.
    pub(crate) fn request(self: &Arc<Watch>) -> Busy {
        let mut state = self.state.lock();
        state.phase = match state.phase {
            Phase::Busy(n) => Phase::Busy(n.saturating_add(1)),
            _ => Phase::Busy(1),
        };
        Busy(Arc::clone(self))
    }
}

/// A request the service has, until its response is done.
#[derive(Debug)]
pub(crate) struct Busy(Arc<Watch>);

impl Drop for Busy {
    fn drop(&mut self) {
        let now = Instant::now();
        let mut state = self.0.state.lock();
        state.phase = match state.phase {
            Phase::Busy(n) if n > 1 => Phase::Busy(n - 1),
            _ => Phase::Idle,
        };
        // Idle from the response's end (a HEAD's body is never written).
        state.last_io = state.last_io.max(now);
    }
}

/// A response body that ends its request's [`Busy`] when hyper is done
/// with it (written out, or the connection gone).
pub(crate) struct Finishing<B> {
    pub(crate) body: B,
    pub(crate) _busy: Busy,
}

impl<B> http_body::Body for Finishing<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, B::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A socket that tells its [`Watch`] when bytes move.
pub(crate) struct Watched<S> {
    socket: S,
    watch: Arc<Watch>,
}

impl<S> Watched<S> {
    pub(crate) fn new(socket: S, watch: Arc<Watch>) -> Watched<S> {
        Watched { socket, watch }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let result = Pin::new(&mut this.socket).poll_read(cx, buf);
        if matches!(result, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.watch.moved(true);
        }
        result
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.socket).poll_write(cx, data);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            this.watch.moved(false);
        }
        result
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.socket).poll_write_vectored(cx, bufs);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            this.watch.moved(false);
        }
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.socket.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().socket).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().socket).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        header: Duration::from_secs(10),
        idle: Duration::from_secs(60),
    };

    #[tokio::test(start_paused = true)]
    async fn headers_are_due_then_idleness_counts() {
        let start = Instant::now();
        let watch = Watch::new(start);
        // Nothing sent: the first request's headers are due.
        assert_eq!(
            watch.deadline(LIMITS),
            (start + LIMITS.header, HEADER_TIMEOUT)
        );
        // A byte of them changes nothing: the headers are due all the same.
        tokio::time::advance(Duration::from_secs(3)).await;
        watch.moved(true);
        assert_eq!(
            watch.deadline(LIMITS),
            (start + LIMITS.header, HEADER_TIMEOUT)
        );
        // Handed over: only idleness counts (a slow response or body).
        let busy = watch.request();
        let answered = Instant::now();
        assert_eq!(
            watch.deadline(LIMITS),
            (answered + LIMITS.idle, IDLE_TIMEOUT)
        );
        tokio::time::advance(Duration::from_secs(20)).await;
        watch.moved(false);
        let wrote = Instant::now();
        assert_eq!(watch.deadline(LIMITS), (wrote + LIMITS.idle, IDLE_TIMEOUT));
        // Done: idle between requests (longer than a header may take).
        drop(busy);
        assert_eq!(watch.deadline(LIMITS), (wrote + LIMITS.idle, IDLE_TIMEOUT));
        // The next request's first byte starts its header timeout.
        tokio::time::advance(Duration::from_secs(30)).await;
        watch.moved(true);
        let next = Instant::now();
        assert_eq!(
            watch.deadline(LIMITS),
            (next + LIMITS.header, HEADER_TIMEOUT)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_short_idle_timeout_bounds_a_head_too() {
        let limits = Limits {
            header: Duration::from_secs(10),
            idle: Duration::from_secs(2),
        };
        let start = Instant::now();
        let watch = Watch::new(start);
        assert_eq!(watch.deadline(limits), (start + limits.idle, IDLE_TIMEOUT));
    }
}
