//! Tools: three-tier definitions (schema, brief, examples), argument validation and the
//! [`ToolRunner`] trait the engine calls them through.
//!
//! Prompts carry the schema and the brief only; the examples tier is shown to the model only in
//! a correction turn, after it made an invalid call.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};

use crate::protocol::FunctionDefinition;
use crate::protocol::ids::{MAX_NAME_LEN, is_valid_name};

/// Longest brief: it is in every prompt that offers the tool.
pub const MAX_BRIEF_CHARS: usize = 100;

/// A tool definition as configured or registered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolDefinition {
    pub name: String,
    /// JSON Schema of the arguments object.
    pub schema: serde_json::Value,
    /// Under 100 characters, starting with a verb: what the tool does.
    pub brief: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub examples: Option<ToolExamples>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// The examples tier: guidance used only to correct an invalid call.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolExamples {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<ToolInstructions>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub examples: Vec<ToolExample>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolInstructions {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub when_to_use: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub common_pitfalls: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolExample {
    pub scenario: String,
    pub payload: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("tool {name:?}: {reason}")]
pub struct DefinitionError {
    pub name: String,
    pub reason: String,
}

/// One argument problem: where (a JSON pointer into the arguments) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArgumentError {
    pub path: String,
    pub reason: String,
}

impl std::fmt::Display for ArgumentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = if self.path.is_empty() {
            "(the arguments object)"
        } else {
            &self.path
        };
        write!(f, "at {path}: {}", self.reason)
    }
}

/// Words a brief often starts with that are not verbs. A heuristic: it catches "The tool that
/// ...", "This function ..." and "Message sender"-style noun phrases that start with an article,
/// pronoun or tool word, without a dictionary.
const NOT_VERBS: &[&str] = &[
    "a", "an", "the", "this", "that", "these", "those", "it", "its", "my", "our", "your", "their",
    "tool", "function", "helper", "utility", "api", "endpoint", "wrapper", "service", "action",
    "plugin",
];

/// The first word of `brief` when it cannot be the verb a brief must start with.
fn not_a_verb(brief: &str) -> Option<String> {
    let word: String = brief.split_whitespace().next()?.to_string();
    let bare = word.trim_matches(|c: char| !c.is_alphanumeric());
    if bare.is_empty()
        || !bare.chars().all(|c| c.is_alphabetic() || c == '-')
        || NOT_VERBS.contains(&bare.to_lowercase().as_str())
    {
        Some(word)
    } else {
        None
    }
}

/// The legacy definition form (`description`, `required_fields`, `optional_fields`,
/// `instructions`), converted on load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LegacyDefinition {
    pub name: String,
    pub description: String,
    #[serde(default)]
    pub required_fields: Vec<String>,
    #[serde(default)]
    pub optional_fields: Vec<String>,
    #[serde(default)]
    pub instructions: Option<ToolInstructions>,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

impl LegacyDefinition {
    /// The three-tier form: every field becomes a property (of any type), the required ones
    /// required and no others allowed; the brief is the description's first sentence (cut to
    /// fit); the description and instructions become the examples tier.
    pub fn convert(self) -> ToolDefinition {
        let mut properties = serde_json::Map::new();
        for field in self.required_fields.iter().chain(&self.optional_fields) {
            properties.insert(field.clone(), serde_json::json!({"description": field}));
        }
        let first = self
            .description
            .split_inclusive(['.', '\n'])
            .next()
            .unwrap_or("")
            .trim()
            .trim_end_matches('.');
        let mut brief = String::new();
        for word in first.split_whitespace() {
            if brief.chars().count() + word.chars().count() + 1 >= MAX_BRIEF_CHARS {
                break;
            }
            if !brief.is_empty() {
                brief.push(' ');
            }
            brief.push_str(word);
        }
        ToolDefinition {
            schema: serde_json::json!({
                "type": "object",
                "properties": properties,
                "required": self.required_fields,
                "additionalProperties": false
            }),
            brief,
            examples: Some(ToolExamples {
                description: self.description,
                instructions: self.instructions,
                examples: Vec::new(),
            }),
            timeout_ms: self.timeout_ms,
            name: self.name,
        }
    }
}

/// Reads a definition in either form; the flag says it was the legacy one (worth a warning).
pub fn parse_definition(value: serde_json::Value) -> Result<(ToolDefinition, bool), String> {
    let legacy = value.get("schema").is_none()
        && value.get("brief").is_none()
        && (value.get("required_fields").is_some()
            || value.get("optional_fields").is_some()
            || value.get("description").is_some());
    if legacy {
        let definition: LegacyDefinition =
            serde_json::from_value(value).map_err(|e| format!("legacy tool definition: {e}"))?;
        Ok((definition.convert(), true))
    } else {
        let definition: ToolDefinition =
            serde_json::from_value(value).map_err(|e| format!("tool definition: {e}"))?;
        Ok((definition, false))
    }
}

/// A checked definition with its compiled schema.
pub struct Tool {
    pub definition: ToolDefinition,
    validator: jsonschema::Validator,
}

impl std::fmt::Debug for Tool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tool")
            .field("definition", &self.definition)
            .finish_non_exhaustive()
    }
}

impl Tool {
    /// Checks a definition and compiles its schema once, so each call pays only validation.
    pub fn new(definition: ToolDefinition) -> Result<Tool, DefinitionError> {
        let fail = |reason: String| DefinitionError {
            name: definition.name.clone(),
            reason,
        };
        if !is_valid_name(&definition.name) {
            return Err(fail(format!(
                "the name must be 1-{MAX_NAME_LEN} characters of A-Z, a-z, 0-9, '_' or '-'"
            )));
        }
        let brief = definition.brief.trim();
        if brief.is_empty() || brief.chars().count() >= MAX_BRIEF_CHARS {
            return Err(fail(format!(
                "brief must be 1-{} characters (it is in every prompt)",
                MAX_BRIEF_CHARS - 1
            )));
        }
        if let Some(word) = not_a_verb(brief) {
            return Err(fail(format!(
                "brief must start with a verb saying what the tool does (\"Send a message\", \"Get the weather\"), not {word:?}"
            )));
        }
        if definition.schema.get("type").and_then(|t| t.as_str()) != Some("object") {
            return Err(fail(
                "schema must describe an object (\"type\": \"object\"): tool arguments are a JSON object"
                    .into(),
            ));
        }
        if definition.timeout_ms == Some(0) {
            return Err(fail("timeout_ms must be at least 1".into()));
        }
        let validator = jsonschema::validator_for(&definition.schema)
            .map_err(|e| fail(format!("invalid JSON Schema: {e}")))?;
        Ok(Tool {
            definition,
            validator,
        })
    }

    /// A caller's own tool (an OpenAI function definition), checked only for what the engine
    /// needs: a valid name and a schema that compiles. Its description is the caller's and goes
    /// to the model as given, so the brief's rules do not apply; a function without
    /// `parameters` takes any arguments object.
    pub fn from_function(function: &FunctionDefinition) -> Result<Tool, DefinitionError> {
        let fail = |reason: String| DefinitionError {
            name: function.name.clone(),
            reason,
        };
        if !is_valid_name(&function.name) {
            return Err(fail(format!(
                "the name must be 1-{MAX_NAME_LEN} characters of A-Z, a-z, 0-9, '_' or '-'"
            )));
        }
        let schema = function
            .parameters
            .clone()
            .unwrap_or_else(|| serde_json::json!({"type": "object"}));
        let validator = jsonschema::validator_for(&schema)
            .map_err(|e| fail(format!("invalid JSON Schema: {e}")))?;
        Ok(Tool {
            definition: ToolDefinition {
                name: function.name.clone(),
                schema,
                brief: function.description.clone().unwrap_or_default(),
                examples: None,
                timeout_ms: None,
            },
            validator,
        })
    }

    pub fn name(&self) -> &str {
        &self.definition.name
    }

    /// Every way `arguments` breaks the schema (empty: valid).
    pub fn check_arguments(&self, arguments: &serde_json::Value) -> Vec<ArgumentError> {
        self.validator
            .iter_errors(arguments)
            .map(|error| ArgumentError {
                path: error.instance_path().to_string(),
                reason: error.to_string(),
            })
            .collect()
    }
}

/// The tools a worker knows, by name. Immutable: a new registration builds a new catalog, so a
/// running generation keeps the snapshot it started with.
#[derive(Debug, Default, Clone)]
pub struct ToolCatalog {
    tools: BTreeMap<String, Arc<Tool>>,
}

impl ToolCatalog {
    pub fn new(
        definitions: impl IntoIterator<Item = ToolDefinition>,
    ) -> Result<Self, DefinitionError> {
        let mut tools = BTreeMap::new();
        for definition in definitions {
            let tool = Tool::new(definition)?;
            let name = tool.name().to_string();
            if tools.insert(name.clone(), Arc::new(tool)).is_some() {
                return Err(DefinitionError {
                    name,
                    reason: "defined twice".into(),
                });
            }
        }
        Ok(ToolCatalog { tools })
    }

    /// A catalog of already checked tools (a later tool of the same name replaces an earlier).
    pub fn from_tools(tools: impl IntoIterator<Item = Tool>) -> Self {
        ToolCatalog {
            tools: tools
                .into_iter()
                .map(|t| (t.name().to_string(), Arc::new(t)))
                .collect(),
        }
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Tool>> {
        self.tools.get(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tools.keys().map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.tools.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }
}

/// One call for a tool service to run.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolInvocation {
    pub name: String,
    pub arguments: serde_json::Map<String, serde_json::Value>,
    pub request_id: String,
    pub call_id: String,
    pub job_name: Option<String>,
    /// W3C trace context of the request, sent as the `traceparent` header.
    pub traceparent: Option<String>,
}

/// What a tool service answered. An error reply is not a failure of the request: it goes back
/// to the model as the tool's result so the model can react.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolReply {
    Ok(serde_json::Value),
    Error(serde_json::Value),
}

/// The tool could not be run at all; the request fails with `tool_execution_error`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ToolRunError {
    #[error("no tool service answers for {0:?}")]
    NoResponders(String),
    #[error("{0}")]
    Transport(String),
}

/// Runs tools. The engine enforces the per-tool timeout around it and drops the future on
/// cancellation, so implementations need neither.
pub trait ToolRunner: Send + Sync + 'static {
    fn run(&self, call: ToolInvocation) -> BoxFuture<'static, Result<ToolReply, ToolRunError>>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn add() -> ToolDefinition {
        ToolDefinition {
            name: "add".into(),
            schema: json!({"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                           "required": ["a", "b"], "additionalProperties": false}),
            brief: "Add two numbers".into(),
            examples: None,
            timeout_ms: None,
        }
    }

    #[test]
    fn validates_arguments_with_paths() {
        let tool = Tool::new(add()).unwrap();
        assert!(tool.check_arguments(&json!({"a": 1, "b": 2})).is_empty());
        let errors = tool.check_arguments(&json!({"a": "x"}));
        assert!(errors.iter().any(|e| e.path == "/a"), "{errors:?}");
        assert!(
            errors.iter().any(|e| e.reason.contains("\"b\"")),
            "{errors:?}"
        );
        let errors = tool.check_arguments(&json!({"a": 1, "b": 2, "c": 3}));
        assert_eq!(errors.len(), 1, "{errors:?}");
    }

    #[test]
    fn legacy_definitions_are_converted() {
        let (definition, legacy) = parse_definition(json!({
            "name": "my_action",
            "description": "Do something with a value. It is stored for later.",
            "required_fields": ["value"],
            "optional_fields": ["option"],
            "instructions": {"when_to_use": "Whenever a value needs doing."}
        }))
        .unwrap();
        assert!(legacy);
        assert_eq!(definition.brief, "Do something with a value");
        let tool = Tool::new(definition.clone()).unwrap();
        assert!(tool.check_arguments(&json!({"value": 1})).is_empty());
        assert!(
            tool.check_arguments(&json!({"value": 1, "option": true}))
                .is_empty()
        );
        assert!(
            !tool.check_arguments(&json!({"option": true})).is_empty(),
            "value is required"
        );
        assert!(
            !tool
                .check_arguments(&json!({"value": 1, "other": 2}))
                .is_empty(),
            "only known fields"
        );
        let examples = definition.examples.unwrap();
        assert!(examples.description.contains("stored for later"));
        assert_eq!(
            examples.instructions.unwrap().when_to_use,
            "Whenever a value needs doing."
        );

        let (current, legacy) = parse_definition(serde_json::to_value(add()).unwrap()).unwrap();
        assert!(!legacy);
        assert_eq!(current, add());
        let err = parse_definition(
            json!({"name": "x", "brief": "Do x", "schema": {"type": "object"}, "bogus": 1}),
        )
        .unwrap_err();
        assert!(err.contains("bogus"), "{err}");
    }

    #[test]
    fn rejects_bad_definitions() {
        type Mutation = Box<dyn Fn(&mut ToolDefinition)>;
        let cases: Vec<(Mutation, &str)> = vec![
            (Box::new(|d| d.name = "a b".into()), "name"),
            (Box::new(|d| d.brief = "x".repeat(100)), "brief"),
            (Box::new(|d| d.brief = " ".into()), "brief"),
            (
                Box::new(|d| d.brief = "The adder of numbers".into()),
                "verb",
            ),
            (
                Box::new(|d| d.brief = "This tool adds numbers".into()),
                "verb",
            ),
            (Box::new(|d| d.brief = "42 is the answer".into()), "verb"),
            (Box::new(|d| d.schema = json!({"type": "string"})), "object"),
            (
                Box::new(|d| {
                    d.schema = json!({"type": "object", "properties": {"a": {"type": 5}}})
                }),
                "Schema",
            ),
            (Box::new(|d| d.timeout_ms = Some(0)), "timeout_ms"),
        ];
        for (mutate, needle) in cases {
            let mut def = add();
            mutate(&mut def);
            let err = Tool::new(def).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
        let err = ToolCatalog::new([add(), add()]).unwrap_err();
        assert!(err.reason.contains("twice"));
    }
}
