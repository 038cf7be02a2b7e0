//! A turn's control calls: the model raising signals, and perhaps asking for a decision.
//!
//! They are recorded as soon as they appear, whatever else the turn holds, so that a signal is
//! not lost when another call in the same message sends the model to a correction turn. Only an
//! invalid control call is held back, to be corrected like any other call.

use std::collections::BTreeMap;

use serde_json::json;

use crate::engine::control::{self, REQUEST_DECISION};

use super::Generation;
use super::calls::{ModelCall, Problem, argument_problems};
use super::ending::Stop;

/// What became of a turn's control calls.
pub(super) struct RecordedControls {
    /// Per call id: whether its signal was kept (`false`: the per-request bound dropped it).
    kept: BTreeMap<String, bool>,
    /// A decision was requested, and the request ends to wait for its answer.
    pub(super) awaits_decision: bool,
}

impl RecordedControls {
    /// What the model is told about a control call, so it knows when its signals stop counting.
    pub(super) fn ack(&self, call: &ModelCall) -> String {
        match self.kept.get(&call.id) {
            Some(false) => json!({"recorded": false, "reason": "signal limit reached"}).to_string(),
            _ => json!({"recorded": true}).to_string(),
        }
    }
}

impl Generation<'_> {
    /// Records each valid control call as a signal and adds the invalid ones to `problems`. A
    /// decision requested at the chain limit ends the request at once (`Err`).
    pub(super) async fn record_control_calls(
        &mut self,
        controls: &[ModelCall],
        problems: &mut Vec<Problem>,
    ) -> Result<RecordedControls, Stop> {
        let mut recorded = RecordedControls {
            kept: BTreeMap::new(),
            awaits_decision: false,
        };
        for call in controls {
            let tool = control::control_tool(&call.name).expect("partitioned as control");
            let arg_problems = argument_problems(tool, call);
            if !arg_problems.is_empty() {
                problems.extend(arg_problems);
                continue;
            }
            let wants_decision = call.name == REQUEST_DECISION && self.stop_on_decision();
            let at_chain_limit = self.at_chain_limit();
            let awaits = wants_decision && !at_chain_limit;
            match control::to_signal(&call.name, &call.arguments, &self.origin(), awaits) {
                Ok(mut signal) => {
                    if let Some(decision) = signal.decision.as_mut()
                        && let Some(expires_at) = self.decision_expiry()
                    {
                        decision.expires_at = Some(expires_at);
                    }
                    let kept = self.model_signal(signal).await;
                    if kept && wants_decision && at_chain_limit {
                        return Err(Stop::chain_limit());
                    }
                    recorded.awaits_decision |= kept && awaits;
                    recorded.kept.insert(call.id.clone(), kept);
                }
                Err(what) => problems.push(Problem {
                    call_id: Some(call.id.clone()),
                    tool: Some(call.name.clone()),
                    what,
                }),
            }
        }
        Ok(recorded)
    }
}
