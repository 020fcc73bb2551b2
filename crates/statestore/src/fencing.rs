//! Fencing tokens: protecting a key from a writer that lost its lock.
//!
//! A lock holder gets its fencing token from the lock itself: the version
//! the store returned for its `SET lock holder NEX PX ms`. It then sends that
//! token as the `__ft` user property with every write to the resources the
//! lock guards:
//!
//! - A SET with `__ft` on a key without a token stores the token with the key.
//! - Once a key has a token, SET, DEL and VDEL **without** `__ft` get
//!   `a fencing token is required for this request`; with an **older** `__ft`
//!   they get `the request fencing token is a lower version than the fencing
//!   token protecting the resource`; with an equal or newer one they go ahead,
//!   and a SET keeps the newer of the two tokens.
//! - An `__ft` more than the allowed skew ahead of the broker's clock is
//!   refused before anything else (see [`crate::Store`]).
//!
//! So a holder that was paused past its lease, and whose lock went to someone
//! else meanwhile, cannot overwrite what the new holder wrote. Tokens compare
//! by time (wall clock, then counter); see [`Hlc::cmp_time`].

use std::cmp::Ordering;

use crate::error::Error;
use crate::hlc::Hlc;

/// Checks a request's token (`presented`) against the key's (`protecting`).
///
/// ```
/// use statestore::{fencing, hlc::Hlc, Error};
/// let key: Hlc = "100:1:n".parse().unwrap();
/// let old: Hlc = "100:0:n".parse().unwrap();
/// assert_eq!(fencing::check(Some(&key), None), Err(Error::FencingTokenRequired));
/// assert_eq!(fencing::check(Some(&key), Some(&old)), Err(Error::FencingTokenLowerVersion));
/// assert_eq!(fencing::check(Some(&key), Some(&key)), Ok(()));
/// assert_eq!(fencing::check(None, None), Ok(()));
/// ```
pub fn check(protecting: Option<&Hlc>, presented: Option<&Hlc>) -> Result<(), Error> {
    match (protecting, presented) {
        (None, _) => Ok(()),
        (Some(_), None) => Err(Error::FencingTokenRequired),
        (Some(key), Some(request)) if request.cmp_time(key) == Ordering::Less => {
            Err(Error::FencingTokenLowerVersion)
        }
        (Some(_), Some(_)) => Ok(()),
    }
}

/// The token a key keeps after a SET that passed [`check`].
pub fn kept_after_set(protecting: Option<&Hlc>, presented: Option<&Hlc>) -> Option<Hlc> {
    match (protecting, presented) {
        (Some(key), Some(request)) if request.cmp_time(key) == Ordering::Greater => {
            Some(request.clone())
        }
        (Some(key), _) => Some(key.clone()),
        (None, request) => request.cloned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(s: &str) -> Hlc {
        s.parse().unwrap()
    }

    #[test]
    fn set_keeps_the_newer_token() {
        let a = h("100:1:n");
        let b = h("100:2:n");
        assert_eq!(kept_after_set(None, None), None);
        assert_eq!(kept_after_set(None, Some(&a)), Some(a.clone()));
        assert_eq!(kept_after_set(Some(&a), Some(&b)), Some(b.clone()));
        assert_eq!(kept_after_set(Some(&b), Some(&b)), Some(b.clone()));
        assert_eq!(kept_after_set(Some(&b), None), Some(b.clone()));
    }

    #[test]
    fn newer_token_passes() {
        assert_eq!(check(Some(&h("100:1:n")), Some(&h("101:0:m"))), Ok(()));
    }
}
