//! Configuration errors in the user's words: the dotted key, what it must be, and what was given.
//! Never Rust's (type names, "variant constructor", "invalid type").
//!
//! Two passes. Before the settings are read into their structs, every key that
//! `config/default.toml` holds is checked against the kind of its default (a whole number, a
//! number, true or false, text, a table), which also catches what the `config` crate would
//! quietly convert (3.5 read as 3). Then what the structs refuse (a section or key that does
//! not exist, a value of an enumeration, a number out of range) is said from the `config`
//! crate's structured error.

use config::ConfigError;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// The values an enumerated setting takes, as serde reads them (so the list cannot drift from
/// the enum): parsed from serde's own "expected" for a value no enum has.
pub(super) fn values_of<T: DeserializeOwned>() -> Vec<String> {
    let Err(error) = serde_json::from_str::<T>("\"\\u0000\"") else {
        return Vec::new();
    };
    values_from(&error.to_string())
}

/// `a`, `a` or `b`, `a`, `b` or `c`: the allowed values in a sentence.
pub(super) fn either(values: &[String]) -> String {
    let quoted: Vec<String> = values.iter().map(|v| format!("`{v}`")).collect();
    match quoted.as_slice() {
        [] => "one of its values".into(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

/// What a value is, for a message: `"bogus"`, `-3`, `3.5`, `a table`, `a list`.
fn shown(value: &Value) -> String {
    match value {
        Value::String(text) => format!("{text:?}"),
        Value::Object(_) => "a table".into(),
        Value::Array(_) => "a list".into(),
        Value::Null => "nothing".into(),
        other => other.to_string(),
    }
}

/// What the `config` crate found, from its description (`64-bit integer \`-3\``, `string
/// "x"`, `map`): the value alone, and whether it is an integer.
fn shown_unexpected(unexpected: &str) -> (String, bool) {
    let integer = unexpected.contains("integer");
    if let Some(text) = unexpected.strip_prefix("string ") {
        return (text.to_string(), false);
    }
    if let Some(value) = unexpected.split('`').nth(1) {
        return (value.to_string(), integer);
    }
    let shown = match unexpected {
        "map" => "a table",
        "sequence" => "a list",
        "unit value" => "nothing",
        other => other,
    };
    (shown.to_string(), false)
}

/// Checks each key the defaults hold against the kind of its default (an enumerated one
/// against its values).
pub(super) fn check_kinds(
    defaults: &toml::Table,
    enums: &Enumerations,
    merged: &Value,
) -> Result<(), String> {
    let Value::Object(sections) = merged else {
        return Ok(());
    };
    for (section, value) in sections {
        let Some(toml::Value::Table(known)) = defaults.get(section) else {
            // Not a section: said by the second pass, with the list of sections.
            continue;
        };
        let Value::Object(keys) = value else {
            return Err(format!(
                "`[{section}]` must be a table of settings (a [{section}] section, or \
                 {section}.KEY = ...), not {}",
                shown(value)
            ));
        };
        check_keys(section, known, keys, enums)?;
    }
    Ok(())
}

/// A JSON number that `fits`, or text that reads as a `T` (an environment variable's value is
/// always text).
fn number_or_text<T: std::str::FromStr>(
    value: &Value,
    fits: fn(&serde_json::Number) -> bool,
) -> bool {
    match value {
        Value::Number(n) => fits(n),
        Value::String(text) => text.trim().parse::<T>().is_ok(),
        _ => false,
    }
}

/// Checks the keys of one section (or of a table within one, `worker.reserved_slots`).
fn check_keys(
    section: &str,
    known: &toml::Table,
    keys: &serde_json::Map<String, Value>,
    enums: &Enumerations,
) -> Result<(), String> {
    for (key, value) in keys {
        let Some(default) = known.get(key) else {
            continue;
        };
        let name = format!("{section}.{key}");
        let wrong = |what: &str| Err(format!("`{name}` must be {what}, not {}", shown(value)));
        match default {
            toml::Value::Integer(_) => {
                if !number_or_text::<i128>(value, |n| n.is_i64() || n.is_u64()) {
                    return wrong("a whole number");
                }
            }
            toml::Value::Float(_) => {
                if !number_or_text::<f64>(value, |_| true) {
                    return wrong("a number");
                }
            }
            toml::Value::Boolean(_) => {
                let boolean = match value {
                    Value::Bool(_) => true,
                    Value::String(text) => {
                        matches!(text.trim().to_ascii_lowercase().as_str(), "true" | "false")
                    }
                    _ => false,
                };
                if !boolean {
                    return wrong("true or false");
                }
            }
            toml::Value::String(_) => {
                if let Some((_, values)) = enums.iter().find(|(k, _)| *k == name) {
                    let values = values();
                    if !value
                        .as_str()
                        .is_some_and(|v| values.iter().any(|x| x == v))
                    {
                        return wrong(&either(&values));
                    }
                } else if matches!(value, Value::Object(_) | Value::Array(_) | Value::Null) {
                    return wrong("text");
                }
            }
            toml::Value::Array(_) => {
                if !matches!(value, Value::Array(_)) {
                    return wrong("a list");
                }
            }
            toml::Value::Table(table) => match value {
                Value::Object(inner) => check_keys(&name, table, inner, enums)?,
                _ => return wrong("a table"),
            },
            toml::Value::Datetime(_) => {}
        }
    }
    Ok(())
}

/// The enumerated settings: the key and its values.
pub(super) type Enumerations = [(&'static str, fn() -> Vec<String>)];

/// What the structs refused, in words. `minimum` says what the rest of the checks want of a
/// whole number that cannot be negative (`worker.slots`: at least 1), when they want more.
pub(super) fn said(
    error: &ConfigError,
    enums: &Enumerations,
    minimum: &dyn Fn(&str) -> Option<String>,
) -> String {
    said_at(error, None, enums, minimum)
}

fn said_at(
    error: &ConfigError,
    at: Option<&str>,
    enums: &Enumerations,
    minimum: &dyn Fn(&str) -> Option<String>,
) -> String {
    match error {
        ConfigError::At { error, key, .. } => said_at(error, key.as_deref().or(at), enums, minimum),
        ConfigError::Type {
            unexpected,
            expected,
            key,
            ..
        } => {
            let key = key.as_deref().or(at).unwrap_or("a setting");
            let (given, integer) = shown_unexpected(&unexpected.to_string());
            let negative = integer && given.starts_with('-');
            let what = if expected.contains("unsigned") || expected.contains("integer") {
                if negative {
                    return match minimum(key) {
                        Some(rule) => format!("`{key}` must be {rule}, not {given}"),
                        None => {
                            format!("`{key}` must be a whole number of at least 0, not {given}")
                        }
                    };
                }
                match largest(expected) {
                    Some(max) if integer => format!("a whole number no larger than {max}"),
                    _ => "a whole number".to_string(),
                }
            } else if expected.contains("float") || expected.contains("f64") {
                "a number".into()
            } else if expected.contains("bool") {
                "true or false".into()
            } else if expected.contains("string") || expected.contains("char") {
                "text".into()
            } else if expected.contains("struct") || expected.contains("map") {
                return format!(
                    "`[{key}]` must be a table of settings (a [{key}] section, or {key}.KEY = \
                     ...), not {given}"
                );
            } else if expected.contains("seq") || expected.contains("array") {
                "a list".into()
            } else {
                "of another kind".into()
            };
            format!("`{key}` must be {what}, not {given}")
        }
        ConfigError::Message(message) => {
            if let Some(rest) = message.strip_prefix("enum ")
                && let Some((_, value)) = rest.split_once(" does not have variant constructor ")
            {
                let key = at.unwrap_or("a setting");
                let values = enums
                    .iter()
                    .find(|(name, _)| *name == key)
                    .map(|(_, values)| values())
                    .unwrap_or_default();
                return format!("`{key}` must be {}, not {value:?}", either(&values));
            }
            if let Some(rest) = message.strip_prefix("unknown field `")
                && let Some((field, expected)) = rest.split_once('`')
            {
                let allowed: Vec<String> = expected
                    .split('`')
                    .skip(1)
                    .step_by(2)
                    .map(str::to_string)
                    .collect();
                return match at {
                    Some(section) => format!(
                        "`{section}.{field}` is not a setting; the settings of [{section}] are {}",
                        allowed.join(", ")
                    ),
                    None => format!(
                        "`[{field}]` is not a section of the configuration; the sections are {}",
                        allowed.join(", ")
                    ),
                };
            }
            if let Some(rest) = message.strip_prefix("unknown variant `")
                && let Some((value, _)) = rest.split_once('`')
            {
                let key = at.unwrap_or("a setting");
                let values = values_from(message);
                return format!("`{key}` must be {}, not {value:?}", either(&values));
            }
            match at {
                Some(key) => format!("`{key}`: {message}"),
                None => message.clone(),
            }
        }
        other => other.to_string(),
    }
}

/// The backquoted values after "expected" in a serde message.
fn values_from(message: &str) -> Vec<String> {
    message
        .split("expected ")
        .nth(1)
        .map(|expected| {
            expected
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// The largest value of the unsigned integer `expected` names.
fn largest(expected: &str) -> Option<u64> {
    if !expected.contains("unsigned") {
        return None;
    }
    [
        ("8 bit", u64::from(u8::MAX)),
        ("16 bit", u64::from(u16::MAX)),
        ("32 bit", u64::from(u32::MAX)),
        ("64 bit", u64::MAX),
    ]
    .into_iter()
    .find(|(bits, _)| expected.contains(bits))
    .map(|(_, max)| max)
}
