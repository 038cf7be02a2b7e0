//! Text cut to a size. Records, headers, signals, logs and screens all shorten text that a peer
//! or a model wrote, and every layer does it the same way: on a character boundary (a cut
//! inside a UTF-8 sequence would panic or corrupt the text), marked where something was left
//! out. The cuts live here, once, because what they produce crosses the bus.

/// The mark of text left out.
pub const ELLIPSIS: char = '…';

/// The largest character boundary of `text` at or below `index` (the length when `index` is
/// beyond it). `str::floor_char_boundary` does this from Rust 1.91, above genfleet's
/// `rust-version`.
pub fn floor_char_boundary(text: &str, index: usize) -> usize {
    if index >= text.len() {
        return text.len();
    }
    let mut at = index;
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// The smallest character boundary of `text` at or above `index` (the length when `index` is
/// beyond it).
pub fn ceil_char_boundary(text: &str, index: usize) -> usize {
    if index >= text.len() {
        return text.len();
    }
    let mut at = index;
    while !text.is_char_boundary(at) {
        at += 1;
    }
    at
}

/// At most `max` bytes of `text`, whole characters only.
pub fn head_bytes(text: &str, max: usize) -> &str {
    &text[..floor_char_boundary(text, max)]
}

/// At most `max` characters of `text`.
pub fn head_chars(text: &str, max: usize) -> &str {
    match text.char_indices().nth(max) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

/// At most `max` bytes of `text`, then `…` when there was more (so the result may be three
/// bytes longer than `max`).
pub fn clip_bytes(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    format!("{}{ELLIPSIS}", head_bytes(text, max))
}

/// The first `max` characters of `text`, then `…` when there was more.
pub fn clip_chars(text: &str, max: usize) -> String {
    let head = head_chars(text, max);
    if head.len() == text.len() {
        return text.to_string();
    }
    format!("{head}{ELLIPSIS}")
}

/// The first `max` characters of `text`, then how many were left out, for a reader who may
/// want to know how much is missing (`... (12 more characters)`).
pub fn clip_chars_counted(text: &str, max: usize) -> String {
    let head = head_chars(text, max);
    if head.len() == text.len() {
        return text.to_string();
    }
    let left_out = text[head.len()..].chars().count();
    format!("{head}... ({left_out} more characters)")
}

/// `text` on one line: every run of whitespace (line breaks included) becomes one space, and
/// none is left at either end.
pub fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_fall_on_character_boundaries() {
        // "é" is two bytes: a cut inside it moves down (floor) or up (ceil).
        let text = "aé";
        assert_eq!(floor_char_boundary(text, 2), 1);
        assert_eq!(ceil_char_boundary(text, 2), 3);
        assert_eq!(floor_char_boundary(text, 9), 3);
        assert_eq!(ceil_char_boundary(text, 9), 3);
        assert_eq!(head_bytes(text, 2), "a");
        assert_eq!(head_bytes(text, 3), "aé");
        assert_eq!(head_chars("äöü", 2), "äö");
        assert_eq!(head_chars("äöü", 3), "äöü");
    }

    #[test]
    fn clips_are_marked_only_when_something_was_left_out() {
        let cases: &[(&str, usize, &str, &str, &str)] = &[
            // text, max, clip_bytes, clip_chars, clip_chars_counted
            ("", 0, "", "", ""),
            ("abc", 3, "abc", "abc", "abc"),
            ("abcd", 3, "abc…", "abc…", "abc... (1 more characters)"),
            ("äöü", 2, "ä…", "äö…", "äö... (1 more characters)"),
            ("äöü", 3, "ä…", "äöü", "äöü"),
            ("äöü", 6, "äöü", "äöü", "äöü"),
            ("äöü", 0, "…", "…", "... (3 more characters)"),
        ];
        for &(text, max, bytes, chars, counted) in cases {
            assert_eq!(clip_bytes(text, max), bytes, "clip_bytes({text:?}, {max})");
            assert_eq!(clip_chars(text, max), chars, "clip_chars({text:?}, {max})");
            assert_eq!(
                clip_chars_counted(text, max),
                counted,
                "clip_chars_counted({text:?}, {max})"
            );
        }
    }

    #[test]
    fn one_line_collapses_whitespace() {
        assert_eq!(one_line("  a\n  b\tc \r\n"), "a b c");
        assert_eq!(one_line(""), "");
    }
}
