//! Control-tool calls a model makes (signal_issue, request_escalation, request_decision,
//! declare_outcome, or a name that is none of them), with arguments as JSON text. The input is
//! one call per line: the tool's name, a space, its arguments.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let calls: Vec<(&str, serde_json::Value)> = text
        .lines()
        .take(16)
        .filter_map(|line| {
            let (name, arguments) = line.split_once(' ')?;
            Some((name, serde_json::from_str(arguments).ok()?))
        })
        .collect();
    genfleet_fuzz::check_control_calls(&calls);
});
