//! API keys: known only by their SHA-256, compared in constant time, each standing for a
//! tenant. A key is never stored, logged or echoed; only its tenant travels on.

use subtle::ConstantTimeEq;

use crate::settings::{GatewayKey, GatewaySettings, SettingsError};

/// The keys a gateway accepts. Empty: every caller is let in, as tenant none.
pub struct Keys {
    /// (SHA-256 of the key, tenant).
    hashes: Vec<([u8; 32], String)>,
}

/// Why a caller was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    Missing,
    Wrong,
}

impl Keys {
    /// The keys of the configuration and of `gateway.api_keys_file`.
    pub fn load(settings: &GatewaySettings) -> Result<Keys, SettingsError> {
        let mut keys: Vec<GatewayKey> = settings.api_keys.clone();
        if !settings.api_keys_file.is_empty() {
            let path = &settings.api_keys_file;
            let text = std::fs::read_to_string(path).map_err(|e| {
                SettingsError(format!(
                    "gateway.api_keys_file {path:?} cannot be read: {e}"
                ))
            })?;
            for (number, line) in text.lines().enumerate() {
                let line = line.split('#').next().unwrap_or_default().trim();
                if line.is_empty() {
                    continue;
                }
                let mut words = line.split_whitespace();
                let (Some(sha256), Some(tenant), None) = (words.next(), words.next(), words.next())
                else {
                    return Err(SettingsError(format!(
                        "{path}:{}: expected `<sha256-hex> <tenant>`",
                        number + 1
                    )));
                };
                let key = GatewayKey {
                    sha256: sha256.into(),
                    tenant: tenant.into(),
                };
                key.validate(&format!("{path}:{}", number + 1))?;
                keys.push(key);
            }
        }
        let hashes = keys
            .iter()
            .map(|key| (decode_hex(&key.sha256), key.tenant.clone()))
            .collect();
        Ok(Keys { hashes })
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    /// The tenant of the `Authorization: Bearer <key>` header's key; `Ok(None)` when no key is
    /// configured. Every configured hash is compared, so the time taken tells nothing of which
    /// one matched or how much of it.
    pub fn tenant_of(&self, authorization: Option<&str>) -> Result<Option<String>, Refused> {
        if self.hashes.is_empty() {
            return Ok(None);
        }
        let key = authorization
            .and_then(|value| {
                value
                    .strip_prefix("Bearer ")
                    .or_else(|| value.strip_prefix("bearer "))
            })
            .map(str::trim)
            .filter(|key| !key.is_empty())
            .ok_or(Refused::Missing)?;
        let digest = sha256(key.as_bytes());
        let mut found: Option<&str> = None;
        for (hash, tenant) in &self.hashes {
            if bool::from(hash.ct_eq(&digest)) {
                found = Some(tenant);
            }
        }
        found.map(|t| Some(t.to_string())).ok_or(Refused::Wrong)
    }
}

pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

/// 64 hexadecimal characters (checked by [`GatewayKey::validate`]) to 32 bytes.
fn decode_hex(hex: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0);
    }
    out
}

/// The hex form of a key's SHA-256, as the configuration holds it.
pub fn hash_hex(key: &str) -> String {
    sha256(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyring(pairs: &[(&str, &str)]) -> Keys {
        let mut settings = crate::settings::Settings::defaults().gateway;
        settings.api_keys = pairs
            .iter()
            .map(|(key, tenant)| GatewayKey {
                sha256: hash_hex(key),
                tenant: tenant.to_string(),
            })
            .collect();
        Keys::load(&settings).unwrap()
    }

    #[test]
    fn a_key_is_known_by_its_hash_and_gives_its_tenant() {
        assert_eq!(
            hash_hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let keys = keyring(&[("key-a", "team-a"), ("key-b", "team-b")]);
        assert_eq!(
            keys.tenant_of(Some("Bearer key-b")),
            Ok(Some("team-b".into()))
        );
        assert_eq!(
            keys.tenant_of(Some("bearer key-a")),
            Ok(Some("team-a".into()))
        );
        assert_eq!(keys.tenant_of(Some("Bearer key-c")), Err(Refused::Wrong));
        assert_eq!(keys.tenant_of(Some("key-a")), Err(Refused::Missing));
        assert_eq!(keys.tenant_of(None), Err(Refused::Missing));
        assert_eq!(keyring(&[]).tenant_of(None), Ok(None));
    }

    #[test]
    fn a_key_file_is_read_line_by_line_and_errors_name_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(
            &path,
            format!("# keys\n{} team-c  # the c team\n\n", hash_hex("key-c")),
        )
        .unwrap();
        let mut settings = crate::settings::Settings::defaults().gateway;
        settings.api_keys_file = path.to_string_lossy().into_owned();
        let keys = Keys::load(&settings).unwrap();
        assert_eq!(
            keys.tenant_of(Some("Bearer key-c")),
            Ok(Some("team-c".into()))
        );
        std::fs::write(&path, "abc team-d\n").unwrap();
        let error = Keys::load(&settings).err().unwrap().to_string();
        assert!(error.contains(":1") && error.contains("sha256"), "{error}");
    }
}
