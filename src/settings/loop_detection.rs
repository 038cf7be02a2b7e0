//! The loop detector's settings (`[loop_detection]`): what the engine's detector counts as a
//! loop, with the reasoning behind the defaults. The detector itself is
//! `engine::loop_detect`; the settings live here so that configuration does not depend on the
//! engine.

use serde::{Deserialize, Serialize};

/// Bounds enforced by [`LoopDetectionConfig::validate`] and clamped to by the engine's loop
/// detector, so a bad config can never make memory unbounded.
pub const MAX_LINE_WINDOW: usize = 65_536;
pub const MIN_CHANT_WINDOW: usize = 8;
pub const MAX_CHANT_WINDOW: usize = 256;
pub const MAX_CHANT_PERIOD: usize = 4096;

/// A repeat threshold for lines of at least `min_len` visible characters (not counting
/// spaces and control characters).
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LineTier {
    pub min_len: usize,
    pub repeats: usize,
}

/// Settings of the loop detector (`[loop_detection]`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct LoopDetectionConfig {
    /// Off switch: when false nothing ever fires and no work is done.
    pub enabled: bool,
    /// Lines with fewer visible characters are never counted: closing braces, `end`,
    /// `---`, `Done.` and the like recur legitimately all the time and carry too little
    /// content to tell a loop from structure.
    pub line_min_chars: usize,
    /// Repeat thresholds by line length (visible characters, so indentation does not change
    /// the tier), in ascending `min_len`; a line uses the last tier it reaches, and a
    /// line shorter than the first tier is not counted. Longer lines get lower thresholds
    /// because a long line repeated verbatim is far less likely to be legitimate than a short
    /// one.
    pub line_tiers: Vec<LineTier>,
    /// Thresholds of lines inside a fenced code block are multiplied by this: code repeats
    /// lines for real (asserts, `pass`, `return None;`), but an unclosed fence must not hide a
    /// loop forever, so it is a higher bar rather than an exemption. Also applied to chanting
    /// inside a fence.
    pub fence_multiplier: usize,
    /// Thresholds of markdown table rows (lines starting with `|`) are multiplied by this:
    /// tables legitimately repeat rows such as separators and empty cells.
    pub table_multiplier: usize,
    /// How many recent counted lines are remembered. A line repeated far apart (a heading
    /// every few screens) is not a loop; a loop repeats within a short span.
    pub line_window: usize,
    /// Length of the chunk compared by the chanting detector, in bytes (characters for ASCII).
    pub chant_window_chars: usize,
    /// How many back-to-back, non-overlapping occurrences of a chunk make a chant, i.e. the
    /// loop must cover about `chant_repeats * chant_window_chars` bytes (or that many periods
    /// when the repeated text is longer than the chunk).
    pub chant_repeats: usize,
    /// A repeated unit that spans a newline is made of whole lines, which the line rules judge
    /// with their own length tiers and fence/table multipliers; chanting is only their
    /// backstop for lines too short to count (`Wait.`, `}`), so such a unit needs this many
    /// times `chant_repeats`. Otherwise 20 identical table rows would fire as chanting long
    /// before the table threshold of the line rules.
    pub chant_multiline_multiplier: usize,
    /// The longest repeated unit (in bytes) the chanting detector looks for. Longer loops are
    /// multi-line in practice and the line detector catches them.
    pub chant_max_period: usize,
    /// The same tool call (name and canonical arguments) this many times in a row fires.
    pub tool_call_repeats: usize,
}

impl Default for LoopDetectionConfig {
    /// Why these numbers:
    ///
    /// * Lines: 8 to 23 visible characters need 12 repeats within 256 lines (headings,
    ///   labels and boilerplate such as `**Example:**` recur in long answers), 24 to 79 need 8
    ///   (a sentence-sized line repeated 8 times in a short span is not prose any more), 80 and
    ///   more need 5 (a paragraph-sized line verbatim 5 times is a loop). Two lines
    ///   alternating count separately, so they fire at 8 each.
    /// * Fences and tables multiply by 4: 12 identical asserts in a test stay quiet (threshold
    ///   48 for a 17-character line), while a fenced loop still fires after 32 repeats of a
    ///   typical code line.
    /// * Chanting: a 50-byte chunk 10 times back to back (at least ~500 bytes of exact
    ///   repetition), requiring non-overlapping occurrences and identical text between them,
    ///   which is what keeps numbered steps, list items sharing a prefix and single-line JSON
    ///   arrays quiet. A repeated unit spanning
    ///   lines needs 4 times as many (~2 KB): the line rules own whole lines, chanting only
    ///   backstops loops of lines too short for them.
    /// * Tool calls: 5 identical calls in a row; agents legitimately retry a call once or
    ///   twice (a flaky command, a file that was still being written), rarely four times.
    fn default() -> Self {
        Self {
            enabled: true,
            line_min_chars: 8,
            line_tiers: vec![
                LineTier {
                    min_len: 8,
                    repeats: 12,
                },
                LineTier {
                    min_len: 24,
                    repeats: 8,
                },
                LineTier {
                    min_len: 80,
                    repeats: 5,
                },
            ],
            fence_multiplier: 4,
            table_multiplier: 4,
            line_window: 256,
            chant_window_chars: 50,
            chant_repeats: 10,
            chant_multiline_multiplier: 4,
            chant_max_period: 512,
            tool_call_repeats: 5,
        }
    }
}

impl LoopDetectionConfig {
    /// Checks the settings make sense; the engine's detector clamps instead of failing, so
    /// call this when loading the configuration to report mistakes.
    pub fn validate(&self) -> Result<(), String> {
        if self.line_window == 0 || self.line_window > MAX_LINE_WINDOW {
            return Err(format!(
                "line_window must be between 1 and {MAX_LINE_WINDOW}, got {}",
                self.line_window
            ));
        }
        if self.fence_multiplier == 0 {
            return Err("fence_multiplier must be at least 1".into());
        }
        if self.table_multiplier == 0 {
            return Err("table_multiplier must be at least 1".into());
        }
        let multiplier = self.fence_multiplier.max(self.table_multiplier);
        let mut previous: Option<usize> = None;
        for tier in &self.line_tiers {
            if tier.repeats < 2 {
                return Err(format!(
                    "line_tiers: repeats must be at least 2, got {} for min_len {}",
                    tier.repeats, tier.min_len
                ));
            }
            if let Some(previous) = previous
                && tier.min_len <= previous
            {
                return Err("line_tiers must be sorted by strictly increasing min_len".into());
            }
            previous = Some(tier.min_len);
            let worst = tier.repeats.saturating_mul(multiplier);
            if worst > self.line_window {
                return Err(format!(
                    "line_tiers: {} repeats x multiplier {multiplier} can never fit in a \
                     line_window of {} lines",
                    tier.repeats, self.line_window
                ));
            }
        }
        if !(MIN_CHANT_WINDOW..=MAX_CHANT_WINDOW).contains(&self.chant_window_chars) {
            return Err(format!(
                "chant_window_chars must be between {MIN_CHANT_WINDOW} and {MAX_CHANT_WINDOW}, \
                 got {}",
                self.chant_window_chars
            ));
        }
        if self.chant_repeats < 2 {
            return Err("chant_repeats must be at least 2".into());
        }
        if self.chant_multiline_multiplier == 0 {
            return Err("chant_multiline_multiplier must be at least 1".into());
        }
        if self.chant_max_period == 0 || self.chant_max_period > MAX_CHANT_PERIOD {
            return Err(format!(
                "chant_max_period must be between 1 and {MAX_CHANT_PERIOD}, got {}",
                self.chant_max_period
            ));
        }
        if self.tool_call_repeats < 2 {
            return Err("tool_call_repeats must be at least 2".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid_and_round_trips() {
        let config = LoopDetectionConfig::default();
        assert_eq!(config.validate(), Ok(()));
        let text = serde_json::to_string(&config).unwrap();
        let back: LoopDetectionConfig = serde_json::from_str(&text).unwrap();
        assert_eq!(back, config);
        let partial: LoopDetectionConfig = serde_json::from_str(r#"{"enabled": false}"#).unwrap();
        assert_eq!(
            partial,
            LoopDetectionConfig {
                enabled: false,
                ..LoopDetectionConfig::default()
            }
        );
        assert!(serde_json::from_str::<LoopDetectionConfig>(r#"{"enabld": true}"#).is_err());
        assert!(
            serde_json::from_str::<LoopDetectionConfig>(
                r#"{"line_tiers": [{"min_len": 8, "repeats": 9, "x": 1}]}"#
            )
            .is_err()
        );
    }
}
