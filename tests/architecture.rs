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
//!
//! Within and across the modules, files do not import each other in a circle: the same
//! scanner builds the file-level import graph of `src/` ([`file_imports`]) and the check fails
//! naming each circle, its own test planting one. And the codemap of ARCHITECTURE.md names
//! every file of `src/`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
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
    // Which request a free slot takes: pure decisions, fed and asked by the actors and the bus.
    Layer {
        name: "schedule",
        may_import: &["protocol", "settings"],
        must_not_use: &["async_nats", "actix", "tokio"],
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
            "schedule",
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
        may_import: &["protocol", "telemetry", "settings", "schedule", "tools"],
        must_not_use: &["actix"],
    },
    Layer {
        name: "bus",
        may_import: &[
            "protocol",
            "telemetry",
            "settings",
            "schedule",
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
            "schedule",
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

/// Circles of imports between files that are known, each as the files of one circle (relative
/// to `src/`, sorted), with a comment saying why it is still there. An entry that no longer
/// matches a circle of the tree exactly fails the test, so the list only shrinks.
const KNOWN_CIRCLES: &[&[&str]] = &[];

/// The file-level import graph of `files` (each a path relative to the repository and its
/// source): every file of the library to the other files of the library it names. A file
/// names another through a path that reaches it: `crate::bus::reply::X` (or `genfleet::` from
/// a binary), `super::reply::X` (counted from the file, and from an inline module such as
/// `mod tests`), `self::reply::X`, or `reply::X` for a child module the file declares with
/// `mod reply;`; grouped forms (`use super::{reply::X, store::{Y, Z}}`) name each of their
/// files. A path names the deepest file module it passes through, and goes on through that
/// file's `pub use` of the next name: `crate::protocol::Usage`, re-exported by
/// `protocol/mod.rs` from `result.rs`, names `protocol/result.rs`.
///
/// What a file takes from the root of a module it is inside (the `mod.rs` of its folder or of
/// a folder above, or `lib.rs`) is not counted: a module's root holding what its files share
/// (`super::Shared`, `super::Generation`) while it declares and uses those files is how a Rust
/// module is built. The circles this graph is for run between files neither of which is the
/// other's root (`report.rs` ⇄ `scheduling.rs`), or out of a folder and back into it.
fn file_imports(files: &[(String, String)]) -> BTreeMap<String, BTreeSet<String>> {
    let modules: BTreeMap<Vec<String>, String> = files
        .iter()
        .filter(|(file, _)| layer_of(file.strip_prefix("src/").unwrap_or(file)) != "main")
        .map(|(file, _)| (module_path(file), file.clone()))
        .collect();
    let named: BTreeMap<&String, Vec<Named>> = files
        .iter()
        .map(|(file, source)| (file, named_paths(file, source)))
        .collect();
    // What each file re-exports: the name outside to the path inside.
    let reexports: BTreeMap<&String, BTreeMap<&str, &[String]>> = named
        .iter()
        .map(|(file, paths)| {
            let names = paths
                .iter()
                .filter_map(|n| Some((n.reexported_as.as_deref()?, n.path.as_slice())))
                .collect();
            (*file, names)
        })
        .collect();
    let resolve = |mut path: Vec<String>| -> Option<&String> {
        // Re-exports of re-exports are followed a few steps, never round in a loop.
        for _ in 0..8 {
            let (len, file) = (0..=path.len())
                .rev()
                .find_map(|len| Some((len, modules.get(&path[..len])?)))?;
            let onward = path
                .get(len)
                .and_then(|name| reexports.get(file)?.get(name.as_str()));
            match onward {
                Some(inside) => path = [inside, &path[len + 1..]].concat(),
                None => return Some(file),
            }
        }
        None
    };
    named
        .iter()
        .map(|(file, paths)| {
            let targets = paths
                .iter()
                .filter_map(|n| resolve(n.path.clone()))
                .filter(|target| target != file && !is_root_of(target, file))
                .cloned()
                .collect();
            ((*file).clone(), targets)
        })
        .collect()
}

/// Whether `root` is the root of a module `file` is inside: `lib.rs`, or a `mod.rs` of its
/// folder or of a folder above.
fn is_root_of(root: &str, file: &str) -> bool {
    (root == "src/lib.rs" || root.ends_with("/mod.rs"))
        && module_path(file).starts_with(&module_path(root))
}

/// A path into the library that a file writes, made absolute (from the crate root).
#[derive(Debug)]
struct Named {
    path: Vec<String>,
    /// The name it is re-exported under, for a path of a `pub use`.
    reexported_as: Option<String>,
}

/// Every path into the library that one file writes.
fn named_paths(relative_to_root: &str, source: &str) -> Vec<Named> {
    let relative = relative_to_root
        .strip_prefix("src/")
        .unwrap_or(relative_to_root);
    let binary = layer_of(relative) == "main";
    let file_path = module_path(relative_to_root);
    let tokens = tokens(&code_only(source));
    let ident =
        |at: usize, word: &str| matches!(tokens.get(at), Some((_, Token::Ident(w))) if w == word);
    let path_at = |at: usize| matches!(tokens.get(at), Some((_, Token::Path)));
    // `pub use`, `pub(crate) use`, `pub(super) use` just before `tokens[at]`.
    let reexport_at = |at: usize| {
        at >= 2
            && ident(at - 1, "use")
            && (ident(at - 2, "pub")
                || (at >= 5
                    && matches!(tokens[at - 2].1, Token::Other(')'))
                    && ident(at - 5, "pub")))
    };
    // `mod reply;`: a child module in a file of its own.
    let children: BTreeSet<String> = tokens
        .windows(3)
        .filter_map(|w| match (&w[0].1, &w[1].1, &w[2].1) {
            (Token::Ident(m), Token::Ident(name), Token::Other(';')) if m == "mod" => {
                Some(name.clone())
            }
            _ => None,
        })
        .collect();
    let mut out = Vec::new();
    let mut inline: Vec<usize> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < tokens.len() {
        let starts_a_path = !(i > 0 && path_at(i - 1)) && path_at(i + 1);
        // Where the tree after the head starts, and the module it is read from.
        let tree = match &tokens[i].1 {
            Token::Open => {
                depth += 1;
                None
            }
            Token::Close => {
                depth = depth.saturating_sub(1);
                if inline.last() == Some(&depth) {
                    inline.pop();
                }
                None
            }
            Token::Ident(word)
                if word == "mod"
                    && matches!(tokens.get(i + 1), Some((_, Token::Ident(_))))
                    && matches!(tokens.get(i + 2), Some((_, Token::Open))) =>
            {
                inline.push(depth);
                None
            }
            Token::Ident(_) if !starts_a_path => None,
            Token::Ident(word) if (word == "crate" && !binary) || word == "genfleet" => {
                Some((i + 2, Vec::new()))
            }
            Token::Ident(word) if word == "super" => {
                let mut climbs = 1usize;
                let mut j = i + 2;
                while ident(j, "super") && path_at(j + 1) {
                    climbs += 1;
                    j += 2;
                }
                let here = file_path.len() + inline.len();
                // Climbing out of inline modules stays in this file.
                let out_of_file = climbs.saturating_sub(inline.len());
                (climbs <= here).then(|| (j, file_path[..file_path.len() - out_of_file].to_vec()))
            }
            Token::Ident(word) if word == "self" => Some((i + 2, file_path.clone())),
            Token::Ident(word) if children.contains(word) => Some((i, file_path.clone())),
            _ => None,
        };
        match tree {
            Some((at, base)) => {
                let reexport = reexport_at(i);
                let mut found = Vec::new();
                i = use_tree(&tokens, at, base, &mut found);
                out.extend(found.into_iter().map(|(path, name)| Named {
                    path,
                    reexported_as: reexport.then_some(name).flatten(),
                }));
            }
            None => i += 1,
        }
    }
    out
}

/// Reads the path (or `use` tree) that starts at `tokens[at]` under `prefix`, pushing every
/// path it names (each entry of a group, groups nested) with the name it is used under (its
/// last segment, or its `as` alias; none for a glob); returns where it ends.
fn use_tree(
    tokens: &[(usize, Token)],
    at: usize,
    prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>)>,
) -> usize {
    let mut path = prefix;
    let mut name: Option<String>;
    let mut i = at;
    loop {
        match tokens.get(i).map(|(_, t)| t) {
            // `{self, X}` names the path so far.
            Some(Token::Ident(word)) if word == "self" => {
                name = path.last().cloned();
                i += 1;
            }
            Some(Token::Ident(word)) => {
                path.push(word.clone());
                name = Some(word.clone());
                i += 1;
            }
            Some(Token::Open) => {
                i += 1;
                while let Some((_, token)) = tokens.get(i) {
                    match token {
                        Token::Close => return i + 1,
                        Token::Comma => i += 1,
                        _ => {
                            let before = i;
                            i = use_tree(tokens, i, path.clone(), out);
                            if i == before {
                                i += 1;
                            }
                        }
                    }
                }
                return i;
            }
            _ => {
                name = None;
                break;
            }
        }
        if matches!(tokens.get(i), Some((_, Token::Path))) {
            i += 1;
        } else {
            break;
        }
    }
    if let (Some((_, Token::Ident(word))), Some((_, Token::Ident(alias)))) =
        (tokens.get(i), tokens.get(i + 1))
        && word == "as"
    {
        name = Some(alias.clone());
        i += 2;
    }
    out.push((path, name));
    i
}

/// The circles of `graph`: its strongly connected components of more than one file, each as
/// its files (sorted) and one way around it.
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<(Vec<String>, Vec<String>)> {
    struct Tarjan<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, node: &'a str) {
            let n = self.index.len();
            self.index.insert(node, n);
            self.low.insert(node, n);
            self.stack.push(node);
            for next in self.graph.get(node).into_iter().flatten() {
                let next = next.as_str();
                if !self.index.contains_key(next) {
                    self.visit(next);
                    let low = self.low[node].min(self.low[next]);
                    self.low.insert(node, low);
                } else if self.stack.contains(&next) {
                    let low = self.low[node].min(self.index[next]);
                    self.low.insert(node, low);
                }
            }
            if self.low[node] == self.index[node] {
                let at = self.stack.iter().rposition(|n| *n == node).unwrap();
                let component: Vec<String> = self.stack.drain(at..).map(str::to_string).collect();
                if component.len() > 1 {
                    self.found.push(component);
                }
            }
        }
    }
    let mut tarjan = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        found: Vec::new(),
    };
    for node in graph.keys() {
        if !tarjan.index.contains_key(node.as_str()) {
            tarjan.visit(node);
        }
    }
    let mut found: Vec<(Vec<String>, Vec<String>)> = tarjan
        .found
        .into_iter()
        .map(|mut files| {
            files.sort();
            let around = way_around(graph, &files);
            (files, around)
        })
        .collect();
    found.sort();
    found
}

/// The shortest way from the first of `files` back to itself through `files` only.
fn way_around(graph: &BTreeMap<String, BTreeSet<String>>, files: &[String]) -> Vec<String> {
    let start = &files[0];
    let mut came_from: BTreeMap<&String, &String> = BTreeMap::new();
    let mut queue = VecDeque::from([start]);
    while let Some(node) = queue.pop_front() {
        for next in graph.get(node).into_iter().flatten() {
            if !files.contains(next) {
                continue;
            }
            if next == start {
                let mut around = vec![start.clone(), node.clone()];
                let mut at = node;
                while let Some(previous) = came_from.get(at) {
                    around.push((*previous).clone());
                    at = previous;
                }
                around.reverse();
                return around;
            }
            if !came_from.contains_key(next) {
                came_from.insert(next, node);
                queue.push_back(next);
            }
        }
    }
    unreachable!("the files of a circle reach each other")
}

/// The sources of `src/`, each with its path relative to the repository.
fn sources() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    rust_files(&root.join("src"))
        .into_iter()
        .map(|file| {
            let relative = file
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            (relative, std::fs::read_to_string(&file).unwrap())
        })
        .collect()
}

#[test]
fn no_files_of_src_import_each_other_in_a_circle() {
    let graph = file_imports(&sources());
    // It sees the imports that are there, in every form.
    for (from, to) in [
        ("src/bus/submit.rs", "src/bus/admission.rs"),
        ("src/llm/mock/server.rs", "src/llm/mock/script.rs"),
        ("src/cli/bench/report.rs", "src/cli/bench/scheduling.rs"),
        ("src/cli/bench/mod.rs", "src/cli/bench/local.rs"),
        ("src/main.rs", "src/cli/mod.rs"),
    ] {
        assert!(
            graph[from].contains(to),
            "the scan found no import of {to} in {from}: is it reading the code?"
        );
    }
    let edges: usize = graph.values().map(BTreeSet::len).sum();
    assert!(
        edges > graph.len(),
        "{edges} imports between {} files",
        graph.len()
    );
    let mut matched = BTreeSet::new();
    let unexpected: Vec<String> = circles(&graph)
        .into_iter()
        .filter(|(files, _)| {
            let files: Vec<&str> = files
                .iter()
                .map(|f| f.strip_prefix("src/").unwrap_or(f))
                .collect();
            let known = KNOWN_CIRCLES.iter().position(|known| *known == files);
            matched.extend(known);
            known.is_none()
        })
        .map(|(files, around)| {
            let mut line = around.join(" → ");
            if files.len() + 1 > around.len() {
                line.push_str(&format!(" (one tangle with {})", files.join(", ")));
            }
            line
        })
        .collect();
    assert!(
        unexpected.is_empty(),
        "files of src/ import each other in a circle (move what both need to a file both \
         import):\n{}",
        unexpected.join("\n")
    );
    let stale: Vec<_> = KNOWN_CIRCLES
        .iter()
        .enumerate()
        .filter(|(i, _)| !matched.contains(i))
        .map(|(_, files)| files)
        .collect();
    assert!(
        stale.is_empty(),
        "KNOWN_CIRCLES entries that are no longer a circle of the tree as listed (remove or \
         correct them): {stale:?}"
    );
}

/// The import graph sees each way a file names another, and the check finds a planted circle.
#[test]
fn the_file_graph_catches_planted_circles() {
    let files = |list: &[(&str, &str)]| -> Vec<(String, String)> {
        list.iter()
            .map(|(f, s)| (f.to_string(), s.to_string()))
            .collect()
    };
    /// Files (path, source), and the files the first of them imports.
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);
    let cases: &[Case] = &[
        (
            &[
                (
                    "src/x/a.rs",
                    "use super::b::B;\nfn f() { crate::x::c::C::new() }\n",
                ),
                ("src/x/b.rs", ""),
                ("src/x/c.rs", ""),
            ],
            &["src/x/b.rs", "src/x/c.rs"],
        ),
        (
            &[
                (
                    "src/x/mod.rs",
                    "mod a;\nmod b;\npub use a::A;\nuse self::b::{B, self};\n",
                ),
                ("src/x/a.rs", ""),
                ("src/x/b.rs", ""),
            ],
            &["src/x/a.rs", "src/x/b.rs"],
        ),
        (
            &[
                (
                    "src/x/a.rs",
                    "use crate::{x::{b::B, c::{self, C}}, y};\nmod tests {\n    use super::*;\n    use super::super::d::D;\n}\n",
                ),
                ("src/x/b.rs", ""),
                ("src/x/c.rs", ""),
                ("src/x/d.rs", ""),
                ("src/y.rs", ""),
            ],
            &["src/x/b.rs", "src/x/c.rs", "src/x/d.rs", "src/y.rs"],
        ),
        (
            &[
                (
                    "src/x/a.rs",
                    "// use super::c;\nconst S: &str = \"crate::x::c\";\nuse super::{Shared, B};\nuse crate::Root;\n",
                ),
                ("src/x/b.rs", ""),
                ("src/x/c.rs", ""),
                (
                    "src/x/mod.rs",
                    "mod a;\nmod b;\nmod c;\npub(crate) use b::B;\n",
                ),
                ("src/lib.rs", "pub mod x;\n"),
            ],
            &["src/x/b.rs"],
        ),
        (
            &[
                ("src/main.rs", "use genfleet::x::a;\nuse crate::own;\n"),
                ("src/x/a.rs", ""),
                ("src/lib.rs", ""),
            ],
            &["src/x/a.rs"],
        ),
    ];
    for (list, expected) in cases {
        let graph = file_imports(&files(list));
        let first = list[0].0;
        let found: Vec<&str> = graph[first].iter().map(String::as_str).collect();
        assert_eq!(&found, expected, "{first}:\n{}", list[0].1);
    }
    // A circle of three siblings, one step through their root's re-export; and a root and
    // its child, which is not one.
    let planted = file_imports(&files(&[
        (
            "src/x/mod.rs",
            "mod a;\nmod b;\nmod c;\npub use c::C;\npub struct Shared;\n",
        ),
        ("src/x/a.rs", "use super::{b::B, Shared};\n"),
        ("src/x/b.rs", "use crate::x::C;\n"),
        ("src/x/c.rs", "fn f() { super::a::A::new() }\n"),
        ("src/y.rs", "use crate::x::a::A;\n"),
    ]));
    assert_eq!(
        circles(&planted),
        [(
            vec![
                "src/x/a.rs".into(),
                "src/x/b.rs".into(),
                "src/x/c.rs".into()
            ],
            vec![
                "src/x/a.rs".into(),
                "src/x/b.rs".into(),
                "src/x/c.rs".into(),
                "src/x/a.rs".into()
            ]
        )]
    );
}

/// The codemap of ARCHITECTURE.md names every file of `src/` (the console's assets included),
/// so a file cannot land without the document saying what it is for. A file is named by its
/// path (`src/telemetry.rs`, `settings/loop_detection.rs`), or by its path from a folder in
/// the entry of that folder (`` `reply.rs` `` in the entry of `src/bus/`, `` `turn.rs` `` in
/// the entry of `generation/` under `src/engine/`); a folder's entry names its `mod.rs`.
#[test]
fn the_codemap_names_every_file_of_src() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let codemap = codemap(&doc).expect("ARCHITECTURE.md has a `## Codemap` section");
    let entries = codemap_entries(codemap);
    let files: Vec<String> = all_files(&root.join("src"))
        .iter()
        .map(|file| {
            file.strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/")
        })
        .collect();
    assert!(files.len() > 100, "{} files under src/", files.len());
    let missing: Vec<&str> = files
        .iter()
        .filter(|file| !codemap_names(codemap, &entries, file))
        .map(String::as_str)
        .collect();
    assert!(
        missing.is_empty(),
        "the codemap of ARCHITECTURE.md does not name these {} files (name each by its path, \
         or by its file name in the entry of its folder):\n{}",
        missing.len(),
        missing.join("\n")
    );
}

/// The `## Codemap` section of ARCHITECTURE.md, without its heading.
fn codemap(doc: &str) -> Option<&str> {
    let start = doc.find("\n## Codemap\n")? + "\n## Codemap\n".len();
    let length = doc[start..].find("\n## ").unwrap_or(doc.len() - start);
    Some(&doc[start..start + length])
}

/// One bullet of the codemap, with the lines that continue it.
#[derive(Debug, PartialEq, Eq)]
struct Entry {
    /// The folder it is about, from the repository: its own when the bullet opens with one
    /// (`` - `src/bus/`: ``, or `` - `generation/`: `` under `src/engine/`), else its parent's.
    folder: String,
    /// Whether the bullet opens with its folder.
    own: bool,
    text: String,
}

fn codemap_entries(codemap: &str) -> Vec<Entry> {
    let mut entries: Vec<Entry> = Vec::new();
    // The open bullets: indentation and folder.
    let mut open: Vec<(usize, String)> = Vec::new();
    for line in codemap.lines() {
        let indent = line.len() - line.trim_start().len();
        let Some(bullet) = line.trim_start().strip_prefix("- ") else {
            if let Some(entry) = entries.last_mut() {
                entry.text.push('\n');
                entry.text.push_str(line);
            }
            continue;
        };
        while open.last().is_some_and(|(at, _)| *at >= indent) {
            open.pop();
        }
        let parent = open
            .last()
            .map(|(_, folder)| folder.clone())
            .unwrap_or_default();
        let opening = bullet
            .strip_prefix('`')
            .and_then(|rest| rest.split('`').next())
            .filter(|name| name.ends_with('/'));
        let folder = match opening {
            Some(name) => format!("{parent}{name}"),
            None => parent,
        };
        open.push((indent, folder.clone()));
        entries.push(Entry {
            folder,
            own: opening.is_some(),
            text: bullet.to_string(),
        });
    }
    entries
}

/// Whether the codemap names `file` (a path from the repository, `src/bus/reply.rs`).
fn codemap_names(codemap: &str, entries: &[Entry], file: &str) -> bool {
    let inner = file.strip_prefix("src/").unwrap_or(file);
    // `bus/reply.rs` counts where it is a whole path, not the tail of `x/bus/reply.rs`.
    let by_path = codemap.contains(file)
        || (inner.contains('/')
            && codemap.match_indices(inner).any(|(at, _)| {
                !codemap[..at]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '/')
            }));
    by_path
        || entries.iter().any(|entry| {
            let Some(rest) = file.strip_prefix(entry.folder.as_str()) else {
                return false;
            };
            !entry.folder.is_empty()
                && (entry.text.contains(&format!("`{rest}`")) || (entry.own && rest == "mod.rs"))
        })
}

/// Every file under `dir`, sorted.
fn all_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            files.extend(all_files(&path));
        } else {
            files.push(path);
        }
    }
    files
}

#[test]
fn the_codemap_check_reads_paths_and_folder_entries() {
    let codemap = "\
- `src/bus/`: the worker. `reply.rs` answers; `tools/run.rs` runs.
  `store.rs` on a line of its own.
- `src/engine/`: one generation.
  - `generation/`: a file per job; `turn.rs` (the turn).
  - `bios.rs`: the BIOS, laid out in `mod.rs`.
- `src/settings.rs`: settings; `settings/loop_detection.rs` its loop detector.
- `src/llm/`: the backends (`mock/`).
";
    let entries = codemap_entries(codemap);
    assert_eq!(
        entries
            .iter()
            .map(|e| (e.folder.as_str(), e.own))
            .collect::<Vec<_>>(),
        [
            ("src/bus/", true),
            ("src/engine/", true),
            ("src/engine/generation/", true),
            ("src/engine/", false),
            ("", false),
            ("src/llm/", true),
        ]
    );
    for (file, named) in [
        ("src/bus/reply.rs", true),
        ("src/bus/store.rs", true),
        ("src/bus/tools/run.rs", true),
        ("src/bus/mod.rs", true),
        ("src/bus/queue.rs", false),
        ("src/engine/generation/turn.rs", true),
        ("src/engine/generation/mod.rs", true),
        ("src/engine/turn.rs", false),
        ("src/engine/mod.rs", true),
        ("src/engine/bios.rs", true),
        ("src/settings.rs", true),
        ("src/settings/loop_detection.rs", true),
        ("src/loop_detection.rs", false),
        ("src/llm/mock/mod.rs", false),
        ("src/llm/mock/script.rs", false),
        ("src/lib.rs", false),
    ] {
        assert_eq!(
            codemap_names(codemap, &entries, file),
            named,
            "{file} named: {}",
            !named
        );
    }
}
