//! How a connection ends, and what the client is told.
//!
//! Every way out of a connection's loop is an [`End`]: the client's goodbye,
//! a closed or failed socket, a keep-alive timeout, a takeover, the broker
//! stopping, or a rule the client broke. An MQTT 5 client hears the reason in
//! a DISCONNECT where the broker ended it; every end is logged with its text.

use router::protocol::{DisconnectReasonCode, LastWill, LastWillProperties};

use super::link::LinkFailure;
use crate::codec::CodecError;
use crate::will::Will;

/// How a connection ended.
#[derive(Debug)]
pub(crate) enum End {
    /// The socket closed without DISCONNECT.
    Closed,
    /// A socket error.
    Io(std::io::Error),
    /// DISCONNECT from the client; `will`: it asked for its will anyway.
    Goodbye { will: bool },
    /// Nothing received for 1.5 times the keep-alive.
    KeepAlive,
    /// A write to the client stalled for as long as the client may stay
    /// silent (it stopped reading).
    WriteStalled,
    /// The router dropped the link: another connection took the client id,
    /// or the router refused something.
    RouterClosed,
    /// Another connection took the client id (the broker says so).
    TakenOver,
    /// The broker is stopping.
    Shutdown,
    /// The client's queue of deliveries passed its bound.
    Overflow,
    /// A fault asked for it (see [`crate::faults`]), with this reason.
    Fault(DisconnectReasonCode),
    /// The node stopped serving: a cluster node without its membership
    /// lease (see `standing.rs`). Nothing more is read from or written to
    /// the client but the DISCONNECT.
    NotServing,
    /// The client broke a rule; the reason goes out in DISCONNECT (MQTT 5).
    Violation(DisconnectReasonCode, String),
}

impl End {
    /// Reading the socket failed with `e`: a WebSocket message over the
    /// packet limit is the client's packet too large (0x95, as on TCP,
    /// where the codec sees the size); anything else the socket's error.
    pub fn read_failed(e: std::io::Error) -> End {
        match e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<crate::websocket::TooLarge>())
        {
            Some(too_large) => {
                End::Violation(DisconnectReasonCode::PacketTooLarge, too_large.to_string())
            }
            None => End::Io(e),
        }
    }
}

impl From<CodecError> for End {
    fn from(e: CodecError) -> End {
        let code = match &e {
            CodecError::TooLarge(_) => DisconnectReasonCode::PacketTooLarge,
            CodecError::Malformed(_) => DisconnectReasonCode::MalformedPacket,
            CodecError::Protocol(_) | CodecError::UnsupportedLevel(_) => {
                DisconnectReasonCode::ProtocolError
            }
        };
        End::Violation(code, e.to_string())
    }
}

impl From<LinkFailure> for End {
    fn from(failure: LinkFailure) -> End {
        match failure {
            LinkFailure::Closed => End::RouterClosed,
            LinkFailure::Refused(e) => {
                End::Violation(DisconnectReasonCode::ServerBusy, e.to_string())
            }
        }
    }
}

impl End {
    /// A short name for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            End::Closed => "closed_by_client",
            End::Io(_) => "io_error",
            End::Goodbye { .. } => "disconnect",
            End::KeepAlive => "keep_alive_timeout",
            End::WriteStalled => "write_stalled",
            End::RouterClosed => "router_closed",
            End::TakenOver => "session_taken_over",
            End::Shutdown => "server_shutdown",
            End::Overflow => "queue_overflow",
            End::Fault(_) => "fault_injected",
            End::NotServing => "not_a_cluster_member",
            End::Violation(..) => "protocol_violation",
        }
    }

    /// The client's Last Will, to publish after this end: none after a
    /// normal DISCONNECT or when the broker stops; otherwise after the Will
    /// Delay Interval, at most the Session Expiry Interval.
    pub fn will(
        &self,
        will: Option<LastWill>,
        properties: Option<LastWillProperties>,
        session_expiry: u32,
    ) -> Option<Will> {
        // A cluster node without its lease: the will is in etcd, and a
        // node that still has its lease publishes it (`cluster::wills`).
        if matches!(
            self,
            End::Goodbye { will: false } | End::Shutdown | End::NotServing
        ) {
            return None;
        }
        Some(Will {
            will: will?,
            delay: crate::will::delay(properties.as_ref(), session_expiry),
            properties,
        })
    }

    /// The DISCONNECT reason an MQTT 5 client is told (none where the
    /// client ended it), and the text for the log.
    pub fn reason(&self) -> (Option<DisconnectReasonCode>, String) {
        match self {
            End::Closed => (None, "socket closed".to_owned()),
            End::Io(e) => (None, format!("socket error: {e}")),
            End::Goodbye { will } => (None, format!("DISCONNECT (will: {will})")),
            End::KeepAlive => (
                Some(DisconnectReasonCode::KeepAliveTimeout),
                "keep-alive timeout".to_owned(),
            ),
            End::WriteStalled => (
                Some(DisconnectReasonCode::KeepAliveTimeout),
                "the client stopped reading (writes stalled)".to_owned(),
            ),
            End::RouterClosed => (
                Some(DisconnectReasonCode::SessionTakenOver),
                "session taken over or closed by the router".to_owned(),
            ),
            End::TakenOver => (
                Some(DisconnectReasonCode::SessionTakenOver),
                "session taken over by a new connection".to_owned(),
            ),
            End::Shutdown => (
                Some(DisconnectReasonCode::ServerShuttingDown),
                "broker stopping".to_owned(),
            ),
            End::Overflow => (
                Some(DisconnectReasonCode::QuotaExceeded),
                "the client's queue of deliveries is over its bound (it reads or acknowledges too slowly)".to_owned(),
            ),
            End::Fault(code) => (Some(*code), "fault injected".to_owned()),
            End::NotServing => (
                Some(DisconnectReasonCode::UseAnotherServer),
                "this cluster node lost its membership lease in etcd: use another node".to_owned(),
            ),
            End::Violation(code, text) => (Some(*code), text.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn reasons() {
        use DisconnectReasonCode as R;
        let code = |end: End| end.reason().0;
        assert_eq!(code(End::Closed), None);
        assert_eq!(code(End::Goodbye { will: true }), None);
        assert_eq!(code(End::KeepAlive), Some(R::KeepAliveTimeout));
        assert_eq!(code(End::TakenOver), Some(R::SessionTakenOver));
        assert_eq!(code(End::Shutdown), Some(R::ServerShuttingDown));
        assert_eq!(code(End::Overflow), Some(R::QuotaExceeded));
        assert_eq!(code(End::NotServing), Some(R::UseAnotherServer));
        assert_eq!(
            code(End::Fault(R::UseAnotherServer)),
            Some(R::UseAnotherServer)
        );
        assert_eq!(
            code(CodecError::TooLarge(10).into()),
            Some(R::PacketTooLarge)
        );
        assert_eq!(
            code(CodecError::Malformed("x".into()).into()),
            Some(R::MalformedPacket)
        );
        assert_eq!(
            code(CodecError::Protocol("x".into()).into()),
            Some(R::ProtocolError)
        );
        assert_eq!(code(LinkFailure::Closed.into()), Some(R::SessionTakenOver));
        let (code, text) = End::Violation(R::NotAuthorized, "why".into()).reason();
        assert_eq!((code, text.as_str()), (Some(R::NotAuthorized), "why"));
    }

    #[test]
    fn wills() {
        let will = || {
            Some(LastWill {
                topic: "t".into(),
                message: "bye".into(),
                qos: router::protocol::QoS::AtLeastOnce,
                retain: false,
            })
        };
        let delayed = |secs| {
            Some(LastWillProperties {
                delay_interval: Some(secs),
                payload_format_indicator: None,
                message_expiry_interval: None,
                content_type: None,
                response_topic: None,
                correlation_data: None,
                user_properties: Vec::new(),
            })
        };
        assert!(End::Goodbye { will: false }.will(will(), None, 0).is_none());
        assert!(End::Shutdown.will(will(), None, 0).is_none());
        assert!(End::Closed.will(None, None, 0).is_none());
        let w = End::Goodbye { will: true }.will(will(), None, 0).unwrap();
        assert_eq!(w.delay, Duration::ZERO);
        let w = End::KeepAlive.will(will(), delayed(30), 10).unwrap();
        assert_eq!(w.delay, Duration::from_secs(10), "bounded by the session");
        let w = End::Closed.will(will(), delayed(5), 10).unwrap();
        assert_eq!(w.delay, Duration::from_secs(5));
    }
}
