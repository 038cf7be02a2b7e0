//! Tool calls written as text by models without (reliable) native tool calling.
//!
//! genfleet streams the assistant text of a turn to its caller while it is generated. Some models
//! write their tool calls into that text instead of using the native `tool_calls` channel, so the
//! worker runs every delta through a [`TextCallParser`]: it passes on the text the user may see as
//! early as it can, keeps back whatever might still turn out to be a call, and at the end of the
//! turn hands over the calls (and the attempts that were not valid calls) in the order written.
//!
//! Recognised forms (the vectors in `tests/data/text_tool_calls.json` are the specification):
//!
//! * `<tool_call>{...}</tool_call>` blocks (Hermes/Qwen style), anywhere, any number of them; the
//!   closing tag may be missing at the end of the stream. The JSON inside is scanned with string
//!   and escape awareness, so braces or a literal `</tool_call>` inside a string do not end it.
//! * Text mode only: a fenced block (```` ```json ```` or a fence without language) whose content
//!   is exactly one call object or one `{"tool_calls": [...]}` object.
//! * Text mode only: a bare call object `{"name": ..., "arguments": ...}` that is the whole message.
//! * `{"tool_calls": [...]}` starting a line and followed by nothing but whitespace on that line
//!   (this covers the whole-message case).
//!
//! Everything else is visible text. The parser works byte by byte with a small state machine and
//! never rescans: each byte is examined a bounded number of times, the only buffer is the current
//! candidate (bounded by `max_candidate_bytes`), and serde_json is called once per complete object.
//! Because decisions depend only on the bytes, never on where deltas are cut, the verdict is the
//! same however the stream is split.

use serde_json::{Map, Value};

use crate::protocol::text::head_bytes;

/// Which text forms count as tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseMode {
    /// The model has no native tool calls: every form is recognised.
    Text,
    /// The model also has native tool calls: only `<tool_call>` blocks and `{"tool_calls": [...]}`
    /// objects are recognised, since a fenced or bare JSON object is far more likely to be an
    /// answer than a call.
    Native,
}

/// A call found in the text.
#[derive(Debug, Clone, PartialEq)]
pub struct TextToolCall {
    /// Only OpenAI-shaped items (`{"id", "type", "function"}`) carry an id.
    pub id: Option<String>,
    pub name: String,
    pub arguments: Map<String, Value>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InvalidCallKind {
    /// The text inside a `<tool_call>` block is not parseable JSON (or not JSON at all).
    Malformed,
    /// Parseable JSON that is not a valid call object (extra keys, arguments not an object, ...).
    InvalidCall,
}

/// A call attempt that could not be used; the engine answers it with a correction turn.
#[derive(Debug, Clone, PartialEq)]
pub struct InvalidTextCall {
    pub kind: InvalidCallKind,
    /// The offending text, truncated to [`MAX_RAW_BYTES`] on a char boundary.
    pub raw: String,
    /// Why it was rejected, phrased so that it can be shown to the model.
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ParsedItem {
    Call(TextToolCall),
    Invalid(InvalidTextCall),
}

/// Default bound on a held-back candidate; a call bigger than this is not plausible and keeping
/// more would let one runaway generation grow the worker's memory without limit.
pub const DEFAULT_MAX_CANDIDATE_BYTES: usize = 256 * 1024;

/// Bound on [`InvalidTextCall::raw`]: enough for the model to recognise its mistake in the
/// correction turn without echoing a huge blob back.
pub const MAX_RAW_BYTES: usize = 2 * 1024;

const OPEN_TAG: &[u8] = b"<tool_call>";
const CLOSE_TAG: &[u8] = b"</tool_call>";

/// First keys that may begin a fenced or message-initial call candidate.
const CANDIDATE_KEYS: &[&str] = &["name", "arguments", "parameters", "tool_calls"];
/// First key that may begin a line-start `{"tool_calls": ...}` candidate.
const WRAPPER_KEYS: &[&str] = &["tool_calls"];

/// Deepest nesting the scanner follows. serde_json refuses more than 128 levels anyway, and
/// the cap keeps the bracket stack bounded while an oversize block is skipped without storing it.
const MAX_DEPTH: usize = 256;

const REASON_EMPTY: &str = "empty <tool_call> block: it must hold one JSON call object";
const REASON_NOT_JSON: &str = "expected a JSON object after <tool_call>";
const REASON_JUNK: &str = "unexpected text after the JSON object inside a <tool_call> block";

/// Separates the tool calls from the visible text in the streamed text of one assistant turn.
///
/// Feed every delta to [`push`](Self::push) and call [`finish`](Self::finish) at the end of the
/// turn. After `finish` the parser is reset and may be used for another turn.
#[derive(Debug)]
pub struct TextCallParser {
    mode: ParseMode,
    limit: usize,
    state: State,
    /// The candidate held back from the visible text (for blocks: the current JSON value or the
    /// non-JSON content, which becomes `raw` of an invalid call).
    held: Vec<u8>,
    /// Visible bytes not yet handed to the caller; flushed at the end of every `push`.
    pending: Vec<u8>,
    items: Vec<ParsedItem>,
    /// Only whitespace since the start of the message (a bare call must be the whole message).
    message_ws_only: bool,
    /// Only horizontal whitespace since the last newline (fences and `{"tool_calls"` start lines).
    line_ws_only: bool,
    /// Text mode: inside a ``` fence that turned out to be visible text, so the next ``` line
    /// closes it rather than opening a call candidate.
    in_visible_fence: bool,
    /// Values (objects or arrays) completed in the current `<tool_call>` block.
    block_values: usize,
    /// The current block value outgrew the limit and was reported; keep scanning its structure
    /// (to find where it ends) without storing it.
    discard: bool,
}

#[derive(Debug)]
enum State {
    Prose,
    /// `held` is a proper prefix of `<tool_call>`.
    TagPrefix {
        matched: usize,
    },
    /// After `<tool_call>`, before its content.
    BlockStart,
    BlockJson(JsonScan),
    /// Non-JSON content of a block (or a partial tag after its JSON) up to a closing or opening
    /// tag. `junk` is the reason to report, once the content is known not to be just a tag.
    BlockSkip {
        tags: TagMatcher,
        junk: Option<String>,
    },
    /// After a complete value inside a block.
    BlockAfter,
    /// A run of backticks at the start of a line (text mode).
    FenceTicks {
        count: usize,
    },
    /// The info string of a fence; `matched` counts the bytes of `json` seen.
    FenceInfo {
        ticks: usize,
        matched: usize,
        word_done: bool,
    },
    /// Inside a `json`/plain fence, before its first non-whitespace byte.
    FenceContent {
        ticks: usize,
    },
    FenceJson {
        ticks: usize,
        obj_start: usize,
        scan: JsonScan,
    },
    /// After a call object inside a fence: waiting for the closing fence line.
    FenceAfter {
        ticks: usize,
        items: Vec<ParsedItem>,
        close_ticks: usize,
        run_done: bool,
    },
    /// A `{` at the start of the message (text mode, `whole_message`) or of a line.
    ObjJson {
        whole_message: bool,
        scan: JsonScan,
    },
    /// After a recognised object: `line_rule` accepts at the end of the line, otherwise only
    /// whitespace may follow until the end of the message.
    ObjAfter {
        line_rule: bool,
        items: Vec<ParsedItem>,
    },
    /// A backtick run at the start of a line inside a visible fence (emitted as it comes).
    VisibleTicks {
        count: usize,
    },
}

/// What to do with the byte after a state has handled it.
enum Flow {
    Next,
    /// The state changed without consuming the byte; handle it again in the new state.
    Again,
}

impl TextCallParser {
    pub fn new(mode: ParseMode) -> Self {
        Self::with_limit(mode, DEFAULT_MAX_CANDIDATE_BYTES)
    }

    /// `max_candidate_bytes` bounds the text held back while undecided; a larger candidate is
    /// released as visible text, or inside a `<tool_call>` block reported as malformed.
    pub fn with_limit(mode: ParseMode, max_candidate_bytes: usize) -> Self {
        TextCallParser {
            mode,
            limit: max_candidate_bytes.max(1),
            state: State::Prose,
            held: Vec::new(),
            pending: Vec::new(),
            items: Vec::new(),
            message_ws_only: true,
            line_ws_only: true,
            in_visible_fence: false,
            block_values: 0,
            discard: false,
        }
    }

    /// Whether nothing is held back undecided: every byte fed so far was released as visible
    /// text (or reported as a call). A parser fed the same text again from new ends in the
    /// same state, so a turn cut here can be picked up by feeding its text to a new parser.
    pub fn at_rest(&self) -> bool {
        matches!(self.state, State::Prose) && self.held.is_empty() && self.pending.is_empty()
    }

    /// Feeds a delta and appends the text now known to be visible to `visible`.
    pub fn push(&mut self, delta: &str, visible: &mut String) {
        let bytes = delta.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            if matches!(self.state, State::Prose) {
                // Fast path for ordinary prose: copy the run up to the next byte that may start
                // a candidate or end a line. (The run may begin inside a char whose first byte
                // was just released from a candidate, so it is handled as bytes.)
                let run = bytes[i..]
                    .iter()
                    .position(|&b| matches!(b, b'<' | b'{' | b'`' | b'\n'))
                    .unwrap_or(bytes.len() - i);
                if run > 0 {
                    let chunk = &bytes[i..i + run];
                    if self.line_ws_only && chunk.iter().any(|b| !matches!(b, b' ' | b'\t' | b'\r'))
                    {
                        self.line_ws_only = false;
                        self.message_ws_only = false;
                    }
                    self.pending.extend_from_slice(chunk);
                    i += run;
                    continue;
                }
            }
            self.feed(bytes[i]);
            i += 1;
        }
        self.flush(visible, false);
    }

    /// Ends the turn: appends the remaining visible text to `visible` and returns the calls and
    /// invalid calls in the order they were written.
    pub fn finish(&mut self, visible: &mut String) -> Vec<ParsedItem> {
        self.end_of_stream();
        self.flush(visible, true);
        let items = std::mem::take(&mut self.items);
        *self = Self::with_limit(self.mode, self.limit);
        items
    }

    fn feed(&mut self, b: u8) {
        // A byte is handled again only after a state change that did not consume it; every such
        // chain ends within three steps in a state that does (prose consumes everything).
        while let Flow::Again = self.step(b) {}
        if self.held.len() > self.limit {
            self.overflow();
        }
        match b {
            b'\n' => self.line_ws_only = true,
            b' ' | b'\t' | b'\r' => {}
            _ => {
                self.line_ws_only = false;
                self.message_ws_only = false;
            }
        }
    }

    fn step(&mut self, b: u8) -> Flow {
        let text = self.mode == ParseMode::Text;
        match &mut self.state {
            State::Prose => {
                match b {
                    b'<' => {
                        self.held.push(b);
                        self.state = State::TagPrefix { matched: 1 };
                    }
                    b'{' if text && self.message_ws_only => {
                        self.held.push(b);
                        let scan = JsonScan::new(b, Some(CANDIDATE_KEYS));
                        self.state = State::ObjJson {
                            whole_message: true,
                            scan,
                        };
                    }
                    b'{' if self.line_ws_only => {
                        self.held.push(b);
                        let scan = JsonScan::new(b, Some(WRAPPER_KEYS));
                        self.state = State::ObjJson {
                            whole_message: false,
                            scan,
                        };
                    }
                    b'`' if text && self.line_ws_only => {
                        if self.in_visible_fence {
                            self.pending.push(b);
                            self.state = State::VisibleTicks { count: 1 };
                        } else {
                            self.held.push(b);
                            self.state = State::FenceTicks { count: 1 };
                        }
                    }
                    _ => self.pending.push(b),
                }
                Flow::Next
            }
            State::TagPrefix { matched } => {
                if b != OPEN_TAG[*matched] {
                    return self.release(false);
                }
                *matched += 1;
                if *matched == OPEN_TAG.len() {
                    self.held.clear();
                    self.start_block();
                } else {
                    self.held.push(b);
                }
                Flow::Next
            }
            State::BlockStart | State::BlockAfter => {
                match b {
                    b' ' | b'\t' | b'\r' | b'\n' => {}
                    b'{' | b'[' => {
                        self.held.clear();
                        self.held.push(b);
                        self.discard = false;
                        self.state = State::BlockJson(JsonScan::new(b, None));
                    }
                    _ => {
                        self.held.clear();
                        self.state = State::BlockSkip {
                            tags: TagMatcher::default(),
                            junk: None,
                        };
                        return Flow::Again;
                    }
                }
                Flow::Next
            }
            State::BlockJson(scan) => {
                let step = scan.step(b);
                if !self.discard {
                    self.held.push(b);
                }
                match step {
                    ScanStep::More => {}
                    ScanStep::Done => {
                        self.block_value_done();
                        self.state = State::BlockAfter;
                    }
                    ScanStep::Reject => {
                        // A mismatched bracket or absurd nesting: the structure is lost, so the
                        // rest of the block can only be skipped up to a tag.
                        let reason = if self.discard {
                            String::new()
                        } else {
                            json_error(&self.held)
                        };
                        self.block_values += 1;
                        self.state = State::BlockSkip {
                            tags: TagMatcher::default(),
                            junk: Some(reason),
                        };
                    }
                }
                Flow::Next
            }
            State::BlockSkip { tags, junk } => {
                if !self.discard {
                    self.held.push(b);
                }
                match tags.feed(b) {
                    TagHit::Partial => {}
                    TagHit::Idle => {
                        if junk.is_none() {
                            let reason = if self.block_values == 0 {
                                REASON_NOT_JSON
                            } else {
                                REASON_JUNK
                            };
                            *junk = Some(reason.to_string());
                        }
                    }
                    TagHit::Close => {
                        let junk = junk.take();
                        self.end_skip(junk, CLOSE_TAG.len());
                        self.state = State::Prose;
                    }
                    TagHit::Open => {
                        // A new block while this one was never closed: close it implicitly.
                        let junk = junk.take();
                        self.end_skip(junk, OPEN_TAG.len());
                        self.start_block();
                    }
                }
                Flow::Next
            }
            State::FenceTicks { count } => {
                if b == b'`' {
                    self.held.push(b);
                    *count += 1;
                    Flow::Next
                } else if *count >= 3 {
                    let ticks = *count;
                    self.state = State::FenceInfo {
                        ticks,
                        matched: 0,
                        word_done: false,
                    };
                    Flow::Again
                } else {
                    self.release(false)
                }
            }
            State::FenceInfo {
                ticks,
                matched,
                word_done,
            } => match b {
                b'\n' if *matched == 0 || *matched == 4 => {
                    self.held.push(b);
                    let ticks = *ticks;
                    self.state = State::FenceContent { ticks };
                    Flow::Next
                }
                b' ' | b'\t' | b'\r' => {
                    self.held.push(b);
                    *word_done |= *matched > 0;
                    Flow::Next
                }
                _ if !*word_done && *matched < 4 && b.to_ascii_lowercase() == b"json"[*matched] => {
                    self.held.push(b);
                    *matched += 1;
                    Flow::Next
                }
                // Another language (or inline code such as ```x```): ordinary text.
                _ => self.release(b != b'`'),
            },
            State::FenceContent { ticks } => match b {
                b' ' | b'\t' | b'\r' | b'\n' => {
                    self.held.push(b);
                    Flow::Next
                }
                b'{' => {
                    let ticks = *ticks;
                    let obj_start = self.held.len();
                    self.held.push(b);
                    let scan = JsonScan::new(b, Some(CANDIDATE_KEYS));
                    self.state = State::FenceJson {
                        ticks,
                        obj_start,
                        scan,
                    };
                    Flow::Next
                }
                _ => self.release(true),
            },
            State::FenceJson {
                ticks,
                obj_start,
                scan,
            } => match scan.step(b) {
                ScanStep::More => {
                    self.held.push(b);
                    Flow::Next
                }
                ScanStep::Reject => self.release(true),
                ScanStep::Done => {
                    self.held.push(b);
                    let ticks = *ticks;
                    match candidate_items(&self.held[*obj_start..], true) {
                        Some((items, _)) => {
                            self.state = State::FenceAfter {
                                ticks,
                                items,
                                close_ticks: 0,
                                run_done: false,
                            };
                            Flow::Next
                        }
                        None => {
                            self.release(true);
                            Flow::Next
                        }
                    }
                }
            },
            State::FenceAfter {
                ticks,
                close_ticks,
                run_done,
                ..
            } => {
                let horizontal = matches!(b, b' ' | b'\t' | b'\r');
                if *close_ticks == 0 {
                    if horizontal || b == b'\n' {
                        self.held.push(b);
                        return Flow::Next;
                    }
                    if b == b'`' && self.line_ws_only {
                        self.held.push(b);
                        *close_ticks = 1;
                        return Flow::Next;
                    }
                    return self.release(true);
                }
                if b == b'`' && !*run_done {
                    self.held.push(b);
                    *close_ticks += 1;
                    return Flow::Next;
                }
                if *close_ticks < *ticks {
                    return self.release(true);
                }
                if horizontal {
                    self.held.push(b);
                    *run_done = true;
                    return Flow::Next;
                }
                if b == b'\n' {
                    self.accept();
                    return Flow::Again;
                }
                self.release(true)
            }
            State::ObjJson {
                whole_message,
                scan,
            } => match scan.step(b) {
                ScanStep::More => {
                    self.held.push(b);
                    Flow::Next
                }
                ScanStep::Reject => self.release(false),
                ScanStep::Done => {
                    self.held.push(b);
                    match candidate_items(&self.held, *whole_message) {
                        Some((items, is_wrapper)) => {
                            self.state = State::ObjAfter {
                                line_rule: is_wrapper,
                                items,
                            };
                        }
                        None => {
                            self.release(false);
                        }
                    }
                    Flow::Next
                }
            },
            State::ObjAfter { line_rule, .. } => match b {
                b' ' | b'\t' | b'\r' => {
                    self.held.push(b);
                    Flow::Next
                }
                b'\n' if *line_rule => {
                    self.accept();
                    Flow::Again
                }
                b'\n' => {
                    self.held.push(b);
                    Flow::Next
                }
                _ => self.release(false),
            },
            State::VisibleTicks { count } => {
                if b == b'`' {
                    self.pending.push(b);
                    *count += 1;
                    Flow::Next
                } else {
                    if *count >= 3 {
                        self.in_visible_fence = false;
                    }
                    self.state = State::Prose;
                    Flow::Again
                }
            }
        }
    }

    fn start_block(&mut self) {
        self.block_values = 0;
        self.discard = false;
        self.state = State::BlockStart;
    }

    /// Emits the held candidate as visible text; the current byte is then handled as prose.
    /// `fence` marks a released ``` fence opening, whose closing line must not open a candidate.
    fn release(&mut self, fence: bool) -> Flow {
        self.pending.extend_from_slice(&self.held);
        self.held.clear();
        if fence {
            self.in_visible_fence = true;
        }
        self.state = State::Prose;
        Flow::Again
    }

    /// The held candidate is a recognised call: keep its items, drop its text.
    fn accept(&mut self) {
        if let State::ObjAfter { items, .. } | State::FenceAfter { items, .. } = &mut self.state {
            self.items.append(items);
        }
        self.held.clear();
        self.state = State::Prose;
    }

    fn block_value_done(&mut self) {
        self.block_values += 1;
        if !self.discard {
            match serde_json::from_slice::<Value>(&self.held) {
                Ok(value) => {
                    let raw = &self.held;
                    block_items(value, raw, &mut self.items);
                }
                Err(e) => self.items.push(invalid(
                    InvalidCallKind::Malformed,
                    &self.held,
                    e.to_string(),
                )),
            }
        }
        self.held.clear();
        self.discard = false;
    }

    /// A skipped stretch of a block ended with a tag of `tag_len` bytes (held with it).
    fn end_skip(&mut self, junk: Option<String>, tag_len: usize) {
        if !self.discard {
            let content = &self.held[..self.held.len().saturating_sub(tag_len)];
            let reason = match junk {
                Some(reason) => Some(reason),
                None if self.block_values == 0 => Some(REASON_EMPTY.to_string()),
                None => None,
            };
            if let Some(reason) = reason {
                let item = invalid(InvalidCallKind::Malformed, content, reason);
                self.items.push(item);
            }
        }
        self.held.clear();
        self.discard = false;
    }

    fn overflow(&mut self) {
        match self.state {
            State::BlockJson(_) | State::BlockSkip { .. } => {
                let reason = format!(
                    "tool call exceeds the {}-byte limit for text tool calls",
                    self.limit
                );
                let item = invalid(InvalidCallKind::Malformed, &self.held, reason);
                self.items.push(item);
                if let State::BlockJson(_) = self.state {
                    // Counted now so that the block's end does not report it again.
                    self.block_values += 1;
                }
                if let State::BlockSkip { junk, .. } = &mut self.state {
                    junk.get_or_insert_with(String::new);
                }
                self.held.clear();
                self.discard = true;
            }
            State::FenceInfo { .. }
            | State::FenceContent { .. }
            | State::FenceJson { .. }
            | State::FenceAfter { .. } => {
                self.release(true);
            }
            _ => {
                self.release(false);
            }
        }
    }

    fn end_of_stream(&mut self) {
        match std::mem::replace(&mut self.state, State::Prose) {
            State::Prose | State::BlockAfter | State::VisibleTicks { .. } => {}
            State::TagPrefix { .. }
            | State::FenceTicks { .. }
            | State::FenceInfo { .. }
            | State::FenceContent { .. }
            | State::FenceJson { .. }
            | State::ObjJson { .. } => {
                self.release(false);
            }
            state @ (State::FenceAfter { .. } | State::ObjAfter { .. }) => {
                // Only whitespace followed the object, or a fenced call lacks (the end of) its
                // closing fence: tolerated at the end of the stream like a missing closing tag.
                self.state = state;
                self.accept();
            }
            State::BlockStart => {
                if self.block_values == 0 {
                    let item = invalid(InvalidCallKind::Malformed, b"", REASON_EMPTY.to_string());
                    self.items.push(item);
                }
            }
            State::BlockJson(_) => self.block_value_done(),
            State::BlockSkip { junk, .. } => self.end_skip(junk, 0),
        }
        self.held.clear();
    }

    /// Hands the pending visible bytes over as a `&str`. Deltas are whole `&str`s and removed
    /// stretches begin and end on ASCII bytes, so the pending bytes are always valid UTF-8 at
    /// this point; an incomplete tail would only be kept for the next call, to be safe.
    fn flush(&mut self, visible: &mut String, last: bool) {
        match std::str::from_utf8(&self.pending) {
            Ok(s) => {
                visible.push_str(s);
                self.pending.clear();
            }
            Err(e) => {
                let valid = e.valid_up_to();
                visible.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                if last || e.error_len().is_some() {
                    visible.push_str(&String::from_utf8_lossy(&self.pending[valid..]));
                    self.pending.clear();
                } else {
                    self.pending.drain(..valid);
                }
            }
        }
    }
}

/// Parses a whole text at once (tests, non-streamed replies).
pub fn parse_complete(mode: ParseMode, text: &str) -> (String, Vec<ParsedItem>) {
    let mut parser = TextCallParser::new(mode);
    let mut visible = String::new();
    parser.push(text, &mut visible);
    let items = parser.finish(&mut visible);
    (visible, items)
}

/// The arguments of a call: an object, a string holding a JSON object (as OpenAI sends them), or
/// null/absent (no arguments) → an empty object. Anything else is an error saying why; the engine
/// reuses this for the argument strings of native tool calls.
pub fn parse_arguments(raw: &Value) -> Result<Map<String, Value>, String> {
    match raw {
        Value::Object(map) => Ok(map.clone()),
        Value::Null => Ok(Map::new()),
        Value::String(s) if s.trim().is_empty() => Ok(Map::new()),
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(map)) => Ok(map),
            Ok(other) => Err(format!(
                "arguments string holds {}, not a JSON object",
                describe(&other)
            )),
            Err(e) => Err(format!("arguments string is not valid JSON: {e}")),
        },
        other => Err(format!(
            "arguments must be a JSON object, got {}",
            describe(other)
        )),
    }
}

fn describe(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// One call object: `{"name", "arguments"|"parameters"}`, or OpenAI's
/// `{"id", "type": "function", "function": {...}}`. Any other key makes it invalid: a model that
/// adds e.g. a `message` beside the call probably meant something the call does not say.
fn normalize_call(value: Value) -> Result<TextToolCall, String> {
    let Value::Object(map) = value else {
        return Err(format!("expected a call object, got {}", describe(&value)));
    };
    if !map.contains_key("function") {
        return normalize_plain(map, None);
    }
    if let Some(key) = map
        .keys()
        .find(|k| !matches!(k.as_str(), "id" | "type" | "function"))
    {
        return Err(format!(
            "unexpected key `{key}` beside id, type and function"
        ));
    }
    match map.get("type") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if t == "function" => {}
        Some(other) => return Err(format!("`type` must be \"function\", got {other}")),
    }
    let id = match map.get("id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) => Some(id.clone()),
        Some(other) => return Err(format!("`id` must be a string, got {}", describe(other))),
    };
    match map.get("function") {
        Some(Value::Object(function)) => normalize_plain(function.clone(), id),
        other => Err(format!(
            "`function` must be an object, got {}",
            describe(other.unwrap_or(&Value::Null))
        )),
    }
}

fn normalize_plain(map: Map<String, Value>, id: Option<String>) -> Result<TextToolCall, String> {
    if let Some(key) = map
        .keys()
        .find(|k| !matches!(k.as_str(), "name" | "arguments" | "parameters"))
    {
        return Err(format!("unexpected key `{key}` beside name and arguments"));
    }
    let name = match map.get("name") {
        Some(Value::String(name)) if !name.trim().is_empty() => name.clone(),
        Some(Value::String(_)) => return Err("`name` is empty".to_string()),
        Some(other) => return Err(format!("`name` must be a string, got {}", describe(other))),
        None => return Err("missing `name`".to_string()),
    };
    let args = match (map.get("arguments"), map.get("parameters")) {
        (Some(_), Some(_)) => return Err("both `arguments` and `parameters` given".to_string()),
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => &Value::Null,
    };
    let arguments = parse_arguments(args)?;
    Ok(TextToolCall {
        id,
        name,
        arguments,
    })
}

fn item_from(value: Value, raw: &[u8]) -> ParsedItem {
    match normalize_call(value) {
        Ok(call) => ParsedItem::Call(call),
        Err(reason) => invalid(InvalidCallKind::InvalidCall, raw, reason),
    }
}

/// An item of a list of calls; its raw text is re-serialised since it is part of a larger value.
fn list_item(value: Value) -> ParsedItem {
    let raw = value.to_string();
    item_from(value, raw.as_bytes())
}

/// The items of a parsed `<tool_call>` value: a call object, a `{"tool_calls": [...]}` object or
/// an array of calls. Anything inside a block was meant as a call, so every shape that is not a
/// call is an invalid call rather than text.
fn block_items(value: Value, raw: &[u8], out: &mut Vec<ParsedItem>) {
    match value {
        Value::Array(list) => out.extend(list.into_iter().map(list_item)),
        Value::Object(mut map) if map.len() == 1 && map.contains_key("tool_calls") => {
            match map.remove("tool_calls") {
                Some(Value::Array(list)) => out.extend(list.into_iter().map(list_item)),
                _ => out.push(invalid(
                    InvalidCallKind::InvalidCall,
                    raw,
                    "`tool_calls` must be an array".to_string(),
                )),
            }
        }
        value => out.push(item_from(value, raw)),
    }
}

/// Decides whether a complete fenced, message-initial or line-start object is a call. Outside a
/// block a JSON object is only a call if it has exactly a call's shape; anything else (an answer
/// that happens to be JSON, malformed JSON) is ordinary text. Returns the items and whether the
/// object was a `{"tool_calls": [...]}` wrapper.
fn candidate_items(text: &[u8], allow_bare_call: bool) -> Option<(Vec<ParsedItem>, bool)> {
    let Ok(Value::Object(mut map)) = serde_json::from_slice::<Value>(text) else {
        return None;
    };
    if map.len() == 1 && matches!(map.get("tool_calls"), Some(Value::Array(_))) {
        let Some(Value::Array(list)) = map.remove("tool_calls") else {
            return None;
        };
        return Some((list.into_iter().map(list_item).collect(), true));
    }
    let call_shaped = map
        .keys()
        .all(|k| matches!(k.as_str(), "name" | "arguments" | "parameters"))
        && matches!(map.get("name"), Some(Value::String(_)));
    if allow_bare_call && call_shaped {
        return Some((vec![item_from(Value::Object(map), text)], false));
    }
    None
}

fn json_error(text: &[u8]) -> String {
    match serde_json::from_slice::<Value>(text) {
        Err(e) => e.to_string(),
        Ok(_) => "mismatched brackets".to_string(),
    }
}

fn invalid(kind: InvalidCallKind, raw: &[u8], reason: String) -> ParsedItem {
    let cut = raw.len().min(MAX_RAW_BYTES + 4);
    let text = String::from_utf8_lossy(&raw[..cut]);
    ParsedItem::Invalid(InvalidTextCall {
        kind,
        raw: head_bytes(&text, MAX_RAW_BYTES).to_string(),
        reason,
    })
}

/// Incremental structure scanner for one JSON value: tracks brackets, strings and escapes so
/// that the end of the value is found in O(1) per byte without parsing. serde_json checks the
/// complete value afterwards.
#[derive(Debug)]
struct JsonScan {
    /// Expected closing brackets.
    stack: Vec<u8>,
    in_string: bool,
    escape: bool,
    key: KeyCheck,
}

/// Early decision on the first key of an object outside a block, so that a JSON answer such as
/// `{"answer": 42, ...}` is released as text as soon as its first key shows it is not a call.
#[derive(Debug)]
enum KeyCheck {
    Off,
    BeforeKey(&'static [&'static str]),
    InKey(&'static [&'static str], String),
}

enum ScanStep {
    More,
    Done,
    /// The bytes so far cannot be the wanted value; the byte is not consumed.
    Reject,
}

impl JsonScan {
    fn new(opener: u8, first_keys: Option<&'static [&'static str]>) -> Self {
        let closer = if opener == b'[' { b']' } else { b'}' };
        JsonScan {
            stack: vec![closer],
            in_string: false,
            escape: false,
            key: match first_keys {
                Some(keys) if opener == b'{' => KeyCheck::BeforeKey(keys),
                _ => KeyCheck::Off,
            },
        }
    }

    fn step(&mut self, b: u8) -> ScanStep {
        match &mut self.key {
            KeyCheck::Off => {}
            KeyCheck::BeforeKey(keys) => {
                return match b {
                    b' ' | b'\t' | b'\r' | b'\n' => ScanStep::More,
                    b'"' => {
                        self.key = KeyCheck::InKey(keys, String::new());
                        ScanStep::More
                    }
                    _ => ScanStep::Reject,
                };
            }
            KeyCheck::InKey(keys, key) => {
                if b == b'"' {
                    if keys.contains(&key.as_str()) {
                        self.key = KeyCheck::Off;
                        return ScanStep::More;
                    }
                    return ScanStep::Reject;
                }
                if !b.is_ascii() {
                    return ScanStep::Reject;
                }
                key.push(b as char);
                if keys.iter().any(|k| k.starts_with(key.as_str())) {
                    return ScanStep::More;
                }
                return ScanStep::Reject;
            }
        }
        if self.in_string {
            if self.escape {
                self.escape = false;
            } else if b == b'\\' {
                self.escape = true;
            } else if b == b'"' {
                self.in_string = false;
            }
            return ScanStep::More;
        }
        match b {
            b'"' => self.in_string = true,
            b'{' | b'[' if self.stack.len() >= MAX_DEPTH => return ScanStep::Reject,
            b'{' => self.stack.push(b'}'),
            b'[' => self.stack.push(b']'),
            b'}' | b']' => {
                if self.stack.last() != Some(&b) {
                    return ScanStep::Reject;
                }
                self.stack.pop();
                if self.stack.is_empty() {
                    return ScanStep::Done;
                }
            }
            _ => {}
        }
        ScanStep::More
    }
}

/// Watches for `<tool_call>` and `</tool_call>` in text that is not JSON. Both tags hold `<` only
/// as their first byte, so a failed match restarts at a `<` and needs no backtracking.
#[derive(Debug, Default, Clone, Copy)]
struct TagMatcher {
    open: usize,
    close: usize,
}

enum TagHit {
    Idle,
    Partial,
    Open,
    Close,
}

impl TagMatcher {
    fn feed(&mut self, b: u8) -> TagHit {
        fn advance(matched: usize, tag: &[u8], b: u8) -> usize {
            if b == tag[matched] {
                matched + 1
            } else if b == b'<' {
                1
            } else {
                0
            }
        }
        self.open = advance(self.open, OPEN_TAG, b);
        self.close = advance(self.close, CLOSE_TAG, b);
        if self.close == CLOSE_TAG.len() {
            *self = TagMatcher::default();
            TagHit::Close
        } else if self.open == OPEN_TAG.len() {
            *self = TagMatcher::default();
            TagHit::Open
        } else if self.open > 0 || self.close > 0 {
            TagHit::Partial
        } else {
            TagHit::Idle
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    const VECTORS: &str = include_str!("../../tests/data/text_tool_calls.json");

    fn collapse(s: &str) -> String {
        s.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    /// Feeds `input` cut at the given byte offsets (moved down to char boundaries).
    fn parse_split(mode: ParseMode, input: &str, cuts: &[usize]) -> (String, Vec<ParsedItem>) {
        let mut points: Vec<usize> = cuts
            .iter()
            .map(|&c| {
                let mut c = c.min(input.len());
                while !input.is_char_boundary(c) {
                    c -= 1;
                }
                c
            })
            .collect();
        points.sort_unstable();
        points.dedup();
        let mut parser = TextCallParser::new(mode);
        let mut visible = String::new();
        let mut start = 0;
        for p in points {
            parser.push(&input[start..p], &mut visible);
            start = p;
        }
        parser.push(&input[start..], &mut visible);
        let items = parser.finish(&mut visible);
        (visible, items)
    }

    fn parse_chars(mode: ParseMode, input: &str) -> (String, Vec<ParsedItem>) {
        let mut parser = TextCallParser::new(mode);
        let mut visible = String::new();
        let mut buf = [0u8; 4];
        for c in input.chars() {
            parser.push(c.encode_utf8(&mut buf), &mut visible);
        }
        let items = parser.finish(&mut visible);
        (visible, items)
    }

    fn calls(items: &[ParsedItem]) -> Vec<&TextToolCall> {
        items
            .iter()
            .filter_map(|i| match i {
                ParsedItem::Call(c) => Some(c),
                ParsedItem::Invalid(_) => None,
            })
            .collect()
    }

    fn invalids(items: &[ParsedItem]) -> Vec<&InvalidTextCall> {
        items
            .iter()
            .filter_map(|i| match i {
                ParsedItem::Invalid(e) => Some(e),
                ParsedItem::Call(_) => None,
            })
            .collect()
    }

    struct Case {
        name: String,
        input: String,
        text: Expect,
        native: Expect,
    }

    #[derive(Clone)]
    struct Expect {
        calls: Vec<(String, Value)>,
        error: Option<InvalidCallKind>,
        text: String,
    }

    fn expect_from(v: &Value) -> Expect {
        let calls = v["calls"]
            .as_array()
            .expect("calls")
            .iter()
            .map(|c| {
                let name = c["name"].as_str().expect("name").to_string();
                (name, c["arguments"].clone())
            })
            .collect();
        let error = v.get("error").and_then(Value::as_str).map(|e| match e {
            "malformed" => InvalidCallKind::Malformed,
            "invalid_call" => InvalidCallKind::InvalidCall,
            other => panic!("unknown error kind {other}"),
        });
        let text = v["text"].as_str().expect("text").to_string();
        Expect { calls, error, text }
    }

    fn cases() -> Vec<Case> {
        let doc: Value = serde_json::from_str(VECTORS).expect("vectors parse");
        doc["cases"]
            .as_array()
            .expect("cases")
            .iter()
            .map(|c| {
                let text = expect_from(c);
                let native = c.get("native").map(expect_from).unwrap_or(text.clone());
                Case {
                    name: c["name"].as_str().expect("name").to_string(),
                    input: c["input"].as_str().expect("input").to_string(),
                    text,
                    native,
                }
            })
            .collect()
    }

    fn check(expect: &Expect, visible: &str, items: &[ParsedItem]) -> Result<(), String> {
        let got: Vec<(String, Value)> = calls(items)
            .into_iter()
            .map(|c| (c.name.clone(), Value::Object(c.arguments.clone())))
            .collect();
        if got != expect.calls {
            return Err(format!("calls {got:?} != {:?}", expect.calls));
        }
        let errors: Vec<InvalidCallKind> = invalids(items)
            .into_iter()
            .map(|e| e.kind.clone())
            .collect();
        match &expect.error {
            None if !errors.is_empty() => return Err(format!("unexpected errors {items:?}")),
            Some(kind) if errors != [kind.clone()] => {
                return Err(format!("errors {errors:?} != [{kind:?}]"));
            }
            _ => {}
        }
        if collapse(visible) != collapse(&expect.text) {
            return Err(format!("text {:?} != {:?}", collapse(visible), expect.text));
        }
        Ok(())
    }

    fn check_case(case: &Case, mode: ParseMode, parsed: &(String, Vec<ParsedItem>), how: &str) {
        let expect = match mode {
            ParseMode::Text => &case.text,
            ParseMode::Native => &case.native,
        };
        if let Err(e) = check(expect, &parsed.0, &parsed.1) {
            panic!("{} ({mode:?}, {how}): {e}", case.name);
        }
    }

    #[test]
    fn vectors_whole() {
        let cases = cases();
        assert!(cases.len() >= 20);
        for case in &cases {
            for mode in [ParseMode::Text, ParseMode::Native] {
                check_case(case, mode, &parse_complete(mode, &case.input), "whole");
            }
        }
    }

    #[test]
    fn vectors_one_char_deltas() {
        for case in &cases() {
            for mode in [ParseMode::Text, ParseMode::Native] {
                let parsed = parse_chars(mode, &case.input);
                check_case(case, mode, &parsed, "1-char deltas");
                assert_eq!(parsed, parse_complete(mode, &case.input), "{}", case.name);
            }
        }
    }

    proptest! {
        #[test]
        fn vectors_random_splits(cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12)) {
            for case in &cases() {
                let offsets: Vec<usize> = cuts.iter().map(|i| i.index(case.input.len() + 1)).collect();
                for mode in [ParseMode::Text, ParseMode::Native] {
                    let parsed = parse_split(mode, &case.input, &offsets);
                    check_case(case, mode, &parsed, &format!("cuts {offsets:?}"));
                    prop_assert_eq!(&parsed, &parse_complete(mode, &case.input));
                }
            }
        }

        /// Splitting never changes the verdict, not even the exact visible text, on inputs
        /// assembled from the pieces that drive the state machine.
        #[test]
        fn soup_split_invariance(
            pieces in prop::collection::vec(prop::sample::select(SOUP.to_vec()), 0..40),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..16),
            limit in prop::sample::select(vec![8usize, 40, 1024]),
        ) {
            let input: String = pieces.concat();
            let offsets: Vec<usize> = cuts.iter().map(|i| i.index(input.len() + 1)).collect();
            for mode in [ParseMode::Text, ParseMode::Native] {
                let whole = {
                    let mut p = TextCallParser::with_limit(mode, limit);
                    let mut v = String::new();
                    p.push(&input, &mut v);
                    let items = p.finish(&mut v);
                    (v, items)
                };
                let mut p = TextCallParser::with_limit(mode, limit);
                let mut v = String::new();
                let mut points = offsets.clone();
                points.retain(|&c| input.is_char_boundary(c));
                points.sort_unstable();
                let mut start = 0;
                for c in points {
                    p.push(&input[start..c], &mut v);
                    prop_assert!(p.held.len() <= limit, "held {} > {}", p.held.len(), limit);
                    start = c;
                }
                p.push(&input[start..], &mut v);
                let items = p.finish(&mut v);
                prop_assert_eq!(&(v, items), &whole);
            }
        }

        /// Text without any byte that may start a call passes through unchanged.
        #[test]
        fn plain_prose_passes_through(s in "[^<{`]*") {
            for mode in [ParseMode::Text, ParseMode::Native] {
                let (visible, items) = parse_complete(mode, &s);
                prop_assert_eq!(&visible, &s);
                prop_assert!(items.is_empty());
            }
        }
    }

    const SOUP: &[&str] = &[
        "<tool_call>",
        "</tool_call>",
        "<tool",
        "<",
        "{",
        "}",
        "[",
        "]",
        "\"",
        "\\",
        "\n",
        " ",
        "\r\n",
        "```",
        "```json\n",
        "~~~",
        "name",
        "\"name\": \"add\"",
        ",",
        ":",
        "{\"name\":\"a\",\"arguments\":{}}",
        "{\"tool_calls\":[",
        "{\"answer\": 1}",
        "<tool_call>{\"name\":\"t\"}</tool_call>",
        "```json\n{\"name\":\"f\"}\n```\n",
        "\n{\"tool_calls\":[{\"name\":\"w\"}]}\n",
        "é",
        "🚄",
        "x",
    ];

    fn call(name: &str, args: Value) -> ParsedItem {
        ParsedItem::Call(TextToolCall {
            id: None,
            name: name.to_string(),
            arguments: args.as_object().expect("object").clone(),
        })
    }

    fn text_mode(input: &str) -> (String, Vec<ParsedItem>) {
        let whole = parse_complete(ParseMode::Text, input);
        assert_eq!(
            parse_chars(ParseMode::Text, input),
            whole,
            "split changed {input:?}"
        );
        whole
    }

    #[test]
    fn several_calls_then_trailing_text() {
        let input = "Doing both.\n<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>\
                     <tool_call>{\"name\":\"b\",\"arguments\":{\"x\":1}}</tool_call>\n\
                     <tool_call>{\"name\":\"c\"}</tool_call>\nThat is all.";
        let (visible, items) = text_mode(input);
        assert_eq!(
            items,
            vec![
                call("a", json!({})),
                call("b", json!({"x": 1})),
                call("c", json!({}))
            ]
        );
        assert_eq!(collapse(&visible), "Doing both. That is all.");
    }

    /// Learnt from vLLM's hermes parser issues: models put newlines and indentation inside the
    /// tags, and pretty-print the JSON.
    #[test]
    fn newlines_inside_tags() {
        let input = "<tool_call>\n  {\n    \"name\": \"add\",\n    \"arguments\": {\"a\": 1}\n  }\n</tool_call>\n";
        let (visible, items) = text_mode(input);
        assert_eq!(items, vec![call("add", json!({"a": 1}))]);
        assert_eq!(visible.trim(), "");
    }

    #[test]
    fn tag_split_at_every_position() {
        let input = "Hi <b>there</b>.\n<tool_call>{\"name\":\"add\",\"arguments\":{\"a\":1}}</tool_call>\nBye.";
        let expected = parse_complete(ParseMode::Text, input);
        assert_eq!(expected.1, vec![call("add", json!({"a": 1}))]);
        assert_eq!(expected.0, "Hi <b>there</b>.\n\nBye.");
        for i in 0..=input.len() {
            for j in i..=input.len() {
                let mut parser = TextCallParser::new(ParseMode::Text);
                let mut visible = String::new();
                for part in [&input[..i], &input[i..j], &input[j..]] {
                    parser.push(part, &mut visible);
                    assert!(
                        expected.0.starts_with(&visible),
                        "leaked {visible:?} at {i},{j}"
                    );
                    assert!(!visible.contains("tool"), "leaked {visible:?} at {i},{j}");
                }
                let items = parser.finish(&mut visible);
                assert_eq!((visible, items), expected, "cut at {i},{j}");
            }
        }
    }

    #[test]
    fn near_miss_tags_are_text_and_released_early() {
        for input in [
            "<tool_callx>{\"name\":\"a\",\"arguments\":{}}</tool_callx>",
            "<toolbox>{\"name\":\"a\"}</toolbox>",
            "<tool_call {\"name\":\"a\"}",
            "a < b and <tool>",
            "</tool_call> stray closing tag",
        ] {
            for mode in [ParseMode::Text, ParseMode::Native] {
                let (visible, items) = parse_complete(mode, input);
                assert!(items.is_empty(), "{input:?}: {items:?}");
                assert_eq!(visible, input);
            }
        }
        let mut parser = TextCallParser::new(ParseMode::Text);
        let mut visible = String::new();
        parser.push("See <tool", &mut visible);
        assert_eq!(visible, "See ");
        parser.push("b", &mut visible);
        assert_eq!(visible, "See <toolb");
    }

    #[test]
    fn nested_braces_and_escaped_quotes() {
        let input = r#"<tool_call>{"name":"write","arguments":{"path":"a.json","content":"{\"k\": [\"}\", \"\\\"\"], \"n\": {}}","deep":{"x":[{"y":"]}"}]}}}</tool_call>"#;
        let (_, items) = text_mode(input);
        assert_eq!(
            items,
            vec![call(
                "write",
                json!({"path": "a.json", "content": "{\"k\": [\"}\", \"\\\"\"], \"n\": {}}", "deep": {"x": [{"y": "]}"}]}})
            )]
        );
    }

    #[test]
    fn stream_ending_mid_object_is_malformed() {
        let (visible, items) =
            text_mode("Checking.\n<tool_call>{\"name\":\"add\",\"arguments\":{\"a\":");
        assert_eq!(visible.trim(), "Checking.");
        let errs = invalids(&items);
        assert_eq!(items.len(), 1);
        assert_eq!(errs[0].kind, InvalidCallKind::Malformed);
        assert!(errs[0].reason.contains("EOF"), "{}", errs[0].reason);
        assert_eq!(errs[0].raw, "{\"name\":\"add\",\"arguments\":{\"a\":");
        // Ends inside a string holding the closing tag: still one malformed block.
        let (_, items) =
            text_mode("<tool_call>{\"name\":\"a\",\"arguments\":{\"s\":\"</tool_call>");
        assert!(
            matches!(&items[..], [ParsedItem::Invalid(e)] if e.kind == InvalidCallKind::Malformed)
        );
    }

    #[test]
    fn malformed_reason_comes_from_serde() {
        let (_, items) =
            text_mode("<tool_call>{\"name\":\"add\",\"arguments\":{\"a\":1,\"b\":}}</tool_call>");
        let errs = invalids(&items);
        assert_eq!(errs[0].reason, "expected value at line 1 column 38");
        // A mismatched bracket is reported at once and the rest of the block skipped.
        let (visible, items) =
            text_mode("<tool_call>{\"name\":\"a\",\"arguments\":[}]</tool_call>after");
        assert_eq!(visible, "after");
        assert!(
            matches!(&items[..], [ParsedItem::Invalid(e)] if e.kind == InvalidCallKind::Malformed && e.raw == "{\"name\":\"a\",\"arguments\":[}]")
        );
    }

    #[test]
    fn oversize_block_is_malformed_and_bounded() {
        let limit = 1024;
        let big = "x".repeat(10 * limit);
        let input = format!(
            "<tool_call>{{\"name\":\"w\",\"arguments\":{{\"s\":\"{big}</tool_call>\"}}}}</tool_call>after<tool_call>{{\"name\":\"ok\"}}</tool_call>"
        );
        let mut parser = TextCallParser::with_limit(ParseMode::Text, limit);
        let mut visible = String::new();
        for chunk in input.as_bytes().chunks(7) {
            parser.push(std::str::from_utf8(chunk).expect("ascii"), &mut visible);
            assert!(parser.held.len() <= limit);
        }
        let items = parser.finish(&mut visible);
        assert_eq!(visible, "after");
        assert_eq!(items.len(), 2);
        let errs = invalids(&items);
        assert_eq!(errs[0].kind, InvalidCallKind::Malformed);
        assert!(errs[0].reason.contains("limit"));
        assert!(errs[0].raw.len() <= MAX_RAW_BYTES);
        assert_eq!(items[1], call("ok", json!({})));
    }

    #[test]
    fn oversize_text_candidates_are_released() {
        let limit = 1024;
        let big = "y".repeat(4 * limit);
        for input in [
            format!("{{\"name\": \"a\", \"arguments\": {{\"s\": \"{big}\"}}}}"),
            format!(
                "Intro\n```json\n{{\"name\": \"a\", \"arguments\": {{\"s\": \"{big}\"}}}}\n```"
            ),
            format!(
                "Intro\n{{\"tool_calls\": [{{\"name\": \"a\", \"arguments\": {{\"s\": \"{big}\"}}}}]}}"
            ),
        ] {
            let mut parser = TextCallParser::with_limit(ParseMode::Text, limit);
            let mut visible = String::new();
            parser.push(&input[..3 * limit], &mut visible);
            assert!(parser.held.len() <= limit);
            assert!(visible.len() >= 2 * limit, "released before the end");
            parser.push(&input[3 * limit..], &mut visible);
            let items = parser.finish(&mut visible);
            assert!(items.is_empty());
            assert_eq!(visible, input);
        }
    }

    /// Feeding a long candidate one byte at a time must stay linear; a rescan on every delta
    /// would make this test take minutes.
    #[test]
    fn one_byte_deltas_stay_linear() {
        let big = "z\\\"{[".repeat(40_000);
        let inputs = [
            format!("<tool_call>{{\"name\":\"a\",\"arguments\":{{\"s\":\"{big}\"}}}}</tool_call>"),
            format!("{{\"name\":\"a\",\"arguments\":{{\"s\":\"{big}\"}}}}"),
            format!("```json\n{{\"name\":\"a\",\"arguments\":{{\"s\":\"{big}\"}}}}\n```"),
            format!("<tool_call>{big}"),
        ];
        for input in &inputs {
            let mut parser = TextCallParser::new(ParseMode::Text);
            let mut visible = String::new();
            for i in 0..input.len() {
                parser.push(&input[i..i + 1], &mut visible);
            }
            let items = parser.finish(&mut visible);
            assert_eq!(items.len(), 1);
        }
    }

    #[test]
    fn deep_nesting_stays_bounded() {
        let limit = 1024;
        let input = format!("<tool_call>{}</tool_call>after", "[".repeat(100_000));
        let mut parser = TextCallParser::with_limit(ParseMode::Text, limit);
        let mut visible = String::new();
        for chunk in input.as_bytes().chunks(3) {
            parser.push(std::str::from_utf8(chunk).expect("ascii"), &mut visible);
            assert!(parser.held.len() <= limit);
            if let State::BlockJson(scan) = &parser.state {
                assert!(scan.stack.len() <= MAX_DEPTH);
            }
        }
        let items = parser.finish(&mut visible);
        assert_eq!(visible, "after");
        assert!(
            matches!(&items[..], [ParsedItem::Invalid(e)] if e.kind == InvalidCallKind::Malformed),
            "{items:?}"
        );
        let deep = format!("{{\"tool_calls\": {}", "[".repeat(300));
        let (visible, items) = parse_complete(ParseMode::Native, &deep);
        assert!(items.is_empty());
        assert_eq!(visible, deep);
    }

    #[test]
    fn emoji_and_multibyte_text() {
        let input = "Bonjour 👋🏽 — déjà vu?\n<tool_call>{\"name\":\"note\",\"arguments\":{\"t\":\"🚄 東京\"}}</tool_call>\n終わり 🎉";
        let (visible, items) = text_mode(input);
        assert_eq!(items, vec![call("note", json!({"t": "🚄 東京"}))]);
        assert_eq!(collapse(&visible), "Bonjour 👋🏽 — déjà vu? 終わり 🎉");
        // Multibyte text right after near-miss prefixes.
        let (visible, items) = text_mode("<é{`é\n```é\n{é");
        assert!(items.is_empty());
        assert_eq!(visible, "<é{`é\n```é\n{é");
    }

    #[test]
    fn raw_is_truncated_on_a_char_boundary() {
        let big = "é".repeat(3000);
        let (_, items) = text_mode(&format!(
            "<tool_call>{{\"name\":\"a\",\"arguments\":{{\"t\":\"{big}\"}},\"x\":1}}</tool_call>"
        ));
        let errs = invalids(&items);
        assert_eq!(errs[0].kind, InvalidCallKind::InvalidCall);
        assert!(errs[0].raw.len() <= MAX_RAW_BYTES && errs[0].raw.len() > MAX_RAW_BYTES - 4);
        assert_eq!(
            errs[0].reason,
            "unexpected key `x` beside name and arguments"
        );
    }

    #[test]
    fn windows_newlines() {
        let input =
            "Let me check.\r\n```json\r\n{\"name\": \"clock\", \"arguments\": {}}\r\n```\r\nDone.";
        let (visible, items) = text_mode(input);
        assert_eq!(items, vec![call("clock", json!({}))]);
        assert_eq!(collapse(&visible), "Let me check. Done.");
        let input = "Sure.\r\n{\"tool_calls\": [{\"name\": \"clock\"}]}\r\nWaiting.";
        for mode in [ParseMode::Text, ParseMode::Native] {
            let (visible, items) = parse_complete(mode, input);
            assert_eq!(items, vec![call("clock", json!({}))]);
            assert_eq!(collapse(&visible), "Sure. Waiting.");
        }
        let (visible, items) = text_mode("\r\n{\"name\": \"clock\"}\r\n\r\n");
        assert_eq!(items, vec![call("clock", json!({}))]);
        assert_eq!(visible.trim(), "");
    }

    #[test]
    fn json_answer_is_released_after_its_first_key() {
        let mut parser = TextCallParser::new(ParseMode::Text);
        let mut visible = String::new();
        parser.push("{\"answer\": 42, ", &mut visible);
        assert_eq!(visible, "{\"answer\": 42, ");
        parser.push("\"unit\": \"m\"}", &mut visible);
        let items = parser.finish(&mut visible);
        assert!(items.is_empty());
        assert_eq!(visible, "{\"answer\": 42, \"unit\": \"m\"}");
        // `{"a` could still become "arguments": held until the key decides.
        let mut parser = TextCallParser::new(ParseMode::Text);
        let mut visible = String::new();
        parser.push("{\"a", &mut visible);
        assert_eq!(visible, "");
        parser.push("b\": 1}", &mut visible);
        assert_eq!(visible, "{\"ab\": 1}");
        parser.finish(&mut visible);
        // A JSON answer whose first key is `name` is text once the object shows its other keys.
        let (visible, items) = text_mode("{\"name\": \"Ada\", \"born\": 1815}");
        assert!(items.is_empty());
        assert_eq!(visible, "{\"name\": \"Ada\", \"born\": 1815}");
    }

    #[test]
    fn tilde_fences_are_text() {
        let input = "~~~json\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n~~~";
        let (visible, items) = text_mode(input);
        assert!(items.is_empty());
        assert_eq!(visible, input);
    }

    #[test]
    fn other_fences_stay_text_and_later_fences_still_count() {
        let input = "Code:\n```python\nprint({\"name\": 1})\n```\nNow:\n```json\n{\"name\": \"run\", \"arguments\": {}}\n```\n";
        let (visible, items) = text_mode(input);
        assert_eq!(items, vec![call("run", json!({}))]);
        assert_eq!(
            collapse(&visible),
            "Code: ```python print({\"name\": 1}) ``` Now:"
        );
        // A fence holding two objects, or an object and prose, is text.
        for input in [
            "```json\n{\"name\": \"a\", \"arguments\": {}}\n{\"name\": \"b\", \"arguments\": {}}\n```",
            "```\n{\"name\": \"a\", \"arguments\": {}}\nthen this\n```",
            "```json\n{\"name\": \"a\", \"arguments\": {}, \"why\": \"x\"}\n```",
            "```json\n```",
            "```js\n{\"name\": \"a\"}\n```",
        ] {
            let (visible, items) = text_mode(input);
            assert!(items.is_empty(), "{input:?}");
            assert_eq!(visible, input);
        }
        // A fenced call with arguments that are not an object is an invalid call.
        let (visible, items) = text_mode("```json\n{\"name\": \"a\", \"arguments\": [1]}\n```");
        assert_eq!(visible, "");
        assert!(
            matches!(&items[..], [ParsedItem::Invalid(e)] if e.kind == InvalidCallKind::InvalidCall && e.reason.contains("array"))
        );
        // Unclosed fence at the end of the stream.
        let (visible, items) = text_mode("Run:\n```json\n{\"name\": \"a\"}\n");
        assert_eq!(items, vec![call("a", json!({}))]);
        assert_eq!(visible.trim(), "Run:");
    }

    #[test]
    fn tool_calls_object_placement() {
        let after_sentence = "I will look it up.\n{\"tool_calls\": [{\"name\": \"search\", \"arguments\": {\"q\": \"rust\"}}]}\n";
        let mid_line = "I will call {\"tool_calls\": [{\"name\": \"search\"}]} now.";
        let same_line_text = "{\"tool_calls\": [{\"name\": \"search\"}]} and more";
        let with_extra_key = "{\"tool_calls\": [{\"name\": \"search\"}], \"content\": \"hi\"}";
        for mode in [ParseMode::Text, ParseMode::Native] {
            let (visible, items) = parse_complete(mode, after_sentence);
            assert_eq!(items, vec![call("search", json!({"q": "rust"}))]);
            assert_eq!(visible.trim(), "I will look it up.");
            for text in [mid_line, same_line_text, with_extra_key] {
                let (visible, items) = parse_complete(mode, text);
                assert!(items.is_empty(), "{text:?}");
                assert_eq!(visible, text);
            }
        }
    }

    #[test]
    fn tool_calls_items_are_validated() {
        let input = "{\"tool_calls\": [{\"id\": \"c1\", \"type\": \"function\", \"function\": {\"name\": \"a\", \"arguments\": \"\"}}, {\"name\": \"b\", \"arguments\": {}, \"note\": 1}, 7, {\"name\": \"c\", \"arguments\": \"[1]\"}]}";
        for mode in [ParseMode::Text, ParseMode::Native] {
            let (visible, items) = parse_complete(mode, input);
            assert_eq!(visible, "");
            assert_eq!(items.len(), 4);
            assert_eq!(
                items[0],
                ParsedItem::Call(TextToolCall {
                    id: Some("c1".into()),
                    name: "a".into(),
                    arguments: Map::new()
                })
            );
            let errs = invalids(&items);
            assert_eq!(errs.len(), 3);
            assert!(errs.iter().all(|e| e.kind == InvalidCallKind::InvalidCall));
            assert_eq!(
                errs[0].reason,
                "unexpected key `note` beside name and arguments"
            );
            assert_eq!(errs[0].raw, "{\"arguments\":{},\"name\":\"b\",\"note\":1}");
            assert_eq!(errs[1].reason, "expected a call object, got a number");
            assert_eq!(
                errs[2].reason,
                "arguments string holds an array, not a JSON object"
            );
        }
    }

    #[test]
    fn bare_call_must_be_the_whole_message() {
        for input in [
            "{\"name\": \"clock\", \"arguments\": {}}\nThen I will tell you.",
            "{\"name\": \"clock\", \"arguments\": {}} {\"name\": \"clock\", \"arguments\": {}}",
            "Text first\n{\"name\": \"clock\", \"arguments\": {}}",
        ] {
            let (visible, items) = text_mode(input);
            assert!(items.is_empty(), "{input:?}");
            assert_eq!(visible, input);
        }
        let (visible, items) =
            text_mode("  \n {\"arguments\": {\"tz\": \"UTC\"}, \"name\": \"clock\"}\n\n");
        assert_eq!(items, vec![call("clock", json!({"tz": "UTC"}))]);
        assert_eq!(visible.trim(), "");
        let (visible, items) = text_mode("{\"name\": \"clock\", \"arguments\": \"{oops\"}");
        assert_eq!(visible, "");
        assert!(
            matches!(&items[..], [ParsedItem::Invalid(e)] if e.kind == InvalidCallKind::InvalidCall && e.reason.starts_with("arguments string is not valid JSON"))
        );
    }

    /// Learnt from llama.cpp's and vLLM's parser issues: several values in one block, a missing
    /// closing tag before the next block, stray text after the JSON, empty blocks.
    #[test]
    fn block_variants() {
        let (_, items) = text_mode("<tool_call>\n{\"name\":\"a\"}\n{\"name\":\"b\"}\n</tool_call>");
        assert_eq!(items, vec![call("a", json!({})), call("b", json!({}))]);
        let (_, items) = text_mode(
            "<tool_call>[{\"name\":\"a\"},{\"name\":\"b\",\"parameters\":{\"x\":1}}]</tool_call>",
        );
        assert_eq!(
            items,
            vec![call("a", json!({})), call("b", json!({"x": 1}))]
        );
        let (_, items) = text_mode("<tool_call>{\"tool_calls\":[{\"name\":\"a\"}]}</tool_call>");
        assert_eq!(items, vec![call("a", json!({}))]);
        let (visible, items) =
            text_mode("<tool_call>{\"name\":\"a\"}\n<tool_call>{\"name\":\"b\"}</tool_call>ok");
        assert_eq!(items, vec![call("a", json!({})), call("b", json!({}))]);
        assert_eq!(visible, "ok");
        let (visible, items) = text_mode("<tool_call>{\"name\":\"a\"}}</tool_call>ok");
        assert_eq!(visible, "ok");
        assert_eq!(items[0], call("a", json!({})));
        assert!(
            matches!(&items[1], ParsedItem::Invalid(e) if e.kind == InvalidCallKind::Malformed && e.raw == "}")
        );
        for input in [
            "<tool_call></tool_call>",
            "<tool_call>\n",
            "<tool_call>add(1, 2)</tool_call>",
        ] {
            let (visible, items) = text_mode(input);
            assert_eq!(visible, "");
            assert!(
                matches!(&items[..], [ParsedItem::Invalid(e)] if e.kind == InvalidCallKind::Malformed),
                "{input:?}"
            );
        }
        let (_, items) = text_mode("<tool_call>\"add\"</tool_call>");
        assert!(
            matches!(&items[..], [ParsedItem::Invalid(e)] if e.kind == InvalidCallKind::Malformed && e.raw == "\"add\"" && e.reason == REASON_NOT_JSON)
        );
    }

    #[test]
    fn parse_arguments_shapes() {
        let obj = json!({"a": 1});
        assert_eq!(
            parse_arguments(&obj),
            Ok(obj.as_object().cloned().expect("object"))
        );
        assert_eq!(
            parse_arguments(&json!("{\"a\": 1}")),
            Ok(obj.as_object().cloned().expect("object"))
        );
        assert_eq!(parse_arguments(&Value::Null), Ok(Map::new()));
        assert_eq!(parse_arguments(&json!("  ")), Ok(Map::new()));
        assert!(
            parse_arguments(&json!(3))
                .expect_err("number")
                .contains("a number")
        );
        assert!(
            parse_arguments(&json!("[1]"))
                .expect_err("array")
                .contains("an array")
        );
        assert!(
            parse_arguments(&json!("{"))
                .expect_err("bad")
                .contains("not valid JSON")
        );
    }

    #[test]
    fn parser_is_reusable_after_finish() {
        let mut parser = TextCallParser::new(ParseMode::Text);
        let mut visible = String::new();
        parser.push("hello <tool_call>{\"name\":", &mut visible);
        let items = parser.finish(&mut visible);
        assert_eq!(items.len(), 1);
        let mut visible = String::new();
        parser.push("{\"name\": \"clock\"}", &mut visible);
        assert_eq!(parser.finish(&mut visible), vec![call("clock", json!({}))]);
        assert_eq!(visible, "");
    }
}
