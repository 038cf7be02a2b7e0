//! `genfleet tool-demo`: two example tool services, a calculator and a clock, registered in
//! KV and served on the bus until Ctrl-C or SIGTERM (then withdrawn). The demo and the tests use
//! them; they also show how to write a tool service with `client::tool_service`.

use clap::Args;
use serde_json::{Value, json};

use crate::client::connect::{self, ConnectPurpose};
use crate::client::tool_service::ToolService;
use crate::settings::Settings;
use crate::tools::ToolDefinition;

#[derive(Debug, Args)]
pub struct ToolDemoArgs {}

/// The calculator's definition, all three tiers.
pub fn calculate_definition() -> ToolDefinition {
    serde_json::from_value(json!({
        "name": "calculate",
        "brief": "Compute a + b, a - b, a * b or a / b exactly",
        "schema": {
            "type": "object",
            "properties": {
                "operation": {"type": "string", "enum": ["add", "sub", "mul", "div"]},
                "a": {"type": "number"},
                "b": {"type": "number"}
            },
            "required": ["operation", "a", "b"],
            "additionalProperties": false
        },
        "examples": {
            "description": "Applies one arithmetic operation to two numbers and returns {\"value\": number}.",
            "instructions": {
                "when_to_use": "Any arithmetic you would otherwise do in your head.",
                "common_pitfalls": ["a and b are JSON numbers, not strings", "operation is one of add, sub, mul, div", "dividing by zero is an error"],
                "notes": ["One operation per call; chain calls for longer sums."]
            },
            "examples": [
                {"scenario": "17 times 23", "payload": {"operation": "mul", "a": 17, "b": 23}},
                {"scenario": "half of 9", "payload": {"operation": "div", "a": 9, "b": 2}}
            ]
        },
        "timeout_ms": 2000
    }))
    .expect("a valid definition")
}

/// The clock's definition.
pub fn clock_definition() -> ToolDefinition {
    serde_json::from_value(json!({
        "name": "clock",
        "brief": "Read the current date and time in UTC",
        "schema": {"type": "object", "properties": {}, "additionalProperties": false},
        "examples": {
            "description": "Returns {\"utc\": RFC 3339 timestamp, \"unix\": seconds}.",
            "examples": [{"scenario": "what time is it", "payload": {}}]
        },
        "timeout_ms": 2000
    }))
    .expect("a valid definition")
}

/// The calculator itself: an error reply for what it cannot do.
pub fn calculate(arguments: &Value) -> Result<Value, Value> {
    let a = arguments["a"].as_f64();
    let b = arguments["b"].as_f64();
    let (Some(a), Some(b)) = (a, b) else {
        return Err(json!({"code": "INVALID_ARGUMENTS", "message": "a and b must be numbers"}));
    };
    let value = match arguments["operation"].as_str() {
        Some("add") => a + b,
        Some("sub") => a - b,
        Some("mul") => a * b,
        Some("div") if b == 0.0 => {
            return Err(json!({"code": "DIVISION_BY_ZERO", "message": "cannot divide by zero"}));
        }
        Some("div") => a / b,
        _ => {
            return Err(
                json!({"code": "INVALID_ARGUMENTS", "message": "operation must be add, sub, mul or div"}),
            );
        }
    };
    Ok(json!({ "value": value }))
}

pub async fn run(settings: Settings, _args: ToolDemoArgs) -> anyhow::Result<()> {
    let stop = super::shutdown_signal();
    let Some(started) = super::unless_stopped(&stop, start(&settings)).await else {
        return Ok(());
    };
    let (client, calculator, clock) = started?;
    println!("tool-demo serving: calculate, clock");
    stop.await;
    calculator.withdraw().await?;
    clock.withdraw().await?;
    let _ = client.flush().await;
    Ok(())
}

/// Connects (waiting for NATS) and registers the two tools.
async fn start(
    settings: &Settings,
) -> anyhow::Result<(async_nats::Client, ToolService, ToolService)> {
    let client = connect::connect(&settings.nats, ConnectPurpose::Worker).await?;
    let calculator = ToolService::start(
        client.clone(),
        settings,
        calculate_definition(),
        |arguments, _| async move { calculate(&arguments) },
    )
    .await?;
    let clock = ToolService::start(
        client.clone(),
        settings,
        clock_definition(),
        |_, _| async move {
            let now = std::time::SystemTime::now();
            let unix = now
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            Ok(json!({"utc": humantime::format_rfc3339_seconds(now).to_string(), "unix": unix}))
        },
    )
    .await?;
    Ok((client, calculator, clock))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::Tool;

    #[test]
    fn the_demo_tools_are_valid_and_their_examples_pass_their_schemas() {
        for definition in [calculate_definition(), clock_definition()] {
            let examples = definition.examples.clone().unwrap().examples;
            let tool = Tool::new(definition).unwrap();
            for example in examples {
                assert!(
                    tool.check_arguments(&example.payload).is_empty(),
                    "{}",
                    example.scenario
                );
            }
        }
    }

    #[test]
    fn the_calculator_computes_and_refuses() {
        let cases = [
            (
                json!({"operation": "add", "a": 2, "b": 3}),
                Ok(json!({"value": 5.0})),
            ),
            (
                json!({"operation": "mul", "a": 17, "b": 23}),
                Ok(json!({"value": 391.0})),
            ),
            (
                json!({"operation": "div", "a": 9, "b": 2}),
                Ok(json!({"value": 4.5})),
            ),
            (
                json!({"operation": "sub", "a": 1, "b": 4}),
                Ok(json!({"value": -3.0})),
            ),
        ];
        for (arguments, expected) in cases {
            assert_eq!(calculate(&arguments), expected, "{arguments}");
        }
        assert_eq!(
            calculate(&json!({"operation": "div", "a": 1, "b": 0})).unwrap_err()["code"],
            "DIVISION_BY_ZERO"
        );
        assert_eq!(
            calculate(&json!({"operation": "pow", "a": 1, "b": 0})).unwrap_err()["code"],
            "INVALID_ARGUMENTS"
        );
    }
}
