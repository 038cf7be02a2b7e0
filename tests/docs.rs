//! The docs keep up with the code: every configuration key is in docs/configuration.md.

#[test]
fn every_configuration_key_is_documented() {
    let defaults: toml::Table = toml::from_str(genfleet::settings::DEFAULT_TOML).unwrap();
    let reference = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md"),
    )
    .unwrap();
    let mut missing = Vec::new();
    for (section, table) in &defaults {
        for key in table.as_table().expect("sections are tables").keys() {
            let name = format!("`{section}.{key}`");
            if !reference.contains(&name) {
                missing.push(name);
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not in docs/configuration.md (run scripts/config-reference.py): {missing:?}"
    );
}
