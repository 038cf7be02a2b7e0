//! What the load is made of: requests whose reply length is known in advance, and the mock
//! backend's script that answers them.
//!
//! The mock echoes the last user message word by word (one word, one token), so a request
//! carrying N distinct words gets an N-token reply from any `genfleet mock-llm`, the
//! bench's own or one already running. The words are numbered so that no stretch of the reply
//! repeats: the loop detector must see ordinary text, not a chant.

use crate::protocol::GenerationRequest;

/// Requests whose last user message contains this are answered slowly by the bench's mock
/// (see [`mock_script`]), so they stay running while memory is measured.
pub const HOLD_MARKER: &str = "genfleet-bench-hold";
/// Delay between the tokens of a held request.
const HOLD_TOKEN_DELAY_MS: u64 = 500;
/// Requests whose last user message contains this make the bench's mock ask a manager for a
/// decision (`request_decision`, two options, the first the default); the continuation the
/// answer starts is answered with [`DECIDED_REPLY`].
pub const DECIDE_MARKER: &str = "genfleet-bench-decide";
/// What the mock answers a continuation (its last user message is the decision's note).
pub const DECIDED_REPLY: &str = "The manager chose, so the work goes on that way and ends here.";

/// `n` numbered words, each followed by a space: `w0 w1 w2 ...`.
pub fn words(n: usize) -> String {
    let mut text = String::with_capacity(n * 6);
    for i in 0..n {
        text.push('w');
        text.push_str(&i.to_string());
        text.push(' ');
    }
    text
}

/// A request whose reply (from the echoing mock) is `reply_tokens` tokens long.
pub fn request(request_id: String, reply_tokens: usize) -> GenerationRequest {
    let mut request = GenerationRequest::user(words(reply_tokens));
    request.request_id = Some(request_id);
    request.max_tokens = Some(max_tokens(reply_tokens));
    request
}

/// A request the bench's mock answers slowly, with a user message of about `prompt_bytes`.
pub fn held_request(request_id: String, prompt_bytes: usize) -> GenerationRequest {
    let mut text = format!("{HOLD_MARKER} ");
    let mut i = 0;
    while text.len() < prompt_bytes {
        text.push_str(&format!("h{i} "));
        i += 1;
    }
    let mut request = GenerationRequest::user(text);
    request.request_id = Some(request_id);
    request
}

/// Room above the expected reply, so `max_tokens` never cuts it (the default of
/// `generation.default_max_tokens` would, for long replies).
fn max_tokens(reply_tokens: usize) -> u32 {
    u32::try_from(reply_tokens + 16).unwrap_or(u32::MAX)
}

/// A request that asks a manager for a decision and, once answered, goes on as a
/// continuation ([`DECIDE_MARKER`]).
pub fn decision_request(request_id: String) -> GenerationRequest {
    let mut request = GenerationRequest::user(format!("{DECIDE_MARKER}: which way on?"));
    request.request_id = Some(request_id);
    request
}

/// The bench's mock script: echo everything after `token_delay_ms` per token, hold the
/// requests marked with [`HOLD_MARKER`], and ask for a decision where [`DECIDE_MARKER`] says
/// so.
pub fn mock_script(token_delay_ms: u64) -> String {
    let note = crate::protocol::task::DECISION_NOTE_PREFIX;
    format!(
        "token_delay_ms = {token_delay_ms}\n\n\
         [[rules]]\n\
         when_last_user_contains = \"{HOLD_MARKER}\"\n\
         delay_ms = {HOLD_TOKEN_DELAY_MS}\n\n\
         [[rules]]\n\
         when_last_user_contains = \"{note}\"\n\
         reply = \"{DECIDED_REPLY}\"\n\n\
         [[rules]]\n\
         when_last_user_contains = \"{DECIDE_MARKER}\"\n\
         reply = \"A manager should choose the way on.\"\n\
         tool_calls = [{{ name = \"request_decision\", arguments = {{ question = \"Which way on?\", \
         options = [{{ id = \"left\", label = \"Left\" }}, {{ id = \"right\", label = \"Right\" }}], \
         default_option = \"left\" }} }}]\n"
    )
}

/// Tokens in a reply as the echoing mock counts them (one per word).
pub fn count_tokens(text: &str) -> usize {
    text.split_whitespace().count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::mock::Script;

    #[test]
    fn a_request_asks_for_a_reply_of_the_given_length() {
        let request = request("r-1".into(), 2000);
        let text = request.messages[0].text();
        assert_eq!(count_tokens(&text), 2000);
        assert!(text.starts_with("w0 w1 ") && text.ends_with("w1999 "));
        assert_eq!(request.max_tokens, Some(2016));
        assert_eq!(request.request_id.as_deref(), Some("r-1"));
    }

    #[test]
    fn held_requests_carry_the_marker_and_the_asked_size() {
        let request = held_request("h".into(), 4096);
        let text = request.messages[0].text();
        assert!(text.starts_with(HOLD_MARKER));
        assert!((4096..4096 + 16).contains(&text.len()));
    }

    #[test]
    fn the_script_is_valid() {
        let script = Script::from_toml_str(&mock_script(3)).expect("parses");
        script.validate().expect("valid");
        assert_eq!(script.token_delay_ms, 3);
        assert_eq!(script.rules.len(), 3);
        assert_eq!(script.rules[2].tool_calls[0].name, "request_decision");
    }
}
