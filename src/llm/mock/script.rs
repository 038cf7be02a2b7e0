//! The mock server's script: the rules file types, how a request is matched against them, and
//! how a rule's reply text is templated and split into tokens.

use std::fmt;
use std::path::Path;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use super::conversation::Conversation;
use super::prefix_cache::PrefixCacheSettings;

/// Model name reported when the script does not set one.
pub const DEFAULT_MODEL: &str = "mock";

/// Tool-call argument fragment size (in chars) used when the rule chunks its text by words:
/// compact JSON has no whitespace, so word chunking would send the arguments in one piece and
/// leave a client's fragment reassembly untested.
const ARGUMENT_FRAGMENT_CHARS: usize = 8;

/// What the mock server answers, loaded from a TOML or JSON rules file or built in Rust.
///
/// A script is a list of [`Rule`]s tried in order; the first whose conditions all hold answers
/// the request. With no rule matching (or no rules at all) the server echoes the last user
/// message, so `Script::default()` is a usable echo server.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Script {
    /// Model name listed by `GET /v1/models` and used in replies when the request names none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// When set, `/v1/*` requests must carry `Authorization: Bearer <key>` (else 401).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// Reject any request carrying `tools` with a 400, as vLLM does without a tool parser.
    #[serde(skip_serializing_if = "is_false")]
    pub reject_tools: bool,
    /// Reject any request carrying `stream_options` with a 400, as some older servers do.
    #[serde(skip_serializing_if = "is_false")]
    pub reject_stream_options: bool,
    /// Refuse system messages as some chat templates do: `after_first` (a system message that
    /// is not the first message, as Gemma's template) or `all` (any system message).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reject_system: Option<RejectSystem>,
    /// Default delay before each generated chunk, for rules that set no `delay_ms`.
    #[serde(skip_serializing_if = "is_zero")]
    pub token_delay_ms: u64,
    /// A prefix cache (see [`PrefixCacheSettings`]); absent, none: every first token comes after
    /// the rules' delays alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_cache: Option<PrefixCacheSettings>,
    /// Rules, first match wins.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<Rule>,
}

/// One scripted answer and the conditions under which it is given.
///
/// Every condition that is set must hold; a rule without conditions matches every request.
/// Text comparisons are case-insensitive substring matches. Build rules in tests with
/// [`Rule::reply`], [`Rule::echo`], [`Rule::tool_call`] or [`Rule::error`] and the builder
/// methods, e.g. `Rule::reply("sunny").when_last_user_contains("weather").delay_ms(5)`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Rule {
    // ---- conditions ----
    /// The last message with role `user` contains this text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub when_last_user_contains: Option<String>,
    /// The last message (any role) has this role: `user`, `tool`, `assistant` or `system`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub when_last_role: Option<String>,
    /// The last message (any role) contains this text: tool results, correction turns.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub when_last_message_contains: Option<String>,
    /// Some message (system included) contains this text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub when_any_message_contains: Option<String>,
    /// 1-based turn: the number of assistant messages in the request plus one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub when_turn: Option<u32>,
    /// Whether the request carries a non-empty `tools` array.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub when_has_tools: Option<bool>,

    // ---- reply ----
    /// Assistant content; `{{last_user}}`, `{{last_message}}` and `{{turn}}` are substituted.
    /// Unset: the last user message is echoed, unless the rule has tool calls (then no content).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reply: Option<String>,
    /// Reasoning text, streamed as `delta.reasoning_content` before the content (templated too).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Native tool calls, sent after the content.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallSpec>,
    /// The reply text is repeated this many times (to simulate a model stuck in a loop).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repeat: Option<u32>,
    /// How text is split into stream chunks, each chunk counting as one token.
    #[serde(skip_serializing_if = "Chunking::is_default")]
    pub chunk: Chunking,
    /// Delay before each generated chunk; overrides the script's `token_delay_ms`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<u64>,
    /// Extra delay before the first chunk (time to first token).
    #[serde(skip_serializing_if = "is_zero")]
    pub first_token_delay_ms: u64,
    /// Forced finish reason; default `stop`, `tool_calls` with tool calls, `length` when
    /// `max_tokens` cut the reply.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<String>,
    /// Streaming: the response stops after at most this many generated chunks (reasoning,
    /// content and tool-call deltas; 0 = right after the role chunk) and never sends the
    /// finish chunk, usage or `[DONE]`, to simulate a dropped stream. Non-streaming: the
    /// connection is closed without a complete response.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub break_after: Option<u32>,
    /// With `break_after`: abort the connection (the client sees a transport error) instead of
    /// ending the body cleanly (the client sees an early end of stream).
    #[serde(skip_serializing_if = "is_false")]
    pub break_with_error: bool,
    /// Streaming: no chunk carries a finish reason; usage and `[DONE]` still end the stream, as
    /// some servers answer when a stop string ends the text (llama-cpp-python's).
    #[serde(skip_serializing_if = "is_false")]
    pub omit_finish_reason: bool,
    /// Answer with this HTTP status and an OpenAI error body instead of a completion.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Only the first N requests matching this rule fail with `status` (500 if unset); later
    /// ones get the rule's normal reply, to exercise retries.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fail_times: Option<u32>,
    /// Message of the scripted error body (e.g. a context-length error text).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_message: Option<String>,
    /// Reported usage, overriding the computed counts field by field.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageOverride>,
    /// Answer with this file's bytes exactly as recorded, whatever the request asked: an SSE
    /// transcript (`.sse`, sent as `text/event-stream` one event at a time, `delay_ms` before
    /// each) or any other body (sent as `application/json`), with `status` (default 200). A
    /// relative path is taken from the script file's directory (the working directory for a
    /// script not read from a file). The transcripts in `tests/data/backends/` are such files.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replay: Option<std::path::PathBuf>,
}

/// Which system messages a script's chat template refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectSystem {
    /// Only the first message may be a system message.
    AfterFirst,
    /// No message may be a system message.
    All,
}

/// A native tool call a rule makes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCallSpec {
    /// Call id; generated (`call_<n>_<i>`) when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Function name.
    pub name: String,
    /// Arguments: a JSON object/value is sent serialized; a string is sent verbatim, so tests
    /// can script malformed arguments.
    #[serde(default = "empty_object")]
    pub arguments: Value,
}

/// Usage numbers a rule forces into the reply; unset fields keep the computed value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UsageOverride {
    /// Replaces the estimate (message characters / 4).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    /// Replaces the count of generated chunks (+1 per tool call).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens: Option<u64>,
}

/// How reply text is cut into stream chunks; one chunk is one token for `max_tokens` and usage.
///
/// In files: `"word"` (a word with the whitespace after it), `"char"`, or a number N (N chars).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Chunking {
    #[default]
    Word,
    Char,
    Chars(usize),
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

impl Script {
    /// The echo script: every request is answered with the last user message, verbatim.
    pub fn echo() -> Script {
        Script::default()
    }

    /// A script made of these rules, all other settings default.
    pub fn new(rules: Vec<Rule>) -> Script {
        Script {
            rules,
            ..Script::default()
        }
    }

    /// Loads a rules file; the format follows the extension (`.toml` or `.json`).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Script, String> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read script {}: {e}", path.display()))?;
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        let parse = |text: &str| -> Result<Script, String> {
            match ext.as_deref() {
                Some("toml") => Ok(config::Config::builder()
                    .add_source(config::File::from_str(text, config::FileFormat::Toml))
                    .build()
                    .and_then(|c| c.try_deserialize())
                    .map_err(|e| e.to_string())?),
                Some("json") => serde_json::from_str(text).map_err(|e| e.to_string()),
                _ => Err("the script file name must end in .toml or .json".to_string()),
            }
        };
        let mut script = parse(&text).map_err(|e| format!("script {}: {e}", path.display()))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        for rule in &mut script.rules {
            if let Some(replay) = &mut rule.replay
                && replay.is_relative()
            {
                *replay = dir.join(&*replay);
            }
        }
        script
            .validate()
            .map_err(|e| format!("script {}: {e}", path.display()))?;
        Ok(script)
    }

    /// A script that answers every request with the recorded response in `path` (see
    /// [`Rule::replay`]).
    pub fn replay(path: impl Into<std::path::PathBuf>) -> Result<Script, String> {
        let script = Script::new(vec![Rule {
            replay: Some(path.into()),
            ..Rule::default()
        }]);
        script.validate()?;
        Ok(script)
    }

    /// Parses a TOML rules file.
    pub fn from_toml_str(text: &str) -> Result<Script, String> {
        let script: Script = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Toml))
            .build()
            .and_then(|c| c.try_deserialize())
            .map_err(|e| e.to_string())?;
        script.validate()?;
        Ok(script)
    }

    /// Parses a JSON rules file.
    pub fn from_json_str(text: &str) -> Result<Script, String> {
        let script: Script = serde_json::from_str(text).map_err(|e| e.to_string())?;
        script.validate()?;
        Ok(script)
    }

    /// Checks what serde cannot: statuses are error statuses, chunk sizes are positive.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(cache) = &self.prefix_cache {
            cache.validate()?;
        }
        for (i, rule) in self.rules.iter().enumerate() {
            let n = i + 1;
            if let Some(replay) = &rule.replay {
                if let Err(e) = std::fs::metadata(replay).and_then(|m| {
                    m.is_file()
                        .then_some(())
                        .ok_or_else(|| std::io::Error::other("not a file"))
                }) {
                    return Err(format!("rule {n}: cannot replay {}: {e}", replay.display()));
                }
                if let Some(status) = rule.status
                    && !(200..=599).contains(&status)
                {
                    return Err(format!("rule {n}: status {status} is not in 200..=599"));
                }
            } else if let Some(status) = rule.status
                && !(400..=599).contains(&status)
            {
                return Err(format!("rule {n}: status {status} is not in 400..=599"));
            }
            if rule.chunk == Chunking::Chars(0) {
                return Err(format!("rule {n}: chunk size must be at least 1"));
            }
            if rule.tool_calls.iter().any(|c| c.name.is_empty()) {
                return Err(format!("rule {n}: a tool call has an empty name"));
            }
        }
        Ok(())
    }

    /// Appends a rule (builder style).
    pub fn with_rule(mut self, rule: Rule) -> Script {
        self.rules.push(rule);
        self
    }

    /// Gives the server a prefix cache (builder style).
    pub fn with_prefix_cache(mut self, settings: PrefixCacheSettings) -> Script {
        self.prefix_cache = Some(settings);
        self
    }

    /// Sets the model name (builder style).
    pub fn with_model(mut self, model: impl Into<String>) -> Script {
        self.model = Some(model.into());
        self
    }

    /// Requires this API key (builder style).
    pub fn with_api_key(mut self, key: impl Into<String>) -> Script {
        self.api_key = Some(key.into());
        self
    }

    /// The model name to report.
    pub fn model_name(&self) -> &str {
        self.model.as_deref().unwrap_or(DEFAULT_MODEL)
    }

    /// The first rule matching the conversation, with its index.
    pub(super) fn select(&self, conv: &Conversation) -> Option<(usize, &Rule)> {
        self.rules.iter().enumerate().find(|(_, r)| r.matches(conv))
    }
}

impl Rule {
    /// Answers with this text.
    pub fn reply(text: impl Into<String>) -> Rule {
        Rule {
            reply: Some(text.into()),
            ..Rule::default()
        }
    }

    /// Echoes the last user message (the same as no rule matching).
    pub fn echo() -> Rule {
        Rule::default()
    }

    /// Answers with one native tool call and no content.
    pub fn tool_call(name: impl Into<String>, arguments: Value) -> Rule {
        Rule::default().with_tool_call(name, arguments)
    }

    /// Answers with this HTTP error status.
    pub fn error(status: u16) -> Rule {
        Rule {
            status: Some(status),
            ..Rule::default()
        }
    }

    // Builders below set the field of the same name; see the field docs for the meaning.

    pub fn when_last_user_contains(mut self, text: impl Into<String>) -> Rule {
        self.when_last_user_contains = Some(text.into());
        self
    }

    pub fn when_last_role(mut self, role: impl Into<String>) -> Rule {
        self.when_last_role = Some(role.into());
        self
    }

    pub fn when_last_message_contains(mut self, text: impl Into<String>) -> Rule {
        self.when_last_message_contains = Some(text.into());
        self
    }

    pub fn when_any_message_contains(mut self, text: impl Into<String>) -> Rule {
        self.when_any_message_contains = Some(text.into());
        self
    }

    pub fn when_turn(mut self, turn: u32) -> Rule {
        self.when_turn = Some(turn);
        self
    }

    pub fn when_has_tools(mut self, has_tools: bool) -> Rule {
        self.when_has_tools = Some(has_tools);
        self
    }

    pub fn with_reasoning(mut self, text: impl Into<String>) -> Rule {
        self.reasoning = Some(text.into());
        self
    }

    /// Adds a native tool call; a `Value::String` argument is sent verbatim.
    pub fn with_tool_call(mut self, name: impl Into<String>, arguments: Value) -> Rule {
        self.tool_calls.push(ToolCallSpec::new(name, arguments));
        self
    }

    pub fn with_tool_calls(mut self, calls: Vec<ToolCallSpec>) -> Rule {
        self.tool_calls.extend(calls);
        self
    }

    pub fn repeat(mut self, times: u32) -> Rule {
        self.repeat = Some(times);
        self
    }

    pub fn chunk(mut self, chunking: Chunking) -> Rule {
        self.chunk = chunking;
        self
    }

    pub fn delay_ms(mut self, ms: u64) -> Rule {
        self.delay_ms = Some(ms);
        self
    }

    pub fn first_token_delay_ms(mut self, ms: u64) -> Rule {
        self.first_token_delay_ms = ms;
        self
    }

    pub fn finish_reason(mut self, reason: impl Into<String>) -> Rule {
        self.finish_reason = Some(reason.into());
        self
    }

    pub fn break_after(mut self, chunks: u32) -> Rule {
        self.break_after = Some(chunks);
        self
    }

    pub fn omit_finish_reason(mut self) -> Rule {
        self.omit_finish_reason = true;
        self
    }

    pub fn break_with_error(mut self) -> Rule {
        self.break_with_error = true;
        self
    }

    pub fn status(mut self, status: u16) -> Rule {
        self.status = Some(status);
        self
    }

    pub fn fail_times(mut self, times: u32) -> Rule {
        self.fail_times = Some(times);
        self
    }

    pub fn error_message(mut self, message: impl Into<String>) -> Rule {
        self.error_message = Some(message.into());
        self
    }

    pub fn usage(mut self, prompt_tokens: u64, completion_tokens: u64) -> Rule {
        self.usage = Some(UsageOverride {
            prompt_tokens: Some(prompt_tokens),
            completion_tokens: Some(completion_tokens),
        });
        self
    }

    /// The error status this rule answers with, if any (`fail_times` alone implies 500).
    pub(super) fn error_status(&self) -> Option<u16> {
        self.status
            .or_else(|| self.fail_times.is_some().then_some(500))
    }

    pub(super) fn matches(&self, conv: &Conversation) -> bool {
        if let Some(needle) = &self.when_last_user_contains
            && !contains_ci(conv.last_user(), needle)
        {
            return false;
        }
        if let Some(role) = &self.when_last_role
            && !conv.last_role().eq_ignore_ascii_case(role)
        {
            return false;
        }
        if let Some(needle) = &self.when_last_message_contains
            && !contains_ci(conv.last_text(), needle)
        {
            return false;
        }
        if let Some(needle) = &self.when_any_message_contains
            && !conv.messages.iter().any(|m| contains_ci(&m.text, needle))
        {
            return false;
        }
        if let Some(turn) = self.when_turn
            && conv.turn() != turn
        {
            return false;
        }
        if let Some(has_tools) = self.when_has_tools
            && conv.has_tools != has_tools
        {
            return false;
        }
        true
    }
}

impl ToolCallSpec {
    pub fn new(name: impl Into<String>, arguments: Value) -> ToolCallSpec {
        ToolCallSpec {
            id: None,
            name: name.into(),
            arguments,
        }
    }

    /// The arguments string as sent on the wire.
    pub fn arguments_string(&self) -> String {
        match &self.arguments {
            Value::String(raw) => raw.clone(),
            other => other.to_string(),
        }
    }
}

impl Chunking {
    fn is_default(&self) -> bool {
        *self == Chunking::Word
    }

    /// Splits reply or reasoning text into tokens. `Word`: a token is a word with the
    /// whitespace after it (leading whitespace joins the first word).
    pub(super) fn split(self, text: &str) -> Vec<String> {
        match self {
            Chunking::Word => split_words(text),
            Chunking::Char => split_chars(text, 1),
            Chunking::Chars(n) => split_chars(text, n.max(1)),
        }
    }

    /// Splits a tool call's arguments string into streamed fragments.
    pub(super) fn split_arguments(self, text: &str) -> Vec<String> {
        match self {
            Chunking::Word => split_chars(text, ARGUMENT_FRAGMENT_CHARS),
            other => other.split(text),
        }
    }
}

fn split_words(text: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut start = 0;
    let mut prev_ws = false;
    let mut seen_word = false;
    for (i, c) in text.char_indices() {
        let ws = c.is_whitespace();
        if !ws && prev_ws && seen_word {
            tokens.push(text[start..i].to_string());
            start = i;
        }
        seen_word |= !ws;
        prev_ws = ws;
    }
    if start < text.len() {
        tokens.push(text[start..].to_string());
    }
    tokens
}

fn split_chars(text: &str, n: usize) -> Vec<String> {
    let mut tokens = Vec::with_capacity(text.len() / n + 1);
    let mut start = 0;
    for (count, (i, _)) in text.char_indices().enumerate() {
        if count > 0 && count % n == 0 {
            tokens.push(text[start..i].to_string());
            start = i;
        }
    }
    if start < text.len() {
        tokens.push(text[start..].to_string());
    }
    tokens
}

impl Serialize for Chunking {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Chunking::Word => s.serialize_str("word"),
            Chunking::Char => s.serialize_str("char"),
            Chunking::Chars(n) => s.serialize_u64(*n as u64),
        }
    }
}

impl<'de> Deserialize<'de> for Chunking {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Chunking, D::Error> {
        struct ChunkingVisitor;
        impl Visitor<'_> for ChunkingVisitor {
            type Value = Chunking;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("\"word\", \"char\" or a positive number of chars")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Chunking, E> {
                match v {
                    "word" => Ok(Chunking::Word),
                    "char" => Ok(Chunking::Char),
                    other => other
                        .parse::<u64>()
                        .map_err(|_| E::invalid_value(de::Unexpected::Str(other), &self))
                        .and_then(|n| self.visit_u64(n)),
                }
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Chunking, E> {
                if v == 0 {
                    return Err(E::invalid_value(de::Unexpected::Unsigned(0), &self));
                }
                Ok(Chunking::Chars(v as usize))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Chunking, E> {
                u64::try_from(v)
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
                    .and_then(|n| self.visit_u64(n))
            }
        }
        d.deserialize_any(ChunkingVisitor)
    }
}

fn contains_ci(haystack: &str, needle: &str) -> bool {
    if haystack.is_ascii() && needle.is_ascii() {
        let (h, n) = (haystack.as_bytes(), needle.as_bytes());
        return n.is_empty() || h.windows(n.len()).any(|w| w.eq_ignore_ascii_case(n));
    }
    haystack.to_lowercase().contains(&needle.to_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_split_keeps_whitespace_with_the_word() {
        assert_eq!(
            split_words("hello  big\nworld"),
            ["hello  ", "big\n", "world"]
        );
        assert_eq!(split_words("  lead x "), ["  lead ", "x "]);
        assert!(split_words("").is_empty());
        assert_eq!(split_chars("héllo", 2), ["hé", "ll", "o"]);
        assert_eq!(Chunking::Char.split("ab"), ["a", "b"]);
    }

    #[test]
    fn case_insensitive_contains() {
        assert!(contains_ci("The Weather today", "weather"));
        assert!(contains_ci("ÉTÉ chaud", "été"));
        assert!(!contains_ci("abc", "abd"));
    }
}
