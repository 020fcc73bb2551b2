//! The sequential model of one key: the `statestore` crate itself.
//!
//! The state of one key is small (absent, or a value and the fencing token
//! protecting it), so a step restores a fresh [`Store`] holding that state
//! ([`Store::restore`]), executes the request on it, and reads the new state
//! back from the writes it reports (every key is persisted, so every change
//! is reported). No `Clone` of a store is needed, and the answers are the
//! store's own, fencing and `NX`/`NEX`/`VDEL` rules included.
//!
//! Expiry is not modelled: the store runs at a fixed clock far in the future
//! of every `__ts` and `__ft` (so none is "too far in the future") and keys
//! keep no expiry.

use std::collections::HashMap;

use statestore::hlc::{Hlc, Version};
use statestore::persist::{Record, Write};
use statestore::resp3::encode_request;
use statestore::{Caller, Config, Error, Request, Store};

use crate::history::{Answer, Op};

/// The store's clock in every step: later than any real `__ts` or `__ft`.
const NOW_MS: u64 = 1 << 62;
/// The `__ts` of every request (a SET must carry one).
const TIMESTAMP: &str = "1:0:checker";

/// One key's state.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum KeyState {
    /// No such key.
    Absent,
    /// The key holds `value`, protected by `token` if there is one.
    Present { value: Vec<u8>, token: Option<Hlc> },
}

impl std::fmt::Display for KeyState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyState::Absent => f.write_str("absent"),
            KeyState::Present { value, token } => {
                write!(f, "{:?}", String::from_utf8_lossy(value))?;
                if let Some(token) = token {
                    write!(f, " (fencing token {token})")?;
                }
                Ok(())
            }
        }
    }
}

/// Whether a recorded `-ERR` answer is one the model gives from the key's
/// state or the request alone. Others (clock skew, quota, authorization,
/// errors of the broker or the client) depend on things outside one key;
/// the request was refused, so such an operation counts as `fail`.
pub(crate) fn is_modelled_error(text: &str) -> bool {
    let Some(reason) = text.strip_prefix("ERR ") else {
        return false;
    };
    [
        Error::FencingTokenRequired,
        Error::FencingTokenLowerVersion,
        Error::TimestampMalformed,
        Error::Syntax,
        Error::WrongNumberOfArguments,
        Error::KeyLengthZero,
    ]
    .iter()
    .any(|e| e.text() == reason)
}

/// Runs `op` on a store holding `state` under `key`: the answer and the new
/// state.
pub(crate) fn step(config: &Config, key: &str, state: &KeyState, op: &Op) -> (Answer, KeyState) {
    let records = match state {
        KeyState::Absent => Vec::new(),
        KeyState::Present { value, token } => vec![Record {
            key: key.as_bytes().to_vec(),
            value: value.clone(),
            version: Version {
                wall_ms: 1,
                counter: 0,
            },
            fencing_token: token.clone(),
            expires_at: None,
        }],
    };
    let (mut store, _) = Store::restore(config.clone(), records, None, NOW_MS);
    let payload = encode_request(&op.args());
    let request = Request {
        payload: &payload,
        timestamp: Some(TIMESTAMP),
        fencing_token: op.fencing_token(),
        persist: true,
        ..Request::default()
    };
    let caller = Caller {
        client_id: "checker",
        connection: 1,
        owner: "checker",
    };
    let out = store.execute(&request, caller, NOW_MS);
    let answer = Answer::from_resp3(&out.payload)
        .unwrap_or_else(|e| Answer::Error(format!("ERR the model's answer is not RESP3: {e}")));
    let mut next = state.clone();
    for write in out.writes {
        match write {
            Write::Put(record) => {
                next = KeyState::Present {
                    value: record.value,
                    token: record.fencing_token,
                }
            }
            Write::Delete(_) => next = KeyState::Absent,
            Write::ClockMark(_) => {}
        }
    }
    (answer, next)
}

/// The model of one key with its states interned and its steps memoized:
/// the search asks the same (state, operation) question many times.
pub(crate) struct KeyModel<'a> {
    config: Config,
    key: &'a str,
    states: Vec<KeyState>,
    ids: HashMap<KeyState, u32>,
    steps: HashMap<(u32, u32), Option<u32>>,
}

impl<'a> KeyModel<'a> {
    /// The model of `key`; state 0 is "absent".
    pub(crate) fn new(key: &'a str) -> Self {
        let mut model = KeyModel {
            config: Config::default(),
            key,
            states: Vec::new(),
            ids: HashMap::new(),
            steps: HashMap::new(),
        };
        model.intern(KeyState::Absent);
        model
    }

    fn intern(&mut self, state: KeyState) -> u32 {
        if let Some(&id) = self.ids.get(&state) {
            return id;
        }
        let id = self.states.len() as u32;
        self.states.push(state.clone());
        self.ids.insert(state, id);
        id
    }

    /// The state with id `id`.
    pub(crate) fn state(&self, id: u32) -> &KeyState {
        &self.states[id as usize]
    }

    /// What `op` answers in state `state`, and the state after it.
    pub(crate) fn run(&mut self, state: u32, op: &Op) -> (Answer, u32) {
        let (answer, next) = step(&self.config, self.key, &self.states[state as usize], op);
        (answer, self.intern(next))
    }

    /// The state after operation `index` (`op`, answered `answer`, or with
    /// an unknown answer: `None`) in state `state`, or `None` if the model
    /// answers otherwise there.
    pub(crate) fn step(
        &mut self,
        state: u32,
        index: u32,
        op: &Op,
        answer: Option<&Answer>,
    ) -> Option<u32> {
        if let Some(&cached) = self.steps.get(&(state, index)) {
            return cached;
        }
        let (model_answer, next) = self.run(state, op);
        let result = match answer {
            Some(answer) if *answer != model_answer => None,
            _ => Some(next),
        };
        self.steps.insert((state, index), result);
        result
    }
}
