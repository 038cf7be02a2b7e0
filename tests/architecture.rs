//! The layer rule of ARCHITECTURE.md, checked: data flows one way, so each top-level module of
//! `src/` may import only the genfleet modules its row of [`LAYERS`] names, and some may not use
//! certain external crates (the engine knows neither NATS nor actix; the protocol does no I/O).
//!
//! The table lives here, once; ARCHITECTURE.md shows the same table and a test keeps the two
//! equal. The scanner reads the code as text, with comments and literals blanked, and collects
//! every way a module reaches another: `use crate::x`, `crate::x::` paths anywhere in the code,
//! grouped `use crate::{a, b}` forms, `super::` chains that climb out of the module, and
//! `genfleet::x` paths in the binary. Its own tests plant violations, so it cannot pass by
//! seeing nothing.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

/// One row of the rule.
struct Layer {
    /// A top-level module of `src/` (`main` is `src/main.rs`, `lib` the crate root).
    name: &'static str,
    /// The genfleet modules it may import (its own is always allowed).
    may_import: &'static [&'static str],
    /// External crates it must not use.
    must_not_use: &'static [&'static str],
}

/// Crates that do I/O: the protocol is data and codecs only.
const IO_CRATES: &[&str] = &["async_nats", "actix", "tokio", "reqwest", "axum"];
const NO_NATS_NO_ACTIX: &[&str] = &["async_nats", "actix"];

/// The rule, bottom up. A layer imports only layers above it in this list.
const LAYERS: &[Layer] = &[
    // The crate root only declares the modules.
    Layer {
        name: "lib",
        may_import: &[],
        must_not_use: &[],
    },
    Layer {
        name: "protocol",
        may_import: &[],
        must_not_use: IO_CRATES,
    },
    Layer {
        name: "telemetry",
        may_import: &[],
        must_not_use: NO_NATS_NO_ACTIX,
    },
    Layer {
        name: "settings",
        may_import: &["protocol"],
        must_not_use: NO_NATS_NO_ACTIX,
    },
    // How the HTTP servers (a worker's metrics and health, the console, the gateway) bind and
    // serve: shared by layers that may not import each other.
    Layer {
        name: "serve",
        may_import: &[],
        must_not_use: NO_NATS_NO_ACTIX,
    },
    Layer {
        name: "tools",
        may_import: &["protocol", "settings"],
        must_not_use: NO_NATS_NO_ACTIX,
    },
    Layer {
        name: "llm",
        may_import: &["protocol", "settings"],
        must_not_use: NO_NATS_NO_ACTIX,
    },
    Layer {
        name: "engine",
        may_import: &["protocol", "telemetry", "settings", "llm", "tools"],
        must_not_use: NO_NATS_NO_ACTIX,
    },
    Layer {
        name: "actors",
        may_import: &[
            "protocol",
            "telemetry",
            "settings",
            "llm",
            "tools",
            "engine",
        ],
        must_not_use: &["async_nats"],
    },
    Layer {
        name: "observe",
        may_import: &["protocol", "settings", "serve", "llm", "tools", "engine"],
        must_not_use: &["actix"],
    },
    // What every process that is not a worker needs of the bus, and the vocabulary workers
    // share with it: connecting, subjects, message bodies, streams and records, the caller.
    Layer {
        name: "client",
        may_import: &["protocol", "telemetry", "settings"],
        must_not_use: &["actix"],
    },
    Layer {
        name: "bus",
        may_import: &[
            "protocol",
            "telemetry",
            "settings",
            "llm",
            "tools",
            "engine",
            "actors",
            "observe",
            "client",
        ],
        must_not_use: &[],
    },
    Layer {
        name: "manager",
        may_import: &["protocol", "settings", "llm", "client"],
        must_not_use: &["actix"],
    },
    Layer {
        name: "console",
        may_import: &["protocol", "settings", "serve", "client"],
        must_not_use: &["actix"],
    },
    Layer {
        name: "gateway",
        may_import: &[
            "protocol",
            "settings",
            "telemetry",
            "serve",
            "observe",
            "client",
        ],
        must_not_use: &["actix"],
    },
    Layer {
        name: "cli",
        may_import: &[
            "protocol",
            "telemetry",
            "settings",
            "serve",
            "tools",
            "llm",
            "engine",
            "actors",
            "observe",
            "client",
            "bus",
            "manager",
            "console",
            "gateway",
        ],
        must_not_use: &[],
    },
    Layer {
        name: "main",
        may_import: &["telemetry", "cli"],
        must_not_use: &[],
    },
];

/// Imports that break the rule and are known, each as a (file, imported module or crate) pair
/// with a comment saying why it is still there. An entry that no longer matches anything fails
/// the test, so the list only shrinks. Keep it to files whose owner is changing them.
///
/// Empty: the worker's request path (bus/worker.rs, queue.rs, store.rs, heartbeat.rs, mod.rs
/// and actors/), which is being rewritten, already keeps this rule.
const KNOWN_EXCEPTIONS: &[(&str, &str)] = &[];

#[test]
fn every_layer_imports_only_what_the_rule_allows() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    let mut edges = BTreeSet::new();
    for file in rust_files(&root.join("src")) {
        let relative = file
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let source = std::fs::read_to_string(&file).unwrap();
        found.extend(violations(&relative, &source));
        let layer = layer_of(relative.strip_prefix("src/").unwrap());
        for import in scan(&relative, &source).modules {
            edges.insert((layer.clone(), import.module));
        }
    }
    // The scan sees the tree's real imports, not nothing.
    for (from, to) in [
        ("engine", "protocol"),
        ("manager", "client"),
        ("cli", "bus"),
        ("main", "cli"),
    ] {
        assert!(
            edges.contains(&(from.to_string(), to.to_string())),
            "the scan found no import of {to} in {from}: is it reading the code?"
        );
    }
    let mut used = BTreeSet::new();
    let unexpected: Vec<String> = found
        .iter()
        .filter(|v| {
            let known = KNOWN_EXCEPTIONS
                .iter()
                .position(|&(file, import)| file == v.file && import == v.import);
            if let Some(i) = known {
                used.insert(i);
            }
            known.is_none()
        })
        .map(|v| v.to_string())
        .collect();
    assert!(
        unexpected.is_empty(),
        "imports against the layer rule (tests/architecture.rs, LAYERS; ARCHITECTURE.md):\n{}",
        unexpected.join("\n")
    );
    let stale: Vec<_> = KNOWN_EXCEPTIONS
        .iter()
        .enumerate()
        .filter(|(i, _)| !used.contains(i))
        .map(|(_, entry)| entry)
        .collect();
    assert!(
        stale.is_empty(),
        "KNOWN_EXCEPTIONS entries that no longer match anything (remove them): {stale:?}"
    );
}

#[test]
fn every_module_has_a_row_and_every_row_a_module() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules: BTreeSet<String> = rust_files(&src)
        .iter()
        .map(|file| layer_of(&file.strip_prefix(&src).unwrap().to_string_lossy()))
        .collect();
    let rows: BTreeSet<String> = LAYERS.iter().map(|l| l.name.to_string()).collect();
    assert_eq!(
        modules, rows,
        "src/ and the rule name different modules: give a new module its row in LAYERS"
    );
    for (i, layer) in LAYERS.iter().enumerate() {
        for import in layer.may_import {
            let below = LAYERS[..i].iter().any(|l| l.name == *import);
            assert!(
                below,
                "{} may import {import}, which is not listed before it: imports go down",
                layer.name
            );
        }
    }
}

#[test]
fn architecture_md_shows_the_rule() {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("ARCHITECTURE.md"))
            .unwrap();
    let table = rule_table();
    assert!(
        doc.contains(&table),
        "ARCHITECTURE.md does not show the rule of tests/architecture.rs; its table is:\n\n{table}"
    );
}

/// The rule as the Markdown table ARCHITECTURE.md shows.
fn rule_table() -> String {
    let list = |names: &[&str], none: &str| {
        if names.is_empty() {
            none.to_string()
        } else {
            names
                .iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let mut table = String::from(
        "| module | may import (genfleet) | must not use (crates) |\n| --- | --- | --- |\n",
    );
    for layer in LAYERS.iter().rev() {
        table.push_str(&format!(
            "| `{}` | {} | {} |\n",
            layer.name,
            list(layer.may_import, "nothing"),
            list(layer.must_not_use, "no limit")
        ));
    }
    table
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// The top-level module a file under `src/` belongs to, from its path relative to `src/`.
fn layer_of(relative: &str) -> String {
    let first = relative.split('/').next().unwrap();
    let name = first.strip_suffix(".rs").unwrap_or(first);
    // Every file of src/bin is a binary like main.rs.
    if name == "bin" { "main" } else { name }.to_string()
}

/// The module path of a file: `src/engine/chain.rs` is `engine::chain`, `src/engine/mod.rs`
/// is `engine`, `src/lib.rs` and binaries are the root.
fn module_path(relative: &str) -> Vec<String> {
    let inner = relative.strip_prefix("src/").unwrap_or(relative);
    if inner == "lib.rs" || inner == "main.rs" || inner.starts_with("bin/") {
        return Vec::new();
    }
    let inner = inner.strip_suffix(".rs").unwrap_or(inner);
    let mut path: Vec<String> = inner.split('/').map(str::to_string).collect();
    if path.last().is_some_and(|last| last == "mod") {
        path.pop();
    }
    path
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Violation {
    file: String,
    line: usize,
    layer: String,
    /// The genfleet module or external crate.
    import: String,
    /// How the code names it (`crate::bus`, `super::super::manager`, `async_nats`).
    written: String,
    rule: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: {} uses `{}` ({}); rule: {}",
            self.file, self.line, self.layer, self.written, self.import, self.rule
        )
    }
}

/// What one file does against the rule.
fn violations(relative_to_root: &str, source: &str) -> Vec<Violation> {
    let relative = relative_to_root
        .strip_prefix("src/")
        .unwrap_or(relative_to_root);
    let layer_name = layer_of(relative);
    let Some(layer) = LAYERS.iter().find(|l| l.name == layer_name) else {
        return vec![Violation {
            file: relative_to_root.into(),
            line: 1,
            layer: layer_name.clone(),
            import: layer_name,
            written: "(the whole module)".into(),
            rule: "every top-level module needs a row in LAYERS".into(),
        }];
    };
    let scan = scan(relative_to_root, source);
    let may_import = if layer.may_import.is_empty() {
        "nothing of genfleet's".to_string()
    } else {
        layer.may_import.join(", ")
    };
    let broken = |import: Import, rule: String| Violation {
        file: relative_to_root.into(),
        line: import.line,
        layer: layer.name.into(),
        import: import.module,
        written: import.written,
        rule,
    };
    let modules = scan
        .modules
        .into_iter()
        .filter(|i| i.module != layer.name && !layer.may_import.contains(&i.module.as_str()))
        .map(|i| broken(i, format!("{} may import {may_import}", layer.name)));
    let crates = scan
        .crates
        .into_iter()
        .filter(|i| layer.must_not_use.contains(&i.module.as_str()))
        .map(|i| {
            let rule = format!(
                "{} must not use {}",
                layer.name,
                layer.must_not_use.join(", ")
            );
            broken(i, rule)
        });
    modules.chain(crates).collect()
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Import {
    line: usize,
    /// A top-level genfleet module, or an external crate.
    module: String,
    written: String,
}

#[derive(Debug, Default)]
struct Scan {
    modules: Vec<Import>,
    crates: Vec<Import>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Ident(String),
    /// `::`
    Path,
    Open,
    Close,
    Comma,
    Other(char),
}

/// The genfleet modules and the watched external crates one file names.
fn scan(relative_to_root: &str, source: &str) -> Scan {
    let relative = relative_to_root
        .strip_prefix("src/")
        .unwrap_or(relative_to_root);
    let binary = layer_of(relative) == "main";
    let file_path = module_path(relative_to_root);
    let watched: BTreeSet<&str> = LAYERS
        .iter()
        .flat_map(|l| l.must_not_use.iter().copied())
        .collect();
    let tokens = tokens(&code_only(source));
    let mut out = Scan::default();
    // Inline modules (`mod tests { ... }`) open at a brace depth; `super` counts them.
    let mut inline: Vec<usize> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < tokens.len() {
        let (line, token) = &tokens[i];
        let next_is_path = matches!(tokens.get(i + 1), Some((_, Token::Path)));
        match token {
            Token::Open => depth += 1,
            Token::Close => {
                depth = depth.saturating_sub(1);
                if inline.last() == Some(&depth) {
                    inline.pop();
                }
            }
            Token::Ident(word)
                if word == "mod"
                    && matches!(tokens.get(i + 1), Some((_, Token::Ident(_))))
                    && matches!(tokens.get(i + 2), Some((_, Token::Open))) =>
            {
                inline.push(depth);
            }
            // In a binary, `crate` is the binary itself; the library is `genfleet`.
            Token::Ident(word)
                if next_is_path && ((word == "crate" && !binary) || word == "genfleet") =>
            {
                for (at, module) in heads(&tokens, i + 2) {
                    out.modules.push(Import {
                        line: at,
                        written: format!("{word}::{module}"),
                        module,
                    });
                }
            }
            Token::Ident(word) if word == "super" && next_is_path => {
                let mut climbs = 1;
                let mut j = i + 2;
                while matches!(tokens.get(j), Some((_, Token::Ident(w))) if w == "super")
                    && matches!(tokens.get(j + 1), Some((_, Token::Path)))
                {
                    climbs += 1;
                    j += 2;
                }
                let here = file_path.len() + inline.len();
                // Only a chain that reaches the crate root names another top-level module.
                if climbs == here && !binary {
                    for (at, module) in heads(&tokens, j) {
                        out.modules.push(Import {
                            line: at,
                            written: format!("{}{module}", "super::".repeat(climbs)),
                            module,
                        });
                    }
                }
                i = j;
                continue;
            }
            Token::Ident(word) if watched.contains(word.as_str()) => {
                let previous = i.checked_sub(1).map(|p| &tokens[p].1);
                let used = next_is_path
                    || matches!(previous, Some(Token::Ident(w)) if w == "use" || w == "crate")
                    || matches!(previous, Some(Token::Path));
                if used {
                    out.crates.push(Import {
                        line: *line,
                        module: word.clone(),
                        written: word.clone(),
                    });
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The first segments of the path that starts at `tokens[at]`: one name, or each entry of a
/// `{a, b::c, d}` group.
fn heads(tokens: &[(usize, Token)], at: usize) -> Vec<(usize, String)> {
    match tokens.get(at) {
        Some((line, Token::Ident(name))) if name != "self" && name != "super" => {
            vec![(*line, name.clone())]
        }
        Some((_, Token::Open)) => {
            let mut found = Vec::new();
            let mut depth = 0;
            let mut expect_head = true;
            for (line, token) in &tokens[at..] {
                match token {
                    Token::Open => {
                        depth += 1;
                        if depth > 1 {
                            expect_head = false;
                        }
                    }
                    Token::Close => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    Token::Comma if depth == 1 => expect_head = true,
                    Token::Ident(name) if depth == 1 && expect_head => {
                        if name != "self" {
                            found.push((*line, name.clone()));
                        }
                        expect_head = false;
                    }
                    _ => {
                        if depth == 1 {
                            expect_head = false;
                        }
                    }
                }
            }
            found
        }
        _ => Vec::new(),
    }
}

fn tokens(code: &str) -> Vec<(usize, Token)> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push((line, Token::Ident(chars[start..i].iter().collect())));
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push((line, Token::Path));
            i += 2;
        } else {
            let token = match c {
                '{' => Token::Open,
                '}' => Token::Close,
                ',' => Token::Comma,
                other => Token::Other(other),
            };
            out.push((line, token));
            i += 1;
        }
    }
    out
}

/// `source` with comments and the insides of string and character literals blanked; line
/// breaks are kept so that lines still count the same.
fn code_only(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let after_ident = i > 0 && ident(chars[i - 1]);
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut nesting = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    nesting += 1;
                    out.push_str("  ");
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    nesting -= 1;
                    out.push_str("  ");
                    i += 2;
                    if nesting == 0 {
                        break;
                    }
                } else {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
        } else if !after_ident && raw_string_start(&chars, i).is_some() {
            let (open_len, hashes) = raw_string_start(&chars, i).unwrap();
            out.extend(std::iter::repeat_n(' ', open_len));
            i += open_len;
            while i < chars.len() {
                let closes =
                    chars[i] == '"' && (0..hashes).all(|h| chars.get(i + 1 + h) == Some(&'#'));
                if closes {
                    out.extend(std::iter::repeat_n(' ', 1 + hashes));
                    i += 1 + hashes;
                    break;
                }
                out.push(blank(chars[i]));
                i += 1;
            }
        } else if c == '"' {
            out.push('"');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < chars.len() {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
            out.push('"');
            i += 1;
        } else if c == '\'' && next == Some('\\') {
            // An escaped character literal: '\n', '\'', '\u{1F600}'. The quote, the
            // backslash and the escaped character go first, so '\'' ends where it should.
            out.push_str("   ");
            i += 3;
            while i < chars.len() && chars[i] != '\'' {
                out.push(' ');
                i += 1;
            }
            out.push_str("  ");
            i += 1;
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            // A one-character literal; anything else after a quote is a lifetime or a label.
            out.push_str("   ");
            i += 3;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// At a raw string (`r"`, `r#"`, `br##"`...): the length of its opening and its `#` count.
fn raw_string_start(chars: &[char], at: usize) -> Option<(usize, usize)> {
    let mut i = at;
    if chars.get(i) == Some(&'b') {
        i += 1;
    }
    if chars.get(i) != Some(&'r') {
        return None;
    }
    i += 1;
    let mut hashes = 0;
    while chars.get(i) == Some(&'#') {
        hashes += 1;
        i += 1;
    }
    (chars.get(i) == Some(&'"')).then_some((i + 1 - at, hashes))
}

/// The scanner finds what is planted and nothing in comments or literals.
#[test]
fn the_scanner_catches_planted_violations() {
    // (file, source, expected "line:import" of each violation)
    let cases: &[(&str, &str, &[&str])] = &[
        ("src/engine/x.rs", "use crate::bus::worker;\n", &["1:bus"]),
        (
            "src/engine/x.rs",
            "use crate::{\n    protocol::Message,\n    actors::{Supervisor, Submit},\n    llm,\n};\n",
            &["3:actors"],
        ),
        (
            "src/engine/x.rs",
            "fn f() { let s = crate::actors::Stats; }\n",
            &["1:actors"],
        ),
        (
            "src/console/state.rs",
            "use super::super::manager::view::trim_text;\nuse super::feed::Feed;\n",
            &["1:manager"],
        ),
        (
            "src/engine/mod.rs",
            "use super::bus::Client;\nmod tests {\n    use super::*;\n    use super::super::cli;\n}\n",
            &["1:bus", "4:cli"],
        ),
        (
            "src/engine/x.rs",
            "// use crate::bus;\n/* crate::bus /* nested */ crate::bus */\nconst A: &str = \"crate::bus::x\";\nconst B: &str = r#\"crate::bus \"# ;\nconst C: char = '\"';\nfn f<'a>(x: &'a str) { crate::manager::x(x) }\n",
            &["6:manager"],
        ),
        (
            "src/main.rs",
            "use genfleet::bus::client;\nuse genfleet::cli::Cli;\nuse crate::own;\n",
            &["1:bus"],
        ),
        (
            "src/engine/x.rs",
            "use async_nats::Client;\n#[actix::main]\nasync fn main() {}\nlet nats = config.async_nats;\n",
            &["1:async_nats", "2:actix"],
        ),
        (
            "src/protocol/x.rs",
            "use crate::settings::Settings;\nuse tokio::sync::watch;\n",
            &["1:settings", "2:tokio"],
        ),
        (
            "src/actors/x.rs",
            "use crate::engine::Engine;\nuse actix::prelude::*;\n",
            &[],
        ),
        (
            "src/engine/x.rs",
            "const Q: char = '\\'';\nuse crate::bus::x;\n",
            &["2:bus"],
        ),
        ("src/whatever.rs", "fn f() {}\n", &["1:whatever"]),
    ];
    for (file, source, expected) in cases {
        let found: Vec<String> = violations(file, source)
            .iter()
            .map(|v| format!("{}:{}", v.line, v.import))
            .collect();
        assert_eq!(&found, expected, "{file}:\n{source}");
    }
}

#[test]
fn a_violation_names_the_file_the_line_the_import_and_the_rule() {
    let found = violations("src/settings.rs", "\nuse crate::engine::loop_detect::X;\n");
    assert_eq!(
        found[0].to_string(),
        "src/settings.rs:2: settings uses `crate::engine` (engine); rule: settings may import \
         protocol"
    );
}

/// The sibling modules a file of `bus/` names through `super::` (grouped `use super::{a, b}`
/// included), from its code without comments and strings.
fn bus_siblings(source: &str, modules: &[String]) -> Vec<String> {
    let code = code_only(source);
    let mut found = Vec::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("super::") {
        rest = &rest[at + "super::".len()..];
        let names: Vec<&str> = if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            group[..end]
                .split(',')
                .map(|item| item.trim().split("::").next().unwrap_or_default().trim())
                .collect()
        } else {
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            vec![&rest[..end]]
        };
        for name in names {
            if modules.iter().any(|m| m == name) && !found.iter().any(|f| f == name) {
                found.push(name.to_string());
            }
        }
    }
    found
}

/// A cycle in `graph` (module → modules it imports), if any, as the path around it.
fn cycle(graph: &std::collections::BTreeMap<String, Vec<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &std::collections::BTreeMap<String, Vec<String>>,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut around = path[at..].to_vec();
            around.push(node.to_string());
            return Some(around);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, graph, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = std::collections::BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_files_of_the_bus_import_each_other_without_a_loop() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/bus");
    let files: Vec<PathBuf> = rust_files(&dir)
        .into_iter()
        .filter(|f| f.parent() == Some(dir.as_path()) && !f.ends_with("mod.rs"))
        .collect();
    let modules: Vec<String> = files
        .iter()
        .map(|f| f.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    let graph: std::collections::BTreeMap<String, Vec<String>> = files
        .iter()
        .zip(&modules)
        .map(|(file, module)| {
            let source = std::fs::read_to_string(file).unwrap();
            let siblings = bus_siblings(&source, &modules)
                .into_iter()
                .filter(|s| s != module)
                .collect();
            (module.clone(), siblings)
        })
        .collect();
    // It sees the imports that are there.
    assert!(
        graph["submit"].contains(&"admission".to_string()),
        "{graph:?}"
    );
    assert!(graph["wiring"].len() >= 8, "{graph:?}");
    if let Some(around) = cycle(&graph) {
        panic!(
            "the files of src/bus import each other in a loop: {}",
            around.join(" → ")
        );
    }
    // The check itself finds a planted loop.
    let mut planted = graph.clone();
    planted.get_mut("store").unwrap().push("submit".to_string());
    assert!(cycle(&planted).is_some());
}
