//! A state store answer for the connection whose own task ran the request
//! (see `StateStoreService::serve_here`), before it is a message: that
//! connection encodes it straight into its write buffer from these parts,
//! and keeps the encoded PUBLISH until the client acknowledges it
//! (`connection::outbound::DirectWindow::send_answer`). No [`Direct`] is
//! made for it unless it has to wait (the client's Receive Maximum is
//! reached) or go another way (the route no longer holds): then
//! [`Answer::into_direct`] makes the message it always was.

use bytes::Bytes;

use super::mailbox::FixedView;
use super::{Direct, DirectProperties, FixedProperties};

/// A request's Correlation Data, as its answer carries it back: inline
/// up to 24 bytes (copied from the read buffer without an allocation).
pub type Correlation = smallvec::SmallVec<[u8; 24]>;

/// An answer's parts (see the module's documentation).
#[derive(Debug)]
pub struct Answer {
    /// The request's Response Topic.
    pub topic: Bytes,
    /// The RESP3 answer.
    pub payload: Vec<u8>,
    /// The properties every answer carries.
    pub fixed: &'static FixedProperties,
    /// The request's Correlation Data (inline when short).
    pub correlation_data: Option<Correlation>,
    /// The one User Property that varies (`__ts`), after the fixed ones.
    pub varying: (&'static str, statestore::hlc::Stamp),
    /// QoS 1, or 0 when the requester's subscription grants only that.
    pub qos: u8,
    /// The Subscription Identifiers of the requester's subscription.
    pub subscription_identifiers: Vec<usize>,
}

impl Answer {
    /// What it counts against its connection's bound: as the message it
    /// would be ([`Direct::size`]).
    pub fn size(&self) -> usize {
        self.topic.len() + self.payload.len()
    }

    /// Its properties, as the encoder takes them.
    pub(crate) fn properties(&self) -> impl crate::codec::EncodeProperties + '_ {
        FixedView {
            fixed: self.fixed,
            correlation_data: self.correlation_data.as_deref(),
            varying: (self.varying.0, &self.varying.1),
            subscription_identifiers: &self.subscription_identifiers,
        }
    }

    /// The message it is.
    pub fn into_direct(mut self) -> Direct {
        self.take_direct()
    }

    /// The message it is, its parts taken out (what is left is empty).
    pub fn take_direct(&mut self) -> Direct {
        Direct {
            topic: std::mem::take(&mut self.topic),
            payload: Bytes::from(std::mem::take(&mut self.payload)),
            properties: DirectProperties::Fixed {
                fixed: self.fixed,
                correlation_data: self.correlation_data.as_deref().map(Bytes::copy_from_slice),
                varying: (self.varying.0, std::mem::take(&mut self.varying.1)),
                subscription_identifiers: std::mem::take(&mut self.subscription_identifiers),
            },
            qos: self.qos,
            handed_over: false,
            retain: false,
            kept_pkid: None,
            on_done: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{self, Protocol};

    static FIXED: FixedProperties = FixedProperties::new("text/plain", &[("__stat", "200")]);

    fn answer(qos: u8, ids: Vec<usize>) -> Answer {
        Answer {
            topic: Bytes::from_static(b"clients/a/response"),
            payload: b"+OK\r\n".to_vec(),
            fixed: &FIXED,
            correlation_data: Some(Correlation::from_slice(b"\x01\x02")),
            varying: ("__ts", "0000000000123:00000:n".into()),
            qos,
            subscription_identifiers: ids,
        }
    }

    /// An answer encoded from its parts is byte for byte the message it
    /// would have been: the same size, at every QoS, with and without
    /// Subscription Identifiers.
    #[test]
    fn an_answer_encodes_as_its_message() {
        for (qos, ids) in [(1, vec![]), (0, vec![]), (1, vec![7, 300])] {
            let a = answer(qos, ids);
            let size = a.size();
            let mut from_parts = bytes::BytesMut::new();
            codec::encode_publish(
                Protocol::V5,
                &a.topic,
                &a.payload,
                a.qos,
                9,
                &a.properties(),
                &mut from_parts,
            );
            let direct = a.into_direct();
            assert_eq!(direct.size(), size);
            let mut from_message = bytes::BytesMut::new();
            codec::encode_publish(
                Protocol::V5,
                &direct.topic,
                &direct.payload,
                direct.qos,
                9,
                &direct.properties,
                &mut from_message,
            );
            assert_eq!(from_parts, from_message);
        }
    }
}
