//! Throughput of the per-token hot paths: loop detection, text tool-call parsing, the codecs,
//! the BIOS. Run with `cargo bench --bench engine`; figures go to docs/benchmarks.md.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use genfleet::engine::bios::{BiosContext, BiosProvider, DefaultBios};
use genfleet::engine::control::control_tools;
use genfleet::engine::loop_detect::{LoopDetectionConfig, LoopDetector};
use genfleet::engine::text_calls::{ParseMode, TextCallParser};
use genfleet::protocol::{Encoding, GenerationRequest, Message};
use genfleet::settings::ToolMode;
use genfleet::tools::Tool;

/// About 1 MB of varied prose, code and lists, with a tool call every few kilobytes: what a
/// chatty model streams.
fn realistic_stream() -> String {
    let mut text = String::with_capacity(1 << 20);
    let mut i = 0u64;
    while text.len() < 1 << 20 {
        i += 1;
        text.push_str(&format!(
            "Paragraph {i}: the service answered in {} ms after {} retries; next we check shard {}.\n",
            i * 7 % 1000,
            i % 5,
            i % 97
        ));
        if i.is_multiple_of(10) {
            text.push_str(&format!(
                "```rust\nlet value_{i} = compute({i});\nprintln!(\"{{value_{i}}}\");\n```\n"
            ));
        }
        if i.is_multiple_of(40) {
            text.push_str(&format!(
                "| key | value |\n|---|---|\n| k{i} | {} |\n",
                i * 3
            ));
        }
        if i.is_multiple_of(50) {
            text.push_str(&format!(
                "<tool_call>{{\"name\": \"lookup\", \"arguments\": {{\"id\": {i}}}}}</tool_call>\n"
            ));
        }
    }
    text
}

/// Deltas of about the size a streaming backend sends (a token or a few).
fn deltas(text: &str, size: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + size).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        out.push(&text[start..end]);
        start = end;
    }
    out
}

fn loop_detector(c: &mut Criterion) {
    let text = realistic_stream();
    let pieces = deltas(&text, 16);
    let config = LoopDetectionConfig::default();
    let mut group = c.benchmark_group("loop_detector");
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.bench_function("1MB_in_16B_deltas", |b| {
        b.iter(|| {
            let mut detector = LoopDetector::new(&config);
            for piece in &pieces {
                black_box(detector.push_text(piece));
            }
            black_box(detector.end_turn())
        })
    });
    group.finish();
}

fn text_call_parser(c: &mut Criterion) {
    let text = realistic_stream();
    let pieces = deltas(&text, 16);
    let mut group = c.benchmark_group("text_call_parser");
    group.throughput(Throughput::Bytes(text.len() as u64));
    for (name, mode) in [
        ("text_mode", ParseMode::Text),
        ("native_mode", ParseMode::Native),
    ] {
        group.bench_function(format!("1MB_in_16B_deltas_{name}"), |b| {
            let mut visible = String::with_capacity(text.len());
            b.iter(|| {
                visible.clear();
                let mut parser = TextCallParser::new(mode);
                for piece in &pieces {
                    parser.push(piece, &mut visible);
                }
                black_box(parser.finish(&mut visible))
            })
        });
    }
    group.finish();
}

fn codecs(c: &mut Criterion) {
    let mut request = GenerationRequest::user("Summarise the conversation.");
    for i in 0..200 {
        request.messages.push(Message::assistant(format!(
            "Answer {i}: {}",
            "lorem ipsum dolor sit amet ".repeat(20)
        )));
        request
            .messages
            .push(Message::user(format!("Follow-up question number {i}?")));
    }
    let mut group = c.benchmark_group("codec_large_request");
    for encoding in [Encoding::Json, Encoding::MsgPack] {
        let bytes = encoding.encode(&request);
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        group.bench_function(format!("{encoding:?}_encode"), |b| {
            b.iter(|| black_box(encoding.encode(&request)))
        });
        group.bench_function(format!("{encoding:?}_decode"), |b| {
            b.iter(|| black_box(encoding.decode::<GenerationRequest>(&bytes).unwrap()))
        });
    }
    group.finish();
}

fn bios(c: &mut Criterion) {
    let controls: Vec<&Tool> = control_tools().iter().map(|t| t.as_ref()).collect();
    c.bench_function("bios_build_text_mode", |b| {
        b.iter(|| {
            black_box(DefaultBios.bios(&BiosContext {
                tools: &controls,
                caller_tools: &[],
                control_tools: &controls,
                tool_mode: ToolMode::Text,
                iterations_remaining: 3,
                stop_on_decision_request: true,
                max_model_signals: 3,
                max_model_signal_bytes: 4096,
            }))
        })
    });
}

fn schema_validation(c: &mut Criterion) {
    let tool = Tool::new(genfleet::cli::tool_demo::calculate_definition()).unwrap();
    let valid = serde_json::json!({"operation": "mul", "a": 17, "b": 23});
    let invalid = serde_json::json!({"operation": "pow", "a": "17"});
    c.bench_function("schema_validation_per_call_valid", |b| {
        b.iter(|| black_box(tool.check_arguments(&valid)))
    });
    c.bench_function("schema_validation_per_call_invalid", |b| {
        b.iter(|| black_box(tool.check_arguments(&invalid)))
    });
}

criterion_group!(
    benches,
    loop_detector,
    text_call_parser,
    codecs,
    bios,
    schema_validation
);
criterion_main!(benches);
