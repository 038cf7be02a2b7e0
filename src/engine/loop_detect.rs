//! Loop detection on a streamed assistant reply.
//!
//! A model that gets stuck repeats itself, and every token it produces after that point is
//! wasted: the worker slot stays busy and the client gets a useless answer. genfleet watches
//! the visible text and the tool calls while they stream and stops the generation once a loop
//! is certain enough. Three shapes are recognised:
//!
//! * the same line again and again ([`LoopKind::RepeatedLine`]);
//! * a stretch of text repeated back to back, with or without newlines
//!   ([`LoopKind::Chanting`]);
//! * the same tool call with the same arguments several times in a row
//!   ([`LoopKind::RepeatedToolCall`]).
//!
//! The detector runs on every byte of every stream, so it is built to be cheap and
//! predictable: amortised O(1) work per byte, no allocation per byte, no hash-map operation per
//! byte, and memory bounded whatever the length of the reply (about 50 KB; the text itself is
//! never kept, only hashes of it). Its verdict is a pure function of the byte sequence: how the
//! stream is cut into deltas changes when the caller hears about a loop, never whether or at
//! which byte it is found.
//!
//! Both text detectors share one polynomial prefix hash over all the bytes, so the hash of any
//! recent substring (a line, a chunk, the text between two occurrences of a chunk) is available
//! in O(1) without re-reading the bytes, and the last few hundred bytes can even be recovered
//! from the ring of recent prefix hashes to quote them in a verdict.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasherDefault, DefaultHasher, Hasher};

use serde_json::Value;

use crate::protocol::text::clip_chars;
use crate::settings::loop_detection::{
    MAX_CHANT_PERIOD, MAX_CHANT_WINDOW, MAX_LINE_WINDOW, MIN_CHANT_WINDOW,
};

/// The detector's settings live with the other settings; they are named here as well because
/// they describe this detector.
pub use crate::settings::loop_detection::{LineTier, LoopDetectionConfig};

/// Odd base of the prefix hash `P(i) = P(i-1) * BASE + (byte | 0x100)` (mod 2^64). Odd keeps
/// the multiplication a bijection, so one step can be undone to recover the byte. Collisions
/// between different texts of realistic length are negligible, and a collision can only add
/// one spurious count, never fire on its own.
const BASE: u64 = 0x9E37_79B9_7F4A_7C15;

/// Width (in window positions) of the winnowing used to pick chant anchors. Winnowing picks the
/// smallest window hash among the last `WINNOW` positions, which guarantees at least one anchor
/// every `WINNOW` bytes whatever the content. A plain "hash is 0 mod 16" rule has no such
/// guarantee: a 29-byte phrase has only 29 distinct window hashes and, with probability
/// (15/16)^29 ≈ 15 %, none of them is an anchor, so that loop would never be seen. Ordinary
/// text gets an anchor every ~WINNOW/2 bytes, which keeps the table work small.
const WINNOW: usize = 64;

/// Slots of the direct-mapped table of chant anchors. A loop with a period up to
/// `chant_max_period` produces about `2 * period / (WINNOW + 1)` anchors per period, each of
/// which must survive one period in the table; 1024 slots keep almost all of them even at the
/// largest allowed period, and only one needs to survive for the loop to be caught.
const TABLE_BITS: u32 = 10;
const TABLE_SLOTS: usize = 1 << TABLE_BITS;

/// Bytes kept from the start of the current line (after its indentation): enough to recognise
/// a fence or a table row. The verdict quotes the line from the ring of recent prefix hashes
/// instead, so nothing is copied per delta.
const HEAD_BYTES: usize = 3;

/// Small deltas are gathered up to this many bytes before being analysed (see
/// [`LoopDetector::push_text`]).
pub const PENDING_BYTES: usize = 256;

/// The longest quoted text in a verdict, in characters.
const DETAIL_CHARS: usize = 60;

/// Which kind of loop was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LoopKind {
    RepeatedLine,
    Chanting,
    RepeatedToolCall,
}

impl LoopKind {
    /// A stable snake_case name for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            LoopKind::RepeatedLine => "repeated_line",
            LoopKind::Chanting => "chanting",
            LoopKind::RepeatedToolCall => "repeated_tool_call",
        }
    }
}

impl fmt::Display for LoopKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A detected loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopVerdict {
    pub kind: LoopKind,
    /// Short human text quoting (at most ~60 characters of) what repeats.
    pub detail: String,
}

impl fmt::Display for LoopVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.detail)
    }
}

/// Watches one generation. Feed it the visible text as it streams ([`push_text`]), the tool
/// calls ([`push_tool_call`]) and the end of each assistant turn ([`end_turn`]). The first
/// loop found is returned once and then remembered ([`verdict`]); after that the detector
/// ignores its input, since the generation is being stopped.
///
/// [`push_text`]: LoopDetector::push_text
/// [`push_tool_call`]: LoopDetector::push_tool_call
/// [`end_turn`]: LoopDetector::end_turn
/// [`verdict`]: LoopDetector::verdict
pub struct LoopDetector {
    enabled: bool,
    verdict: Option<LoopVerdict>,
    fired_at: Option<u64>,
    /// Text bytes seen so far (over all turns); all positions below count in it.
    pos: u64,
    /// Prefix hash of all text so far, `P(pos)`.
    hash: u64,
    lines: Lines,
    chant: Chant,
    tools: ToolCalls,
    /// Small deltas not analysed yet (at most `PENDING_BYTES`).
    pending: Vec<u8>,
}

impl LoopDetector {
    /// A detector for one generation. Out-of-range settings are clamped (see
    /// [`LoopDetectionConfig::validate`] to reject them instead).
    pub fn new(config: &LoopDetectionConfig) -> Self {
        Self {
            enabled: config.enabled,
            verdict: None,
            fired_at: None,
            pos: 0,
            hash: 0,
            lines: Lines::new(config),
            chant: Chant::new(config),
            tools: ToolCalls::new(config),
            pending: Vec::with_capacity(if config.enabled { PENDING_BYTES } else { 0 }),
        }
    }

    /// Feeds a piece of visible assistant text. Returns the verdict the first time a loop is
    /// seen.
    ///
    /// Deltas are usually a token or two, and analysing a few bytes at a time costs more in
    /// set-up than in work, so small deltas are gathered (up to [`PENDING_BYTES`]) and
    /// analysed when the buffer fills or a line ends. A loop is therefore reported at the
    /// latest with the delta that ends its line, or [`PENDING_BYTES`] later for a chant
    /// without newlines; the byte it is found at does not change.
    #[inline]
    pub fn push_text(&mut self, delta: &str) -> Option<LoopVerdict> {
        if !self.enabled || self.verdict.is_some() {
            return None;
        }
        let bytes = delta.as_bytes();
        if self.pending.len() + bytes.len() < PENDING_BYTES && find_newline(bytes).is_none() {
            self.pending.extend_from_slice(bytes);
            return None;
        }
        self.push_bytes(bytes)
    }

    #[inline(never)]
    fn push_bytes(&mut self, bytes: &[u8]) -> Option<LoopVerdict> {
        let found = if self.pending.len() + bytes.len() <= PENDING_BYTES {
            self.pending.extend_from_slice(bytes);
            self.flush()
        } else {
            self.flush().or_else(|| self.scan(bytes))
        };
        self.latch(found)
    }

    /// Analyses the gathered small deltas.
    fn flush(&mut self) -> Option<LoopVerdict> {
        if self.pending.is_empty() {
            return None;
        }
        let pending = std::mem::take(&mut self.pending);
        let found = self.scan(&pending);
        self.pending = pending;
        self.pending.clear();
        found
    }

    /// Marks the end of an assistant turn: a partial last line counts as complete. Returns a
    /// verdict if that completes a loop.
    ///
    /// The text detectors then start afresh: a new turn comes after tool results, and the
    /// same short preamble ("Let me check the output.") recurring across turns of a working
    /// agent is not a loop. A model that repeats whole turns also repeats its tool calls,
    /// which [`push_tool_call`](LoopDetector::push_tool_call) tracks across turns.
    pub fn end_turn(&mut self) -> Option<LoopVerdict> {
        if !self.enabled || self.verdict.is_some() {
            return None;
        }
        let found = self
            .flush()
            .or_else(|| self.lines.finish(self.pos, self.hash, &self.chant.ring));
        self.lines.reset_turn();
        self.chant.reset_turn(self.pos);
        self.latch(found)
    }

    /// Feeds one tool call the model made. Arguments are compared canonically (object keys in
    /// any order; a string holding a JSON object or array, as chat-completion APIs send it,
    /// is parsed first), so cosmetic differences do not hide a repeat.
    pub fn push_tool_call(&mut self, name: &str, arguments: &Value) -> Option<LoopVerdict> {
        if !self.enabled || self.verdict.is_some() {
            return None;
        }
        let found = self.tools.push(name, arguments);
        self.latch(found)
    }

    /// The loop found so far, if any.
    pub fn verdict(&self) -> Option<&LoopVerdict> {
        self.verdict.as_ref()
    }

    /// The offset, in bytes of all the text fed, of the byte at which the loop was found (for
    /// logs; for a tool-call loop, the text fed until then). It does not depend on how the
    /// text was split into deltas.
    pub fn fired_at(&self) -> Option<u64> {
        self.fired_at
    }

    fn latch(&mut self, found: Option<LoopVerdict>) -> Option<LoopVerdict> {
        let verdict = found?;
        self.fired_at = Some(self.pos);
        self.verdict = Some(verdict.clone());
        Some(verdict)
    }

    /// Text goes by segments ending at a newline: the line bookkeeping is done once per
    /// segment with slice operations, and only the rolling hash and the winnowing run per
    /// byte. Processing stops at the byte that completes a loop, so `pos` says exactly where
    /// it was found whatever the deltas.
    fn scan(&mut self, bytes: &[u8]) -> Option<LoopVerdict> {
        let mut rest = bytes;
        while !rest.is_empty() {
            let newline = find_newline(rest);
            let (segment, after) = rest.split_at(newline.map_or(rest.len(), |i| i + 1));
            rest = after;
            let content = &segment[..newline.unwrap_or(segment.len())];
            let last_solid = self.lines.note(content, self.pos);
            if let Some(verdict) = self.hash_segment(segment, last_solid) {
                return Some(verdict);
            }
            if newline.is_some()
                && let Some(verdict) = self.lines.finish(self.pos, self.hash, &self.chant.ring)
            {
                return Some(verdict);
            }
        }
        None
    }

    /// The per-byte loop: the prefix hash, the chunk hash and the winnowing, with the hot
    /// state in locals and fixed-size rings (no bounds checks). `last_solid` is the index of
    /// the segment's last non-blank byte (or `usize::MAX`), whose prefix hash ends the line.
    fn hash_segment(&mut self, segment: &[u8], last_solid: usize) -> Option<LoopVerdict> {
        let Self {
            pos: stored_pos,
            hash: stored_hash,
            lines,
            chant,
            ..
        } = self;
        let start_pos = *stored_pos;
        let start_hash = *stored_hash;
        let mut pos = start_pos;
        let mut hash = start_hash;
        if segment.last() == Some(&b'\n') {
            // Ahead of its byte, so anchors recorded in this segment already know of it.
            chant.push_newline(pos + segment.len() as u64);
        }
        let floor = chant.turn_start + chant.width;
        let width = chant.width;
        let base_pow_width = chant.base_pow_width;
        let mut min_key = chant.min_key;
        let mut min_pos = chant.min_pos;
        let mut expires = min_pos + WINNOW as u64;
        let mut found = None;
        // The first `width` bytes of a turn have no complete chunk yet.
        let warmup = (floor.saturating_sub(pos + 1) as usize).min(segment.len());
        let (early, main) = segment.split_at(warmup);
        for &byte in early {
            pos += 1;
            hash = next_hash(hash, byte);
            chant.ring[pos as usize % RING] = hash;
            chant.keys[pos as usize % WINNOW] = u32::MAX;
        }
        // Runs end where the current minimum expires, so the byte loop itself only watches
        // for a new minimum (one comparison); an expired minimum is replaced by scanning the
        // WINNOW keys again, which in ordinary text happens every ~WINNOW bytes. Ties go to
        // the newest position, so the anchor of a repetition advances by one period per
        // period instead of expiring.
        let base = pos;
        let end = pos + main.len() as u64;
        'runs: while pos < end {
            let stop = if expires > pos {
                end.min(expires)
            } else {
                // The minimum expired before this byte (it is left over from an earlier
                // turn), so this byte's key is the new minimum. Take that byte alone: the next
                // run must stop where the new minimum expires, or the anchors after it would
                // be missed until the segment ends (and found later when the same text comes
                // cut into smaller deltas).
                min_key = u32::MAX;
                pos + 1
            };
            for &byte in &main[(pos - base) as usize..(stop - base) as usize] {
                pos += 1;
                hash = next_hash(hash, byte);
                let at = pos as usize % RING;
                chant.ring[at] = hash;
                let old = chant.ring[(pos - width) as usize % RING];
                let value = hash.wrapping_sub(old.wrapping_mul(base_pow_width));
                let key = winnow_key(value);
                chant.keys[pos as usize % WINNOW] = key;
                if key <= min_key {
                    min_key = key;
                    min_pos = pos;
                    expires = pos + WINNOW as u64;
                    found = chant.record(pos, pos, lines.in_fence);
                    if found.is_some() {
                        break 'runs;
                    }
                }
            }
            if pos == expires {
                (min_key, min_pos) = chant.window_min(pos);
                expires = min_pos + WINNOW as u64;
                found = chant.record(min_pos, pos, lines.in_fence);
                if found.is_some() {
                    break;
                }
            }
        }
        *stored_pos = pos;
        *stored_hash = hash;
        chant.min_key = min_key;
        chant.min_pos = min_pos;
        if found.is_none() && last_solid != usize::MAX {
            let end = start_pos + last_solid as u64 + 1;
            lines.end_hash = if pos - end < (RING - 1) as u64 {
                chant.ring[end as usize % RING]
            } else {
                // A long run of trailing blanks pushed it out of the ring: rehash.
                segment[..=last_solid]
                    .iter()
                    .fold(start_hash, |h, &b| next_hash(h, b))
            };
        }
        found
    }
}

/// The winnowing order: the high half of the chunk hash (the best-mixed bits of a
/// polynomial hash), which is plenty to order chunks and halves the memory touched.
#[inline]
fn winnow_key(value: u64) -> u32 {
    (value >> 32) as u32
}

/// The byte at position `p`, recovered from two consecutive prefix hashes (both must still
/// be in the ring): quoting needs the text, and keeping it a second time would cost a store
/// per byte.
fn byte_at(ring: &[u64; RING], p: u64) -> u8 {
    let step =
        ring[p as usize % RING].wrapping_sub(ring[(p - 1) as usize % RING].wrapping_mul(BASE));
    (step - 0x100) as u8
}

/// One step of the prefix hash `P(i) = P(i-1) * BASE + (byte | 0x100)`. The `| 0x100` keeps
/// NUL bytes from vanishing at the start of a substring, and the step can be undone exactly
/// ([`byte_at`]).
#[inline]
fn next_hash(hash: u64, byte: u8) -> u64 {
    hash.wrapping_mul(BASE)
        .wrapping_add(u64::from(byte) | 0x100)
}

/// The first `\n`, eight bytes at a time (a zero-byte test on `word ^ 0x0a0a..`): most bytes
/// are not newlines, and a byte-by-byte search would cost as much as the hashing.
#[inline]
fn find_newline(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    const NEWLINES: u64 = ONES * b'\n' as u64;
    let mut chunks = bytes.chunks_exact(8);
    let mut offset = 0;
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let word = u64::from_le_bytes(word) ^ NEWLINES;
        let zero = word.wrapping_sub(ONES) & !word & HIGHS;
        if zero != 0 {
            return Some(offset + (zero.trailing_zeros() / 8) as usize);
        }
        offset += 8;
    }
    chunks
        .remainder()
        .iter()
        .position(|&b| b == b'\n')
        .map(|i| offset + i)
}

/// ASCII space and control characters (tab, `\r`, `\n`, ...): invisible, so they never make a
/// line count and trailing ones (a CRLF's `\r`) do not make otherwise identical lines differ.
/// One comparison, which also makes the character count below cheap.
#[inline]
fn is_blank(byte: u8) -> bool {
    byte <= b' '
}

/// Visible characters in `bytes`: bytes that are neither blank nor UTF-8 continuation bytes,
/// counted eight at a time.
fn count_chars(bytes: &[u8]) -> u64 {
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    const LOWS: u64 = 0x7F7F_7F7F_7F7F_7F7F;
    const ONES: u64 = 0x0101_0101_0101_0101;
    let mut chunks = bytes.chunks_exact(8);
    let mut total = 0;
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let x = u64::from_le_bytes(word);
        // High bit of each byte: above 0x20 (non-ASCII bytes all are) ...
        let visible = x | (((x & LOWS) + 0x5F5F_5F5F_5F5F_5F5F) & HIGHS);
        // ... and not 10xxxxxx (bit 6 is moved onto bit 7 to test it).
        let continuation = x & !(x << 1);
        let counted = (visible & !continuation & HIGHS) >> 7;
        total += counted.wrapping_mul(ONES) >> 56;
    }
    total
        + chunks
            .remainder()
            .iter()
            .map(|&b| u64::from(!is_blank(b) & (b & 0xC0 != 0x80)))
            .sum::<u64>()
}

/// `BASE^k` for the lengths of most lines, built at compile time.
const POWERS: [u64; 1024] = {
    let mut table = [1u64; 1024];
    let mut k = 1;
    while k < 1024 {
        table[k] = table[k - 1].wrapping_mul(BASE);
        k += 1;
    }
    table
};

/// `BASE^exp`: a table lookup for short lengths, else by squaring (O(log exp)); called once
/// per line or chant chain step, never per byte.
fn base_pow(mut exp: u64) -> u64 {
    if exp < POWERS.len() as u64 {
        return POWERS[exp as usize];
    }
    let mut result: u64 = 1;
    let mut factor = BASE;
    while exp > 0 {
        if exp & 1 == 1 {
            result = result.wrapping_mul(factor);
        }
        factor = factor.wrapping_mul(factor);
        exp >>= 1;
    }
    result
}

/// Final mixing step of splitmix64. The low bits of a polynomial hash mod 2^64 are weak (the
/// lowest is just the parity of the bytes), and hash tables index with low bits.
#[inline]
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Quotes text for a verdict: whole characters only, trailing blanks dropped, at most
/// [`DETAIL_CHARS`] characters, escaped like a Rust string so newlines stay visible.
fn quote(bytes: &[u8]) -> String {
    let start = bytes
        .iter()
        .position(|&b| b & 0xC0 != 0x80)
        .unwrap_or(bytes.len());
    let text = String::from_utf8_lossy(&bytes[start..]);
    let text = text.trim_end_matches([' ', '\t', '\r', '\u{b}', '\u{c}']);
    format!("{:?}", clip_chars(text, DETAIL_CHARS))
}

/// Keys of the line counter are already mixed hashes; hashing them again would only cost.
#[derive(Default)]
struct PremixedHasher(u64);

impl Hasher for PremixedHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Repeated complete lines, counted in a sliding window of recent lines.
struct Lines {
    min_chars: u64,
    tiers: Vec<LineTier>,
    fence_multiplier: usize,
    table_multiplier: usize,
    capacity: usize,
    /// Keys of the last `capacity` counted lines, oldest first.
    recent: VecDeque<u64>,
    /// How often each key occurs in `recent`; never larger than `recent`.
    counts: HashMap<u64, u32, BuildHasherDefault<PremixedHasher>>,
    in_fence: bool,
    /// The current line: its text is the bytes after `start_pos` up to `end_pos` (the last
    /// non-blank byte), and the prefix hashes at both ends give its hash without storing it.
    start_pos: u64,
    start_hash: u64,
    end_pos: u64,
    end_hash: u64,
    /// Visible characters so far.
    chars: u64,
    /// Whether a non-blank byte has been seen (blank lines are never counted).
    started: bool,
    /// Position of the first non-blank byte.
    first_pos: u64,
    head: [u8; HEAD_BYTES],
    head_len: usize,
}

impl Lines {
    fn new(config: &LoopDetectionConfig) -> Self {
        let capacity = config.line_window.clamp(1, MAX_LINE_WINDOW);
        let mut tiers: Vec<LineTier> = config
            .line_tiers
            .iter()
            .map(|t| LineTier {
                min_len: t.min_len,
                repeats: t.repeats.max(2),
            })
            .collect();
        tiers.sort_by_key(|t| t.min_len);
        Self {
            min_chars: config.line_min_chars as u64,
            tiers,
            fence_multiplier: config.fence_multiplier.max(1),
            table_multiplier: config.table_multiplier.max(1),
            capacity,
            recent: VecDeque::new(),
            counts: HashMap::default(),
            in_fence: false,
            start_pos: 0,
            start_hash: 0,
            end_pos: 0,
            end_hash: 0,
            chars: 0,
            started: false,
            first_pos: 0,
            head: [0; HEAD_BYTES],
            head_len: 0,
        }
    }

    /// Ends the current line at `pos` (whose prefix hash is `hash`); the next line starts
    /// after it. `ring` holds the latest prefix hashes, to quote the line.
    fn finish(&mut self, pos: u64, hash: u64, ring: &[u64; RING]) -> Option<LoopVerdict> {
        let found = if self.started {
            self.count(pos, ring)
        } else {
            None
        };
        self.started = false;
        self.chars = 0;
        self.head_len = 0;
        self.start_pos = pos;
        self.start_hash = hash;
        found
    }

    /// Takes in a piece of the current line (no newline) that starts after position
    /// `start`; returns the index of its last non-blank byte, or `usize::MAX`.
    fn note(&mut self, content: &[u8], start: u64) -> usize {
        let Some(last) = content.iter().rposition(|&b| !is_blank(b)) else {
            if self.started {
                self.keep_head(content);
            }
            return usize::MAX;
        };
        let from = if self.started {
            0
        } else {
            let from = content.iter().position(|&b| !is_blank(b)).unwrap_or(0);
            self.first_pos = start + from as u64 + 1;
            from
        };
        self.started = true;
        self.keep_head(&content[from..]);
        self.chars += count_chars(&content[from..=last]);
        self.end_pos = start + last as u64 + 1;
        last
    }

    fn keep_head(&mut self, bytes: &[u8]) {
        for &b in bytes.iter().take(HEAD_BYTES - self.head_len) {
            self.head[self.head_len] = b;
            self.head_len += 1;
        }
    }

    fn reset_turn(&mut self) {
        self.recent.clear();
        self.counts.clear();
        self.in_fence = false;
    }

    fn count(&mut self, pos: u64, ring: &[u64; RING]) -> Option<LoopVerdict> {
        let head = &self.head[..self.head_len];
        if head == b"```" {
            self.in_fence = !self.in_fence;
            return None;
        }
        if self.chars < self.min_chars {
            return None;
        }
        let chars = self.chars;
        let base = self
            .tiers
            .iter()
            .rev()
            .find(|t| t.min_len as u64 <= chars)?
            .repeats;
        let (multiplier, place) = if self.in_fence {
            (self.fence_multiplier, " in a code block")
        } else if head.first() == Some(&b'|') {
            (self.table_multiplier, " in a table")
        } else {
            (1, "")
        };
        let threshold = base.saturating_mul(multiplier);

        let len = self.end_pos - self.start_pos;
        let text_hash = self
            .end_hash
            .wrapping_sub(self.start_hash.wrapping_mul(base_pow(len)));
        let key = mix(text_hash ^ len.wrapping_mul(0xD6E8_FEB8_6659_FD93));

        if self.recent.len() >= self.capacity
            && let Some(old) = self.recent.pop_front()
            && let Some(n) = self.counts.get_mut(&old)
        {
            *n -= 1;
            if *n == 0 {
                self.counts.remove(&old);
            }
        }
        self.recent.push_back(key);
        let n = self.counts.entry(key).or_insert(0);
        *n += 1;
        let n = *n;
        if (n as usize) < threshold {
            return None;
        }
        // The line is quoted from the ring of recent prefix hashes; of a line too long for
        // it, only the end is left, which repeats just as well.
        let oldest = (pos + 2).saturating_sub(RING as u64);
        let from = self.first_pos.max(oldest);
        let text: Vec<u8> = (from..=self.end_pos).map(|p| byte_at(ring, p)).collect();
        let cut = if from > self.first_pos { "…" } else { "" };
        Some(LoopVerdict {
            kind: LoopKind::RepeatedLine,
            detail: format!("line repeated {n} times{place}: {cut}{}", quote(&text)),
        })
    }
}

/// The last occurrence of one anchored chunk and the chain of identical repeats ending there.
#[derive(Clone, Copy, Default)]
struct Slot {
    /// Chunk hash.
    key: u64,
    /// Position and prefix hash of the last counted occurrence.
    pos: u64,
    hash: u64,
    /// Text hash and distance between the last two counted occurrences.
    segment: u64,
    gap: u32,
    count: u32,
}

/// Text repeated back to back, inside a line or across lines ("chanting").
///
/// After gemini-cli's loop detection (a 50-character chunk seen 10 times close together),
/// made incremental. A `width`-byte chunk is hashed at every byte with the rolling prefix
/// hash, but only chunks at content-defined anchors are looked up, so the table is touched
/// every ~`WINNOW / 2` bytes rather than every byte. Anchors are chosen by winnowing (the
/// smallest chunk hash in the last [`WINNOW`] positions), which depends only on the text, so
/// a repeated text yields the same anchors in every repetition, and which never leaves a gap
/// longer than [`WINNOW`].
///
/// An occurrence only counts when it does not overlap the previous counted one and the text
/// between them is identical to the text between the two before (same distance, same hash).
/// That makes a chain an exact periodic repetition, which is what separates a chant from text
/// that merely shares a long prefix (list items, numbered steps, rows of a JSON array); and
/// not counting overlaps keeps a long `=====` rule or a run of `0, 0, 0` from firing on a few
/// dozen bytes.
struct Chant {
    width: u64,
    /// `BASE^width`, to drop the byte leaving the window.
    base_pow_width: u64,
    /// Prefix hashes of the last `RING` positions (index: position mod `RING`).
    ring: [u64; RING],
    /// Positions of the last newlines (more than can follow an anchor still to be recorded).
    newlines: [u64; NEWLINES],
    newline_count: usize,
    repeats: usize,
    fence_multiplier: usize,
    multiline_multiplier: usize,
    /// Largest distance between counted occurrences: with non-overlapping counting the
    /// distance is the period rounded up to at least `width`.
    max_gap: u64,
    /// Windows must start at or after this position (the start of the turn).
    turn_start: u64,
    /// Winnowing keys of the last `WINNOW` positions (`u32::MAX` before the turn's first
    /// chunk), and the current minimum among them.
    keys: [u32; WINNOW],
    min_key: u32,
    min_pos: u64,
    /// Allocated on the first anchor, so short replies and disabled detectors never pay.
    table: Vec<Slot>,
}

/// Bytes of the repeated text quoted in a chant verdict (at most).
const QUOTE_BYTES: usize = 96;
/// Prefix hashes kept (a power of two): an anchor is recorded up to `WINNOW` positions
/// after it and then needs the prefix hashes of the `width` bytes before it (its chunk hash,
/// the blank check) or of the `QUOTE_BYTES` before it (the quote).
const RING: usize = (MAX_CHANT_WINDOW + QUOTE_BYTES + WINNOW + 2).next_power_of_two();
const NEWLINES: usize = 2 * WINNOW;

impl Chant {
    fn new(config: &LoopDetectionConfig) -> Self {
        let width = config
            .chant_window_chars
            .clamp(MIN_CHANT_WINDOW, MAX_CHANT_WINDOW);
        let max_period = config.chant_max_period.clamp(1, MAX_CHANT_PERIOD);
        Self {
            width: width as u64,
            base_pow_width: base_pow(width as u64),
            ring: [0; RING],
            newlines: [0; NEWLINES],
            newline_count: 0,
            repeats: config.chant_repeats.max(2),
            fence_multiplier: config.fence_multiplier.max(1),
            multiline_multiplier: config.chant_multiline_multiplier.max(1),
            max_gap: (max_period + width) as u64,
            turn_start: 0,
            keys: [u32::MAX; WINNOW],
            min_key: u32::MAX,
            min_pos: 0,
            table: Vec::new(),
        }
    }

    /// Windows never span two turns and chains never continue from an earlier turn (the
    /// table is not cleared: entries older than `turn_start` are simply treated as empty).
    fn reset_turn(&mut self, pos: u64) {
        self.turn_start = pos;
        self.keys = [u32::MAX; WINNOW];
        self.min_key = u32::MAX;
        self.min_pos = 0;
    }

    fn push_newline(&mut self, pos: u64) {
        self.newlines[self.newline_count % NEWLINES] = pos;
        self.newline_count += 1;
    }

    /// Whether a newline lies in `(from, to]`; `to` is an anchor still in reach.
    fn newline_between(&self, from: u64, to: u64) -> bool {
        let kept = self.newline_count.min(NEWLINES);
        (1..=kept)
            .map(|back| self.newlines[(self.newline_count - back) % NEWLINES])
            .find(|&nl| nl <= to)
            .is_some_and(|nl| nl > from)
    }

    /// The smallest key among the `WINNOW` positions ending at `pos`, and its newest
    /// position (searched back from the newest).
    #[inline(never)]
    fn window_min(&self, pos: u64) -> (u32, u64) {
        let min = self.keys.iter().fold(u32::MAX, |m, &k| m.min(k));
        let back = (0..WINNOW as u64)
            .find(|&back| self.keys[(pos - back) as usize % WINNOW] == min)
            .unwrap_or(0);
        (min, pos - back)
    }

    /// A new anchor at `anchor_pos` (`now` is the current position): extend or restart the
    /// chain of its chunk, and judge it.
    #[inline(never)]
    fn record(&mut self, anchor_pos: u64, now: u64, in_fence: bool) -> Option<LoopVerdict> {
        debug_assert!(now - anchor_pos < WINNOW as u64);
        let hash = self.ring[anchor_pos as usize % RING];
        let before = self.ring[(anchor_pos - self.width) as usize % RING];
        let value = hash.wrapping_sub(before.wrapping_mul(self.base_pow_width));
        if self.table.is_empty() {
            self.table = vec![Slot::default(); TABLE_SLOTS];
        }
        let index = (mix(value) >> (64 - TABLE_BITS)) as usize;
        let floor = self.turn_start + self.width;
        let slot = &mut self.table[index];
        if slot.key != value || slot.pos < floor || anchor_pos - slot.pos > self.max_gap {
            *slot = Slot {
                key: value,
                pos: anchor_pos,
                hash,
                segment: 0,
                gap: 0,
                count: 1,
            };
            return None;
        }
        // At most `max_gap`, which fits 32 bits.
        let gap = anchor_pos - slot.pos;
        if gap < self.width {
            // Overlaps the last counted occurrence: a short period; wait for a disjoint one.
            return None;
        }
        let segment = hash.wrapping_sub(slot.hash.wrapping_mul(base_pow(gap)));
        if slot.count >= 2 && u64::from(slot.gap) == gap && slot.segment == segment {
            slot.count = slot.count.saturating_add(1);
        } else {
            slot.count = 2;
            slot.gap = gap as u32;
            slot.segment = segment;
        }
        slot.pos = anchor_pos;
        slot.hash = hash;
        let count = slot.count;
        // Multipliers do not compound: a fenced loop of short lines is held to the higher of
        // the two bars, not their product.
        let multiline = self.newline_between(anchor_pos - gap, anchor_pos);
        let fence = if in_fence { self.fence_multiplier } else { 1 };
        let multiline = if multiline {
            self.multiline_multiplier
        } else {
            1
        };
        let threshold = self.repeats.saturating_mul(fence.max(multiline));
        if (count as usize) < threshold {
            return None;
        }
        // Runs of blanks are left to the line rules. Checked only here, at the rare moment a
        // chain is long enough, rather than for every anchor.
        let blank =
            (anchor_pos - self.width + 1..=anchor_pos).all(|p| is_blank(byte_at(&self.ring, p)));
        if blank {
            return None;
        }
        // The anchor is at most WINNOW bytes behind the current byte, so the repeated text
        // before it is still in the ring.
        let n = gap.min(QUOTE_BYTES as u64);
        let quoted: Vec<u8> = (anchor_pos - n + 1..=anchor_pos)
            .map(|p| byte_at(&self.ring, p))
            .collect();
        let span = u64::from(count - 1) * gap + self.width;
        let place = if in_fence { " in a code block" } else { "" };
        Some(LoopVerdict {
            kind: LoopKind::Chanting,
            detail: format!(
                "text repeating every {gap} bytes for {span} bytes{place}: {}",
                quote(&quoted)
            ),
        })
    }
}

/// Identical consecutive tool calls.
struct ToolCalls {
    repeats: usize,
    last: Option<u64>,
    streak: usize,
}

impl ToolCalls {
    fn new(config: &LoopDetectionConfig) -> Self {
        Self {
            repeats: config.tool_call_repeats.max(2),
            last: None,
            streak: 0,
        }
    }

    fn push(&mut self, name: &str, arguments: &Value) -> Option<LoopVerdict> {
        let key = tool_call_key(name, arguments);
        if self.last == Some(key) {
            self.streak += 1;
        } else {
            self.last = Some(key);
            self.streak = 1;
        }
        if self.streak < self.repeats {
            return None;
        }
        let shown = clip_chars(name, DETAIL_CHARS);
        Some(LoopVerdict {
            kind: LoopKind::RepeatedToolCall,
            detail: format!(
                "tool call {shown:?} repeated {} times in a row with the same arguments",
                self.streak
            ),
        })
    }
}

/// A hash of the call's canonical form: object keys sorted, integral numbers compared by
/// value (`1` and `1.0` are the same argument), arguments given as a JSON string parsed.
/// Only a hash is kept, so a huge argument is never stored.
fn tool_call_key(name: &str, arguments: &Value) -> u64 {
    let mut hasher = DefaultHasher::new();
    hasher.write_usize(name.len());
    hasher.write(name.as_bytes());
    match arguments {
        Value::String(text) if text.trim_start().starts_with(['{', '[']) => {
            match serde_json::from_str::<Value>(text) {
                Ok(parsed) => hash_value(&parsed, &mut hasher),
                Err(_) => hash_value(arguments, &mut hasher),
            }
        }
        _ => hash_value(arguments, &mut hasher),
    }
    hasher.finish()
}

fn hash_value(value: &Value, hasher: &mut DefaultHasher) {
    match value {
        Value::Null => hasher.write_u8(0),
        Value::Bool(b) => {
            hasher.write_u8(1);
            hasher.write_u8(u8::from(*b));
        }
        Value::Number(number) => {
            hasher.write_u8(2);
            if let Some(i) = number.as_i64() {
                hasher.write_u8(0);
                hasher.write_i64(i);
            } else if let Some(u) = number.as_u64() {
                hasher.write_u8(1);
                hasher.write_u64(u);
            } else {
                let f = number.as_f64().unwrap_or(f64::NAN);
                if f.fract() == 0.0 && f.abs() < 9.0e15 {
                    hasher.write_u8(0);
                    hasher.write_i64(f as i64);
                } else {
                    hasher.write_u8(3);
                    hasher.write_u64(f.to_bits());
                }
            }
        }
        Value::String(text) => {
            hasher.write_u8(3);
            hasher.write_usize(text.len());
            hasher.write(text.as_bytes());
        }
        Value::Array(items) => {
            hasher.write_u8(4);
            hasher.write_usize(items.len());
            for item in items {
                hash_value(item, hasher);
            }
        }
        Value::Object(map) => {
            hasher.write_u8(5);
            hasher.write_usize(map.len());
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            for (key, item) in entries {
                hasher.write_usize(key.len());
                hasher.write(key.as_bytes());
                hash_value(item, hasher);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Deserialize)]
    struct Vectors {
        about: String,
        cases: Vec<Case>,
    }

    #[derive(Deserialize, Debug, Clone)]
    struct Case {
        name: String,
        stream: String,
        fires: bool,
    }

    fn vectors() -> Vectors {
        serde_json::from_str(include_str!("../../tests/data/loop_detection.json"))
            .expect("tests/data/loop_detection.json parses")
    }

    /// Feeds the parts, ends the turn, and returns the verdict with the byte it fired at.
    fn run<'a>(
        config: &LoopDetectionConfig,
        parts: impl IntoIterator<Item = &'a str>,
    ) -> (Option<LoopVerdict>, Option<u64>) {
        let mut detector = LoopDetector::new(config);
        let mut first: Option<LoopVerdict> = None;
        for part in parts {
            if let Some(v) = detector.push_text(part) {
                assert!(first.is_none(), "fired twice");
                first = Some(v);
            }
        }
        if let Some(v) = detector.end_turn() {
            assert!(first.is_none(), "fired twice");
            first = Some(v);
        }
        assert_eq!(first.as_ref(), detector.verdict());
        (first, detector.fired_at())
    }

    fn run_whole(text: &str) -> (Option<LoopVerdict>, Option<u64>) {
        run(&LoopDetectionConfig::default(), [text])
    }

    /// A chant on the long first line of a turn: found, at the same byte, whether the line
    /// comes whole or in tokens, in the first turn and in a later one. (Found by the
    /// loop_detector fuzz target: on a later turn, a line pushed whole missed every anchor
    /// after the first expiry of the winnowing minimum.)
    #[test]
    fn a_chant_on_a_turns_long_first_line_is_found_however_it_is_cut() {
        let chant = "I should check the file again. ".repeat(24);
        for i in 0..40 {
            let text = format!("Step {i}: reading the config {} and then {chant}", i * 7919);
            let whole = run_whole(&text);
            assert!(
                whole
                    .0
                    .as_ref()
                    .is_some_and(|v| v.kind == LoopKind::Chanting),
                "{i}: {whole:?}"
            );
            let tokens: Vec<&str> = text
                .as_bytes()
                .chunks(5)
                .map(|c| std::str::from_utf8(c).unwrap())
                .collect();
            assert_eq!(run(&LoopDetectionConfig::default(), tokens), whole, "{i}");
            // The same after an earlier turn.
            let mut detector = LoopDetector::new(&LoopDetectionConfig::default());
            detector.push_text("A first turn, short and fine.\n");
            detector.end_turn();
            detector.push_text(&text);
            detector.end_turn();
            assert!(detector.verdict().is_some(), "{i}: after a turn");
        }
    }

    fn chars_of(text: &str) -> Vec<&str> {
        text.char_indices()
            .map(|(i, c)| &text[i..i + c.len_utf8()])
            .collect()
    }

    /// Cuts `text` at the char boundaries picked by `cuts`.
    fn split<'a>(text: &'a str, cuts: &[prop::sample::Index]) -> Vec<&'a str> {
        let boundaries: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
        if boundaries.is_empty() {
            return vec![text];
        }
        let mut at: Vec<usize> = cuts
            .iter()
            .map(|c| boundaries[c.index(boundaries.len())])
            .collect();
        at.sort_unstable();
        at.dedup();
        let mut parts = Vec::with_capacity(at.len() + 1);
        let mut start = 0;
        for cut in at {
            parts.push(&text[start..cut]);
            start = cut;
        }
        parts.push(&text[start..]);
        parts
    }

    /// Deterministic pseudo-random prose: sentences of words drawn from a vocabulary, so no
    /// two sentences are alike but the text has the statistics of real prose.
    fn prose(bytes: usize, seed: u64) -> String {
        const WORDS: &[&str] = &[
            "the",
            "model",
            "worker",
            "returns",
            "a",
            "stream",
            "of",
            "tokens",
            "while",
            "we",
            "check",
            "each",
            "line",
            "for",
            "errors",
            "and",
            "then",
            "continue",
            "with",
            "next",
            "request",
            "queue",
            "latency",
            "budget",
            "is",
            "small",
            "but",
            "fleet",
            "scales",
            "horizontally",
            "across",
            "nodes",
            "configuration",
            "value",
            "schema",
            "retry",
            "timeout",
            "because",
            "every",
            "client",
            "expects",
            "answer",
            "quickly",
            "über",
            "naïve",
            "café",
            "数据",
            "résumé",
            "shard",
            "migration",
            "logs",
            "index",
            "cache",
        ];
        let mut state = seed | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut out = String::with_capacity(bytes + 200);
        let mut sentence = 0u64;
        while out.len() < bytes {
            let words = 6 + next() % 14;
            for w in 0..words {
                let word = WORDS[(next() % WORDS.len() as u64) as usize];
                if w == 0 {
                    let mut c = word.chars();
                    if let Some(f) = c.next() {
                        out.extend(f.to_uppercase());
                        out.push_str(c.as_str());
                    }
                } else {
                    out.push(' ');
                    out.push_str(word);
                }
            }
            sentence += 1;
            out.push_str(match next() % 6 {
                0 => ".\n",
                1 => ".\n\n",
                _ => ". ",
            });
            if sentence.is_multiple_of(50) {
                out.push_str(&format!("- item {} is {}\n", next() % 1000, next() % 97));
            }
        }
        out
    }

    #[test]
    fn vectors_fed_whole() {
        let v = vectors();
        assert!(
            v.about.contains("DEFAULT"),
            "vectors are for default settings"
        );
        for case in &v.cases {
            let (verdict, at) = run_whole(&case.stream);
            assert_eq!(
                verdict.is_some(),
                case.fires,
                "case {:?}: got {verdict:?} at {at:?} ({})",
                case.name,
                v.about
            );
            if let Some(at) = at {
                assert!(at <= case.stream.len() as u64);
            }
        }
    }

    #[test]
    fn vectors_fire_with_the_expected_kind() {
        let expected = [
            ("39-char line x8", LoopKind::RepeatedLine),
            ("39-char line x40", LoopKind::RepeatedLine),
            ("120-char line x5", LoopKind::RepeatedLine),
            ("two lines alternating x10", LoopKind::RepeatedLine),
            ("chanting without newlines", LoopKind::Chanting),
            ("loop inside an unclosed code fence", LoopKind::RepeatedLine),
        ];
        let v = vectors();
        for (name, kind) in expected {
            let case = v.cases.iter().find(|c| c.name == name).expect(name);
            let (verdict, _) = run_whole(&case.stream);
            assert_eq!(verdict.map(|v| v.kind), Some(kind), "{name}");
        }
    }

    #[test]
    fn vectors_fed_char_by_char() {
        for case in &vectors().cases {
            let whole = run_whole(&case.stream);
            let by_char = run(&LoopDetectionConfig::default(), chars_of(&case.stream));
            assert_eq!(by_char, whole, "case {:?}", case.name);
        }
    }

    proptest! {
        #[test]
        fn vectors_do_not_depend_on_the_split(
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..80)
        ) {
            for case in &vectors().cases {
                let whole = run_whole(&case.stream);
                prop_assert_eq!(whole.0.is_some(), case.fires, "case {:?}", case.name);
                let parts = split(&case.stream, &cuts);
                let split_run = run(&LoopDetectionConfig::default(), parts);
                prop_assert_eq!(split_run, whole, "case {:?}", case.name);
            }
        }

        #[test]
        fn any_text_does_not_depend_on_the_split(
            pieces in prop::collection::vec(
                prop::sample::select(vec![
                    "abc", " ", "\n", "é", "数", "```\n", "| a | b |\n", "\r\n",
                    "and then we go around again, ", "the quick brown fox jumps over the dog!\n",
                    "0, ", "=", "    x = 1\n",
                ]),
                0..400,
            ),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..60),
            repeat in 1usize..4,
        ) {
            let mut text = String::new();
            for piece in &pieces {
                for _ in 0..repeat {
                    text.push_str(piece);
                }
            }
            let whole = run_whole(&text);
            prop_assert_eq!(run(&LoopDetectionConfig::default(), split(&text, &cuts)), whole);
        }
    }

    #[test]
    fn tool_call_repeated_five_times_fires() {
        let config = LoopDetectionConfig::default();
        let mut d = LoopDetector::new(&config);
        let args = json!({"path": "src/main.rs", "lines": [1, 20]});
        for _ in 0..4 {
            assert_eq!(d.push_tool_call("read_file", &args), None);
        }
        let verdict = d.push_tool_call("read_file", &args).expect("fires at 5");
        assert_eq!(verdict.kind, LoopKind::RepeatedToolCall);
        assert!(verdict.detail.contains("read_file"), "{}", verdict.detail);
        // Latched: reported once.
        assert_eq!(d.push_tool_call("read_file", &args), None);
        assert_eq!(d.verdict(), Some(&verdict));
    }

    #[test]
    fn tool_call_repeated_four_times_does_not_fire() {
        let mut d = LoopDetector::new(&LoopDetectionConfig::default());
        for _ in 0..4 {
            assert_eq!(d.push_tool_call("ls", &json!({"dir": "."})), None);
        }
        assert_eq!(d.end_turn(), None);
        assert_eq!(d.verdict(), None);
    }

    #[test]
    fn a_different_tool_call_in_between_resets() {
        let same = json!({"cmd": "cargo test"});
        let others = [
            // Same name, different arguments.
            ("shell", json!({"cmd": "cargo build"})),
            // Same arguments, different name.
            ("shell2", same.clone()),
        ];
        for (name, args) in &others {
            let mut d = LoopDetector::new(&LoopDetectionConfig::default());
            for round in 0..5 {
                for _ in 0..4 {
                    assert_eq!(d.push_tool_call("shell", &same), None, "round {round}");
                }
                assert_eq!(d.push_tool_call(name, args), None);
            }
            // Uninterrupted, the fifth one fires.
            for _ in 0..4 {
                assert_eq!(d.push_tool_call("shell", &same), None);
            }
            assert!(d.push_tool_call("shell", &same).is_some());
        }
    }

    #[test]
    fn tool_call_arguments_compare_canonically() {
        let mut d = LoopDetector::new(&LoopDetectionConfig::default());
        let forms = [
            json!({"a": 1, "b": {"x": [1, 2], "y": null}}),
            json!({"b": {"y": null, "x": [1, 2]}, "a": 1}),
            json!({"a": 1.0, "b": {"x": [1, 2.0], "y": null}}),
            json!("{\"b\": {\"x\": [1,2], \"y\": null}, \"a\": 1}"),
        ];
        for form in &forms {
            assert_eq!(d.push_tool_call("f", form), None);
        }
        let verdict = d.push_tool_call("f", &forms[0]);
        assert_eq!(verdict.map(|v| v.kind), Some(LoopKind::RepeatedToolCall));
        // Array order and string-vs-number do matter.
        let mut d = LoopDetector::new(&LoopDetectionConfig::default());
        for args in [
            json!([1, 2]),
            json!([2, 1]),
            json!([1, 2]),
            json!(["1", 2]),
            json!([1, 2]),
        ] {
            assert_eq!(d.push_tool_call("f", &args), None);
        }
    }

    #[test]
    fn text_does_not_reset_the_tool_call_streak() {
        let mut d = LoopDetector::new(&LoopDetectionConfig::default());
        let args = json!({"q": "status"});
        for i in 0..4 {
            assert_eq!(
                d.push_text(&format!("Attempt {i}: checking again.\n")),
                None
            );
            assert_eq!(d.push_tool_call("poll", &args), None);
            assert_eq!(d.end_turn(), None);
        }
        assert!(d.push_tool_call("poll", &args).is_some());
    }

    #[test]
    fn disabled_config_never_fires() {
        let config = LoopDetectionConfig {
            enabled: false,
            ..LoopDetectionConfig::default()
        };
        for case in &vectors().cases {
            assert_eq!(
                run(&config, [case.stream.as_str()]),
                (None, None),
                "{}",
                case.name
            );
        }
        let mut d = LoopDetector::new(&config);
        for _ in 0..50 {
            assert_eq!(d.push_tool_call("x", &json!({})), None);
        }
        assert_eq!(d.push_text(&"and again and again ".repeat(1000)), None);
        assert_eq!(d.end_turn(), None);
    }

    /// The sizes of everything the detector keeps, to check memory stays bounded.
    fn footprint(d: &LoopDetector) -> usize {
        d.lines.recent.capacity() * 8
            + d.lines.counts.capacity() * 12
            + d.lines.tiers.capacity() * 16
            + d.chant.table.capacity() * std::mem::size_of::<Slot>()
            + d.pending.capacity()
            + std::mem::size_of::<LoopDetector>()
    }

    fn assert_bounded(d: &LoopDetector, config: &LoopDetectionConfig) {
        assert!(d.lines.recent.len() <= config.line_window);
        assert!(d.lines.counts.len() <= config.line_window);
        assert!(d.lines.recent.capacity() <= 2 * config.line_window + 8);
        assert!(d.lines.counts.capacity() <= 4 * config.line_window + 8);
        assert!(d.chant.table.len() <= TABLE_SLOTS);
        assert!(d.chant.newline_count <= d.pos as usize);
        assert!(d.lines.head_len <= HEAD_BYTES);
        assert!(d.pending.len() < PENDING_BYTES);
        assert!(d.pending.capacity() <= PENDING_BYTES);
        assert!(std::mem::size_of::<LoopDetector>() < 8 * 1024);
        assert!(footprint(d) < 128 * 1024, "footprint {}", footprint(d));
    }

    #[test]
    fn long_distinct_prose_never_fires_and_memory_stays_bounded() {
        let config = LoopDetectionConfig::default();
        let text = prose(400_000, 7);
        let mut d = LoopDetector::new(&config);
        let mut offset = 0;
        let mut step = 1;
        while offset < text.len() {
            let mut end = (offset + step).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            assert_eq!(d.push_text(&text[offset..end]), None, "at byte {offset}");
            offset = end;
            step = step % 23 + 1;
        }
        assert_eq!(d.end_turn(), None);
        assert_bounded(&d, &config);
        let after_prose = footprint(&d);

        // Much more text, including one enormous line and lots of lines, changes nothing.
        let one_line = prose(2_000_000, 11).replace('\n', " ");
        assert_eq!(d.push_text(&one_line), None);
        for seed in 0..5 {
            assert_eq!(d.push_text(&prose(200_000, 100 + seed)), None);
        }
        assert_eq!(d.end_turn(), None);
        assert_bounded(&d, &config);
        assert!(footprint(&d) <= 2 * after_prose);
    }

    #[test]
    fn whitespace_floods_do_not_fire() {
        let text = format!(
            "Start.\n{}\n{}End.\n",
            " ".repeat(50_000),
            "\n  \t\r\n".repeat(10_000)
        );
        assert_eq!(run_whole(&text).0, None);
    }

    #[test]
    fn a_loop_beginning_late_still_fires() {
        let mut text = prose(150_000, 3);
        let before = text.len() as u64;
        text.push_str(&"and then we go around again, ".repeat(40));
        let (verdict, at) = run_whole(&text);
        assert_eq!(verdict.map(|v| v.kind), Some(LoopKind::Chanting));
        assert!(at.unwrap() > before);

        let mut text = prose(150_000, 4);
        text.push('\n');
        for _ in 0..8 {
            text.push_str("I should double-check the configuration file.\n");
            text.push_str(&prose(60, 9));
            text.push('\n');
        }
        let (verdict, _) = run_whole(&text);
        assert_eq!(verdict.map(|v| v.kind), Some(LoopKind::RepeatedLine));
    }

    #[test]
    fn line_thresholds_by_length() {
        // 8..24 visible chars: 12 repeats.
        let short = "Checking again.\n";
        assert_eq!(run_whole(&short.repeat(11)).0, None);
        assert!(run_whole(&short.repeat(12)).0.is_some());
        // 24..80: 8 repeats.
        let mid = "Let me look at the file once more.\n";
        assert_eq!(run_whole(&mid.repeat(7)).0, None);
        assert!(run_whole(&mid.repeat(8)).0.is_some());
        // 80 and more: 5 repeats.
        let long = format!("{}\n", "word ".repeat(20).trim_end());
        assert_eq!(run_whole(&long.repeat(4)).0, None);
        assert!(run_whole(&long.repeat(5)).0.is_some());
        // Below line_min_chars: never.
        assert_eq!(run_whole(&"} else {\n".repeat(100)).0, None);
        // A line repeated two or three times among other text: never.
        let mut text = String::new();
        for i in 0..60 {
            text.push_str(&format!(
                "Paragraph {i} explains step {} in detail.\n",
                i * 7
            ));
            if i == 20 {
                text.push_str(&mid.repeat(3));
            }
            if i == 40 {
                text.push_str(&"Now the second part of the plan.\n".repeat(2));
            }
        }
        assert_eq!(run_whole(&text).0, None);
    }

    #[test]
    fn lines_compare_exact_text_but_ignore_trailing_blanks_and_cr() {
        let mut text = String::new();
        for i in 0..8 {
            text.push_str(match i % 3 {
                0 => "the quick brown fox jumps over the dog!\r\n",
                1 => "the quick brown fox jumps over the dog!   \n",
                _ => "the quick brown fox jumps over the dog!\n",
            });
        }
        assert_eq!(
            run_whole(&text).0.map(|v| v.kind),
            Some(LoopKind::RepeatedLine)
        );
        // Different indentation is different text.
        let mut text = String::new();
        for i in 0..8 {
            text.push_str(&" ".repeat(i));
            text.push_str("the quick brown fox jumps over the dog!\n");
        }
        assert_eq!(run_whole(&text).0, None);
    }

    #[test]
    fn repeats_far_apart_fall_out_of_the_window() {
        let mut text = String::new();
        for i in 0..7 * 300 {
            if i % 300 == 0 {
                text.push_str("## Summary of the section above, in short\n");
            } else {
                text.push_str(&format!("Distinct line number {i} with some words.\n"));
            }
        }
        text.push_str("## Summary of the section above, in short\n");
        assert_eq!(run_whole(&text).0, None);
    }

    #[test]
    fn table_rows_need_a_higher_threshold() {
        let row = "| pending | pending | pending |\n";
        let head = "| a | b | c |\n|---|---|---|\n";
        assert_eq!(run_whole(&format!("{head}{}", row.repeat(20))).0, None);
        let (verdict, _) = run_whole(&format!("{head}{}", row.repeat(48)));
        let verdict = verdict.expect("48 identical rows fire");
        assert!(verdict.detail.contains("table"), "{}", verdict.detail);
    }

    #[test]
    fn fences_raise_thresholds_but_do_not_exempt() {
        let line = "    result = fetch(url, retries=3)\n";
        let closed = format!("```python\n{}```\nDone.\n", line.repeat(20));
        assert_eq!(run_whole(&closed).0, None);
        let unclosed = format!("```python\n{}", line.repeat(32));
        let verdict = run_whole(&unclosed)
            .0
            .expect("fires inside an unclosed fence");
        assert!(verdict.detail.contains("code block"), "{}", verdict.detail);
        // After the fence closes, normal thresholds apply again.
        let after = format!(
            "```\ncode\n```\n{}",
            "Let me look at the file once more.\n".repeat(8)
        );
        assert!(run_whole(&after).0.is_some());
    }

    #[test]
    fn end_turn_completes_a_partial_line() {
        let line = "the quick brown fox jumps over the dog!";
        let mut d = LoopDetector::new(&LoopDetectionConfig::default());
        for _ in 0..7 {
            assert_eq!(d.push_text(line), None);
            assert_eq!(d.push_text("\n"), None);
        }
        assert_eq!(d.push_text(line), None);
        let verdict = d.end_turn().expect("the 8th line completes at end_turn");
        assert_eq!(verdict.kind, LoopKind::RepeatedLine);
        assert_eq!(d.fired_at(), Some(8 * 39 + 7));
    }

    #[test]
    fn each_turn_starts_afresh_for_text() {
        let line = "Let me look at the file once more.\n";
        let mut d = LoopDetector::new(&LoopDetectionConfig::default());
        for _ in 0..10 {
            assert_eq!(d.push_text(&line.repeat(4)), None);
            assert_eq!(d.end_turn(), None);
        }
        // A chant cannot be stitched together across turns either.
        let mut d = LoopDetector::new(&LoopDetectionConfig::default());
        for _ in 0..10 {
            assert_eq!(d.push_text(&"round and round we go, ".repeat(10)), None);
            assert_eq!(d.end_turn(), None);
        }
    }

    #[test]
    fn a_line_loop_is_reported_with_the_delta_that_ends_the_line() {
        let stream = &vectors().cases[0].stream;
        let mut d = LoopDetector::new(&LoopDetectionConfig::default());
        let mut fed = 0;
        for piece in chars_of(stream) {
            fed += piece.len();
            if let Some(verdict) = d.push_text(piece) {
                assert_eq!(verdict.kind, LoopKind::RepeatedLine);
                assert_eq!(fed, stream.len(), "reported at the newline of the 8th line");
                assert_eq!(d.fired_at(), Some(stream.len() as u64));
                return;
            }
        }
        panic!("never fired");
    }

    #[test]
    fn a_chant_is_reported_soon_after_the_byte_that_completes_it() {
        let stream = &vectors().cases[4].stream;
        let mut d = LoopDetector::new(&LoopDetectionConfig::default());
        let mut fed = 0u64;
        for piece in chars_of(stream) {
            fed += piece.len() as u64;
            if let Some(verdict) = d.push_text(piece) {
                assert_eq!(verdict.kind, LoopKind::Chanting);
                let at = d.fired_at().unwrap();
                assert!(at <= fed && fed <= at + PENDING_BYTES as u64, "{at} {fed}");
                assert!(
                    verdict.detail.contains("and then we go around again,"),
                    "{}",
                    verdict.detail
                );
                return;
            }
        }
        panic!("never fired");
    }

    proptest! {
        #[test]
        fn char_count_matches_the_plain_definition(bytes in prop::collection::vec(any::<u8>(), 0..100)) {
            let plain = bytes.iter().filter(|&&b| b > b' ' && b & 0xC0 != 0x80).count() as u64;
            prop_assert_eq!(count_chars(&bytes), plain);
        }

        #[test]
        fn bytes_are_recovered_from_the_prefix_hashes(text in "[a-z \n\u{e9}\u{6570}]{0,400}") {
            let mut d = LoopDetector::new(&LoopDetectionConfig::default());
            prop_assert_eq!(d.push_text(&text), None);
            prop_assert_eq!(d.end_turn(), None);
            let bytes = text.as_bytes();
            prop_assert_eq!(d.pos, bytes.len() as u64);
            // The ring holds the last RING - 1 bytes.
            let kept = bytes.len().saturating_sub(RING - 1);
            for (i, &b) in bytes.iter().enumerate().skip(kept) {
                prop_assert_eq!(byte_at(&d.chant.ring, (i + 1) as u64), b);
            }
        }
    }

    #[test]
    fn short_line_loops_are_caught_as_chanting() {
        // Too short for the line rules, so only chanting's multi-line backstop sees them.
        let (verdict, _) = run_whole(&"Wait.\n".repeat(500));
        assert_eq!(verdict.map(|v| v.kind), Some(LoopKind::Chanting));
        assert_eq!(run_whole(&"Wait.\n".repeat(100)).0, None);
    }

    #[test]
    fn structured_repetition_is_not_chanting() {
        // One-line JSON array whose elements differ only in a short field.
        let mut json_line = String::from("[");
        for i in 0..60 {
            json_line.push_str(&format!(
                "{{\"name\": \"n{i}\", \"enabled\": true, \"retries\": 3, \"timeout\": 30}}, "
            ));
        }
        json_line.push_str("]\n");
        assert_eq!(run_whole(&json_line).0, None);
        // A short horizontal rule and a short run of zeros.
        assert_eq!(run_whole(&format!("{}\n", "=".repeat(120))).0, None);
        assert_eq!(run_whole(&format!("[{}]\n", "0, ".repeat(60))).0, None);
    }

    #[test]
    fn chanting_with_multibyte_text_quotes_whole_chars() {
        let text = format!(
            "Réponse : {}",
            "on recommence encore une fois, é数é, ".repeat(40)
        );
        let (verdict, _) = run_whole(&text);
        let verdict = verdict.expect("fires");
        assert_eq!(verdict.kind, LoopKind::Chanting);
        assert!(!verdict.detail.contains('\u{FFFD}'), "{}", verdict.detail);
    }

    #[test]
    fn details_are_short_and_cut_on_char_boundaries() {
        let line = format!("{}\n", "é".repeat(150));
        let (verdict, _) = run_whole(&line.repeat(5));
        let verdict = verdict.expect("a 150-char line x5 fires");
        assert!(
            verdict.detail.starts_with("line repeated 5 times: \""),
            "{}",
            verdict.detail
        );
        assert!(verdict.detail.chars().count() < 100, "{}", verdict.detail);
        assert!(verdict.detail.contains('…'));
        assert!(!verdict.detail.contains('\u{FFFD}'));

        let (verdict, _) = run_whole(&vectors().cases[0].stream);
        assert_eq!(
            verdict.unwrap().detail,
            "line repeated 8 times: \"the quick brown fox jumps over the dog!\""
        );
    }

    #[test]
    fn validate_rejects_nonsense() {
        let bad = [
            LoopDetectionConfig {
                line_window: 0,
                ..Default::default()
            },
            LoopDetectionConfig {
                chant_repeats: 1,
                ..Default::default()
            },
            LoopDetectionConfig {
                tool_call_repeats: 0,
                ..Default::default()
            },
            LoopDetectionConfig {
                chant_window_chars: 0,
                ..Default::default()
            },
            LoopDetectionConfig {
                chant_max_period: 0,
                ..Default::default()
            },
            LoopDetectionConfig {
                fence_multiplier: 0,
                ..Default::default()
            },
            LoopDetectionConfig {
                line_tiers: vec![LineTier {
                    min_len: 8,
                    repeats: 1,
                }],
                ..Default::default()
            },
            LoopDetectionConfig {
                line_tiers: vec![
                    LineTier {
                        min_len: 80,
                        repeats: 5,
                    },
                    LineTier {
                        min_len: 8,
                        repeats: 9,
                    },
                ],
                ..Default::default()
            },
            LoopDetectionConfig {
                line_window: 20,
                ..Default::default()
            },
        ];
        for config in bad {
            assert!(config.validate().is_err(), "{config:?}");
            // Clamped instead of panicking.
            let _ = run(&config, ["the quick brown fox jumps over the dog!\n"; 30]);
        }
    }
}
