//! A running request's progress, as its worker writes it into the request's record so that
//! another worker can go on from there (resume). The moves it made are the result's
//! ([`super::result::Resumed`]).
//!
//! A checkpoint holds everything a generation needs to go on without its first worker: the
//! request as it runs, the conversation with every finished tool call and its result, the text
//! of the turn in progress, the output shown so far, the counts (tokens, tool iterations) and
//! the next event's sequence number. Every event a caller was sent is covered by the last
//! checkpoint written (the worker holds the events after a checkpoint until the next one is
//! stored), so a resumed run goes on from exactly what the caller saw. The events a checkpoint
//! lets go are in it too: a worker that dies after storing it and before they went out leaves
//! them to the run that takes it up, which sends them again under their own numbers.

use serde::{Deserialize, Serialize};

use super::{Event, GenerationRequest, Message, Signal, Usage};

/// A generation's progress, written into its live record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// The request as it runs (its checks passed when it was accepted).
    pub request: GenerationRequest,
    /// The conversation after the caller's messages up to the turn in progress: the model's
    /// turns, each finished tool call and its result. Tool calls in it never run again.
    pub conversation: Vec<Message>,
    /// What the model wrote so far in the turn in progress (empty between turns): the final
    /// assistant message a resumed run asks the backend to continue.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub partial: String,
    /// The part of `partial` shown as output (text written calls are not).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub partial_visible: String,
    /// The output so far (the caller saw all of it).
    pub output: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reasoning: String,
    #[serde(default)]
    pub truncated: bool,
    pub usage: Usage,
    pub tool_iterations_used: u32,
    pub tool_iterations_left: u32,
    /// The signals raised so far (published already).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub signals: Vec<Signal>,
    #[serde(default)]
    pub signals_dropped: u32,
    /// The sequence number the next event carries.
    pub next_seq: u64,
    /// The events this checkpoint lets go (held since the one before it, numbered up to
    /// `next_seq`): sent again by the run that takes the request up, since its worker may have
    /// died before they went out. A follower drops a number it has seen.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub released: Vec<Event>,
    /// How long the request had run (since it was accepted) when this was written.
    pub elapsed_ms: u64,
    /// From acceptance to its first token, if one came.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_token_ms: Option<u64>,
    /// The request's place in its chain.
    pub root_request_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_request_id: Option<String>,
    pub chain_position: u32,
}
