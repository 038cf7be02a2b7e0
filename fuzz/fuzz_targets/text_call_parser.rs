//! Assistant text streamed through the text tool-call parser, cut into deltas at arbitrary
//! places. The parser decides on the bytes alone, so however the stream is cut the visible
//! text and the calls found are those of the whole text pushed at once; and the visible text
//! plus the calls' raw text never exceed what was written.
#![no_main]

use arbitrary::Arbitrary;
use genfleet::engine::text_calls::{ParseMode, ParsedItem, TextCallParser};

#[derive(Arbitrary, Debug)]
struct Input {
    text_mode: bool,
    /// A small candidate limit exercises the give-up paths; otherwise the default.
    small_limit: bool,
    cuts: Vec<u16>,
    text: String,
}

fn run(mode: ParseMode, limit: usize, pieces: &[&str]) -> (String, Vec<ParsedItem>) {
    let mut parser = TextCallParser::with_limit(mode, limit);
    let mut visible = String::new();
    for piece in pieces {
        parser.push(piece, &mut visible);
    }
    let items = parser.finish(&mut visible);
    (visible, items)
}

libfuzzer_sys::fuzz_target!(|input: Input| {
    let mode = if input.text_mode {
        ParseMode::Text
    } else {
        ParseMode::Native
    };
    let limit = if input.small_limit {
        64
    } else {
        genfleet::engine::text_calls::DEFAULT_MAX_CANDIDATE_BYTES
    };
    let text = input.text.as_str();
    let pieces = genfleet_fuzz::cut(text, &input.cuts);
    let whole = run(mode, limit, &[text]);
    let split = run(mode, limit, &pieces);
    assert_eq!(whole, split, "cut at {pieces:?}");
    assert!(whole.0.len() <= text.len());
});
