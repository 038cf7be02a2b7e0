//! Assistant turns (text, then tool calls) through the loop detector, the text cut into deltas
//! at arbitrary places, under the default settings or arbitrary (possibly invalid, so clamped)
//! ones. The verdict and the byte it is found at depend on the bytes alone, never on the cuts.
#![no_main]

use arbitrary::Arbitrary;
use genfleet::engine::loop_detect::{LineTier, LoopDetectionConfig, LoopDetector};

#[derive(Arbitrary, Debug)]
struct Turn {
    text: String,
    cuts: Vec<u16>,
    /// Tool calls after the text: a name out of three and a small argument.
    calls: Vec<(u8, u8)>,
}

#[derive(Arbitrary, Debug)]
struct Config {
    line_min_chars: u8,
    tiers: Vec<(u8, u8)>,
    fence_multiplier: u8,
    table_multiplier: u8,
    line_window: u16,
    chant_window_chars: u16,
    chant_repeats: u8,
    chant_multiline_multiplier: u8,
    chant_max_period: u16,
    tool_call_repeats: u8,
}

#[derive(Arbitrary, Debug)]
struct Input {
    config: Option<Config>,
    turns: Vec<Turn>,
}

fn config(input: &Option<Config>) -> LoopDetectionConfig {
    let Some(c) = input else {
        return LoopDetectionConfig::default();
    };
    LoopDetectionConfig {
        enabled: true,
        line_min_chars: c.line_min_chars.into(),
        line_tiers: c
            .tiers
            .iter()
            .take(8)
            .map(|&(min_len, repeats)| LineTier {
                min_len: min_len.into(),
                repeats: repeats.into(),
            })
            .collect(),
        fence_multiplier: c.fence_multiplier.into(),
        table_multiplier: c.table_multiplier.into(),
        line_window: c.line_window.into(),
        chant_window_chars: c.chant_window_chars.into(),
        chant_repeats: c.chant_repeats.into(),
        chant_multiline_multiplier: c.chant_multiline_multiplier.into(),
        chant_max_period: c.chant_max_period.into(),
        tool_call_repeats: c.tool_call_repeats.into(),
    }
}

fn run(config: &LoopDetectionConfig, turns: &[Turn], split: bool) -> (Option<String>, Option<u64>) {
    const NAMES: [&str; 3] = ["read_file", "search", "run"];
    let mut detector = LoopDetector::new(config);
    for turn in turns {
        if split {
            for piece in genfleet_fuzz::cut(&turn.text, &turn.cuts) {
                detector.push_text(piece);
            }
        } else {
            detector.push_text(&turn.text);
        }
        detector.end_turn();
        for &(name, arg) in &turn.calls {
            let arguments = serde_json::json!({ "path": format!("f{}", arg % 4) });
            detector.push_tool_call(NAMES[usize::from(name) % 3], &arguments);
        }
    }
    (
        detector.verdict().map(|v| v.to_string()),
        detector.fired_at(),
    )
}

libfuzzer_sys::fuzz_target!(|input: Input| {
    let config = config(&input.config);
    let turns = &input.turns[..input.turns.len().min(32)];
    let whole = run(&config, turns, false);
    let split = run(&config, turns, true);
    assert_eq!(whole, split);
});
