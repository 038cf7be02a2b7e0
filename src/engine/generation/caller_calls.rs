//! The caller's own tools (`caller_tools`): the model may call them, the fleet never runs them.
//! A turn that calls one ends the generation COMPLETED `tool_calls`, and the caller continues
//! with a new request that holds the conversation and a `tool` message answering each call,
//! which is OpenAI's tool round trip.
//!
//! A turn may mix the caller's calls with bus and control calls. The bus calls run first, as
//! in any turn, because their answers cannot wait for the caller: the conversation the result
//! hands back is complete but for the caller's answers. Its last assistant message holds every
//! call of the turn in OpenAI's shape (in text mode too, each with an id), followed by a `tool`
//! message for each bus and control call; the result's `tool_calls` lists only the caller's.

use crate::protocol::{Message, Reason};

use super::Generation;
use super::calls::ModelCall;
use super::control_calls::RecordedControls;
use super::ending::Stop;
use super::tools::tool_answers;
use super::turn::Turn;

/// A turn's calls, sorted by who answers them.
pub(super) struct TurnCalls<'c> {
    /// Every call in the order the model made them.
    pub(super) all: &'c [ModelCall],
    pub(super) bus: &'c [ModelCall],
    pub(super) controls: &'c [ModelCall],
    pub(super) caller: &'c [ModelCall],
}

impl Generation<'_> {
    /// Ends the generation on a turn that called the caller's tools: the turn's bus calls run
    /// within the budget, every call but the caller's is answered, and the caller's calls
    /// become the result's `tool_calls`. The turn's assistant message is the conversation's
    /// last message when this is called.
    pub(super) async fn end_with_caller_calls(
        &mut self,
        turn: &Turn,
        calls: TurnCalls<'_>,
        recorded: &RecordedControls,
    ) -> Stop {
        // In text mode the turn went into the conversation as the model wrote it; the caller
        // needs the calls as OpenAI shapes them, with ids to answer.
        let message = self.calls_message(turn, calls.all);
        if let Some(last) = self.transcript.conversation.last_mut() {
            *last = message.clone();
        }
        let replies = if calls.bus.is_empty() {
            Vec::new()
        } else {
            match self.run_within_budget(calls.bus).await {
                Ok(replies) => replies,
                Err(stop) => return stop,
            }
        };
        for (call, content) in tool_answers(calls.bus, calls.controls, recorded, replies) {
            self.transcript
                .conversation
                .push(Message::tool(call.id.clone(), content));
        }
        for call in calls.caller {
            self.announce_call(call).await;
        }
        self.transcript.caller_calls = message
            .tool_calls
            .into_iter()
            .filter(|c| calls.caller.iter().any(|k| k.id == c.id))
            .collect();
        Stop::plain(Reason::ToolCalls)
    }
}
